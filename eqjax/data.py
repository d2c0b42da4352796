"""Text for calibration and evaluation, token caching and windowing. Nothing here downloads.

Texts (both ship inside the ``gensim`` wheel, located without importing gensim where possible):

* :func:`wikipedia_articles`: the 206-page English Wikipedia excerpt
  ``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``, main
  namespace, redirects dropped, markup removed with ``gensim.corpora.wikicorpus.filter_wiki``, each article
  stripped, empty ones dropped, in file order (106 articles, 3.10M characters). Licence: CC BY-SA 3.0
  (attribute Wikipedia wherever results on it are shown).
* :func:`news_text`: ``lee_background.cor`` (300 Australian news articles, one per line), a second
  evaluation text from another domain.

Protocol (as in ``REFERENCES.md``): documents are joined with ``"\\n\\n"`` and tokenized whole, no BOS;
:func:`split_wikipedia` cuts the article list at the first article boundary at or after the character
midpoint, so calibration and evaluation never share an article; :func:`token_windows` gives
non-overlapping evaluation windows and :func:`calibration_windows` random windows (fixed seed) of the
calibration tokens.

Token ids are cached as ``.npy`` files (``np.save``/``np.load`` with ``allow_pickle=False``) under
``$EQJAX_CACHE`` or ``~/.cache/eqjax``, content-addressed: the name holds the SHA-256 of the text and
of the tokenizer's fingerprint (itself a hash of the tokenizer's content: the GGUF vocabulary and
merges, or the bytes of ``tokenizer.json``), so a changed text or tokenizer never hits a stale entry.
Cache files are written atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from eqjax.errors import InputError

__all__ = [
    "DataError",
    "WIKIPEDIA_FILE",
    "NEWS_FILE",
    "gensim_test_data",
    "wikipedia_pages",
    "wikipedia_articles",
    "news_articles",
    "news_text",
    "join_documents",
    "split_documents",
    "split_wikipedia",
    "load_text_file",
    "cache_dir",
    "encode_cached",
    "cache_path",
    "wikipedia_tokens",
    "news_tokens",
    "token_windows",
    "calibration_windows",
]

WIKIPEDIA_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
NEWS_FILE = "lee_background.cor"
SEPARATOR = "\n\n"


class DataError(InputError):
    """Text or token data is missing, empty, unreadable or too short for what was asked
    (an :class:`~eqjax.errors.InputError`, hence a ``ValueError``)."""


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


# ---------------------------------------------------------------------------------------- texts
def gensim_test_data(name: str) -> Path:
    """Path of ``gensim/test/test_data/<name>`` in the installed gensim wheel (gensim not imported)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the gensim package is not installed (pip install gensim); it ships the test texts")
    path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / name
    if not path.is_file():
        raise DataError(f"{path} is missing from the installed gensim package")
    return path


@functools.lru_cache(maxsize=1)
def _wikipedia_pages() -> tuple[tuple[str, str], ...]:
    import bz2

    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    out = []
    with bz2.BZ2File(gensim_test_data(WIKIPEDIA_FILE)) as f:
        for title, text, _pageid in extract_pages(f, filter_namespaces=("0",)):
            if not text or text.lstrip()[:9].lower() == "#redirect":
                continue
            clean = filter_wiki(text).strip()
            if clean:
                out.append((title, clean))
    return tuple(out)


def wikipedia_pages() -> list[tuple[str, str]]:
    """``(title, cleaned text)`` of every main-namespace, non-redirect, non-empty article, in file order."""
    return list(_wikipedia_pages())


def wikipedia_articles() -> list[str]:
    """Cleaned text of the Wikipedia articles (see the module docs), in file order."""
    return [text for _, text in _wikipedia_pages()]


def news_articles() -> list[str]:
    """The 300 articles of ``lee_background.cor``, stripped, in file order."""
    text = gensim_test_data(NEWS_FILE).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def news_text() -> str:
    """The news articles joined with ``"\\n\\n"`` (second evaluation text)."""
    return join_documents(news_articles())


def join_documents(docs: Sequence[str]) -> str:
    """Documents joined with ``"\\n\\n"`` (the reference protocol's joining)."""
    return SEPARATOR.join(docs)


def split_documents(docs: Sequence[str]) -> tuple[list[str], list[str]]:
    """Cut ``docs`` at the first document boundary at or after the character midpoint of the joined text.

    Returns ``(first, second)``: both non-empty, disjoint, ``first + second == docs``.
    """
    docs = list(docs)
    if len(docs) < 2:
        raise DataError(f"need at least 2 documents to split into calibration and evaluation, got {len(docs)}")
    total = len(join_documents(docs))
    end = 0
    for k, d in enumerate(docs[:-1], start=1):
        end += len(d) + (len(SEPARATOR) if k > 1 else 0)
        if 2 * end >= total:
            return docs[:k], docs[k:]
    return docs[:-1], docs[-1:]


