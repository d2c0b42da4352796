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
Each file ends with the SHA-256 of its array (checked on load: a damaged entry is rebuilt with a
warning) and is written atomically (temporary file, fsync, rename).

User texts (:func:`load_text_file`) are decoded as their byte-order mark declares or as UTF-8 (or as a
given ``encoding``) and refused, naming the file, when they are not text (NUL or many control characters).
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import importlib.util
import io
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from eqjax.core.errors import InputError
from eqjax.io.atomic import atomic_file

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
    "check_encoding",
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
    (an :class:`~eqjax.core.errors.InputError`, hence a ``ValueError``)."""


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


_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))  # UTF-32 LE before UTF-16 LE: same start
_CONTROL_RE = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # C0 but \t \n \v \f \r; DEL; C1
MAX_CONTROL_SHARE = 0.05  # a larger share of other control characters is not text


def check_encoding(encoding: str, where: str = "--encoding") -> str:
    """The normalized name of a text codec (``utf-16-le``, ``latin-1``, ...), or DataError naming ``where``."""
    try:
        info = codecs.lookup(encoding)
    except (LookupError, TypeError):
        raise DataError(f"unknown text encoding ({where}): expected a Python codec name such as utf-8, utf-16-le "
                        f"or latin-1, found {encoding!r}") from None
    if not getattr(info, "_is_text_encoding", True):
        raise DataError(f"not a text encoding ({where}): expected a codec that decodes bytes to text, found {encoding!r}")
    return info.name


def _detect(raw: bytes) -> str:
    """The encoding a byte-order mark declares, else ``utf-8``."""
    return next((enc for bom, enc in _BOMS if raw.startswith(bom)), "utf-8")


def _decode(p: Path, raw: bytes, encoding: str | None) -> str:
    """``raw`` decoded as ``encoding`` (None: as its byte-order mark declares, else UTF-8), BOM dropped."""
    enc = _detect(raw) if encoding is None else check_encoding(encoding)
    if enc == "utf-8" and b"\0" in raw:  # UTF-16/32 text without a BOM reads as UTF-8 with NUL bytes
        _refuse_nul(p, raw.index(b"\0"), "byte", "UTF-8" if encoding is None else enc)
    try:
        text = raw.decode("utf-8-sig" if enc == "utf-8" else enc)
    except UnicodeDecodeError as e:
        what = "not UTF-8 text" if enc == "utf-8" else f"not {enc} text"
        hint = "convert it to UTF-8 first" if encoding is None else "check --encoding"
        raise DataError(f"{p}: {what} (byte 0x{raw[e.start]:02x} at offset {e.start}: {e.reason}); {hint}") from None
    return text[1:] if text.startswith("\ufeff") else text


def _refuse_nul(p: Path, at: int, unit: str, how: str) -> None:
    raise DataError(
        f"not text ({p}): expected {how} text, found a NUL {unit} at offset {at} "
        "(UTF-16 or UTF-32 without a byte-order mark? pass --encoding, e.g. --encoding utf-16-le)"
    )


def _check_is_text(p: Path, text: str, encoding: str | None) -> None:
    """DataError unless ``text`` reads as text: no NUL characters and at most :data:`MAX_CONTROL_SHARE` of
    control characters (C0 but tab, newlines, vertical tab and form feed; DEL; C1)."""
    how = f"{encoding}" if encoding else "UTF-8"
    if "\0" in text:
        _refuse_nul(p, text.index("\0"), "character", how)
    controls = len(_CONTROL_RE.findall(text))
    if controls > MAX_CONTROL_SHARE * len(text):
        raise DataError(
            f"not text ({p}): expected {how} text, found {controls} control characters in {len(text)} "
            f"(more than {MAX_CONTROL_SHARE:.0%}; a binary file?)"
        )


def load_text_file(path: str | os.PathLike[str], encoding: str | None = None) -> str:
    """A user's plain-text file, CRLF -> LF. ``encoding``: a codec name; None decodes as the file's
    byte-order mark declares (UTF-8, UTF-16, UTF-32), else as UTF-8. The BOM is dropped.

    DataError naming the file if it is missing, not a regular file, empty, not decodable, or not text
    (a NUL character, or a high share of control characters: see :func:`_check_is_text`)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file")
    if not p.is_file():
        raise DataError(f"{p}: not a regular file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"{p}: cannot read the file: {e.strerror or e}") from None
    text = _decode(p, raw, encoding)
    if not text.strip():
        raise DataError(f"{p}: the file is empty" + (" (only whitespace)" if text else ""))
    _check_is_text(p, text, None if encoding is None else check_encoding(encoding))
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
    ``<cache_dir>/tokens-v3-<sha256(text)[:32]>-<sha256(fingerprint)[:32]>.npy``."""
    key = _tokenizer_key(tokenizer)
    if key is None:
        return None
    text_digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    tok_digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
    return cache_dir() / f"tokens-v3-{text_digest}-{tok_digest}.npy"


_SEAL = b"EQJAXSHA256"  # cache file = .npy bytes + _SEAL + SHA-256 of the .npy bytes


def seal_tokens(ids: np.ndarray) -> bytes:
    """The bytes of a token cache file: ``ids`` in ``.npy`` format, then :data:`_SEAL` and the SHA-256 of
    those ``.npy`` bytes (``np.load`` reads the array and ignores the trailer)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(ids, dtype=np.int32), allow_pickle=False)
    body = buf.getvalue()
    return body + _SEAL + hashlib.sha256(body).digest()


def unseal_tokens(blob: bytes) -> np.ndarray | None:
    """The int32 [n] ids of a token cache file, or None when it is cut, altered or not one (hash mismatch)."""
    cut = len(blob) - len(_SEAL) - 32
    if cut < 0 or blob[cut : cut + len(_SEAL)] != _SEAL or hashlib.sha256(blob[:cut]).digest() != blob[-32:]:
        return None
    try:
        ids = np.load(io.BytesIO(blob[:cut]), allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return ids if ids.ndim == 1 and ids.dtype == np.int32 else None


def encode_cached(tokenizer: _Encoder, text: str, *, cache: bool = True) -> np.ndarray:
    """Token ids of ``text`` (no BOS) as int32 [n], cached on disk (content-addressed, see the module docs).

    Tokenizers without a ``fingerprint`` attribute are never cached. Each cache file carries the SHA-256
    of its content (:func:`seal_tokens`): a cut, altered or unreadable one is discarded with a warning,
    recomputed and rewritten; a cache that cannot be written only warns.
    """

    path = cache_path(tokenizer, text) if cache else None
    if path is not None and path.is_file():
        try:
            ids = unseal_tokens(path.read_bytes())
        except OSError:
            ids = None
        if ids is not None:
            return ids
        warnings.warn(f"token cache {path} is damaged (its SHA-256 does not match); rebuilding it", stacklevel=2)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int32).reshape(-1)
    if path is not None:
        try:
            with atomic_file(path, "wb") as f:
                f.write(seal_tokens(ids))
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