def split_wikipedia(articles: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    """``(calibration_articles, evaluation_articles)`` of the Wikipedia text (see :func:`split_documents`)."""
    return split_documents(wikipedia_articles() if articles is None else articles)


def load_text_file(path: str | os.PathLike[str]) -> str:
    """A user's UTF-8 plain-text file (BOM dropped, CRLF -> LF). DataError if missing, empty or not UTF-8."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file")
    if not p.is_file():
        raise DataError(f"{p}: not a regular file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"{p}: cannot read the file: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{p}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}: {e.reason}); "
            "convert it to UTF-8 first"
        ) from None
    if not text.strip():
        raise DataError(f"{p}: the file is empty" + (" (only whitespace)" if raw else ""))
    return text.replace("\r\n", "\n")


# ---------------------------------------------------------------------------------------- tokens
def cache_dir() -> Path:
    """Token cache directory: ``$EQJAX_CACHE`` or ``~/.cache/eqjax``."""
    env = os.environ.get("EQJAX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eqjax"


def _tokenizer_key(tokenizer: Any) -> str | None:
    fp = getattr(tokenizer, "fingerprint", None)
    return fp if isinstance(fp, str) and fp else None


def cache_path(tokenizer: Any, text: str) -> Path | None:
    """The cache file of ``text`` under ``tokenizer`` (None for tokenizers without a fingerprint):
    ``<cache_dir>/tokens-v2-<sha256(text)[:32]>-<sha256(fingerprint)[:32]>.npy``."""
    key = _tokenizer_key(tokenizer)
    if key is None:
        return None
    text_digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    tok_digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
    return cache_dir() / f"tokens-v2-{text_digest}-{tok_digest}.npy"


def encode_cached(tokenizer: _Encoder, text: str, *, cache: bool = True) -> np.ndarray:
    """Token ids of ``text`` (no BOS) as int32 [n], cached on disk (content-addressed, see the module docs).

    Tokenizers without a ``fingerprint`` attribute are never cached. A corrupt or unreadable cache file
    is recomputed and rewritten; a cache that cannot be written only warns.
    """
    from eqjax.atomic import atomic_file  # noqa: PLC0415

    path = cache_path(tokenizer, text) if cache else None
    if path is not None and path.is_file():
        try:
            ids = np.load(path, allow_pickle=False)
            if ids.ndim == 1 and ids.dtype == np.int32:
                return ids
        except (OSError, ValueError, EOFError):
            pass
    ids = np.asarray(tokenizer.encode(text), dtype=np.int32).reshape(-1)
    if path is not None:
        try:
            with atomic_file(path, "wb") as f:
                np.save(f, ids, allow_pickle=False)
            os.chmod(path, 0o644)
        except (OSError, InputError) as e:
            warnings.warn(f"could not write the token cache {path}: {e}", stacklevel=2)
    return ids


def wikipedia_tokens(tokenizer: _Encoder, *, cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(calibration_ids, evaluation_ids)``: each half of :func:`split_wikipedia` joined and tokenized
    separately (int32 [n], no BOS), so no token straddles the split."""
    calib, evals = split_wikipedia()
    return (
        encode_cached(tokenizer, join_documents(calib), cache=cache),
        encode_cached(tokenizer, join_documents(evals), cache=cache),
    )


def news_tokens(tokenizer: _Encoder, *, cache: bool = True) -> np.ndarray:
    """Token ids of :func:`news_text` (int32 [n], no BOS)."""
    return encode_cached(tokenizer, news_text(), cache=cache)


def _as_ids(token_ids: Any, what: str) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise DataError(f"{what} must be a 1-D sequence of token ids, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"{what} must be integer token ids, got dtype {ids.dtype}")
    return ids.astype(np.int32, copy=False)


def token_windows(
    token_ids: Sequence[int] | np.ndarray, ctx: int, n_windows: int | None = None, stride: int | None = None
) -> np.ndarray:
    """Consecutive windows ``ids[i*stride : i*stride + ctx]`` as int32 [n, ctx] from the start of the text.

    ``stride`` defaults to ``ctx`` (non-overlapping); ``n_windows`` defaults to all that fit. Raises
    :class:`DataError` when the text is shorter than one window or fewer than ``n_windows`` fit.
    """
    ids = _as_ids(token_ids, "token_ids")
    ctx = int(ctx)
    stride = ctx if stride is None else int(stride)
    if ctx < 1 or stride < 1:
        raise DataError(f"ctx and stride must be >= 1, got ctx={ctx}, stride={stride}")
    if ids.size < ctx:
        raise DataError(f"the text has {ids.size} tokens; one window needs {ctx}")
    fit = (ids.size - ctx) // stride + 1
    n = fit if n_windows is None else int(n_windows)
    if n < 1:
        raise DataError(f"n_windows must be >= 1, got {n}")
    if n > fit:
        raise DataError(
            f"asked for {n} windows of {ctx} tokens (stride {stride}), but the text has {ids.size} tokens: "
            f"only {fit} fit (need {(n - 1) * stride + ctx})"
        )
    starts = np.arange(n, dtype=np.int64) * stride
    return ids[starts[:, None] + np.arange(ctx)]


def calibration_windows(tokens: Sequence[int] | np.ndarray, n: int, ctx: int, seed: int = 0) -> np.ndarray:
    """``n`` random windows of ``ctx`` tokens (int32 [n, ctx]); starts uniform on ``[0, len - ctx]``.

    Pass the *calibration* split's ids (e.g. ``wikipedia_tokens(tok)[0]``); windows may overlap each
    other. Deterministic for a given ``seed`` (``np.random.default_rng``).
    """
    ids = _as_ids(tokens, "calibration tokens")
    if ids.size == 0:
        raise DataError("calibration data is empty (0 tokens)")
    if int(n) < 1 or int(ctx) < 1:
        raise DataError(f"n and ctx must be >= 1, got n={n}, ctx={ctx}")
    if ids.size < ctx:
        raise DataError(f"the calibration text has {ids.size} tokens; one window needs {ctx}")
    starts = np.random.default_rng(seed).integers(0, ids.size - ctx + 1, size=int(n))
    return ids[starts[:, None] + np.arange(int(ctx))]
