"""Texts, split, windows and the token cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eqjax import data
from eqjax.data import DataError


class CountingTokenizer:
    """Bytes as ids; counts encode calls; has a fingerprint so it is cached."""

    fingerprint = "f" * 64

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return list(text.encode("utf-8"))


# ------------------------------------------------------------------------------------ windows
def test_token_windows_non_overlapping() -> None:
    ids = np.arange(10)
    w = data.token_windows(ids, 3)
    assert w.dtype == np.int32 and w.shape == (3, 3)
    np.testing.assert_array_equal(w, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    np.testing.assert_array_equal(data.token_windows(ids, 3, n_windows=2), [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(data.token_windows(ids, 4, stride=5), [[0, 1, 2, 3], [5, 6, 7, 8]])
    assert len(np.unique(data.token_windows(np.arange(4096), 512))) == 4096


def test_token_windows_errors() -> None:
    with pytest.raises(DataError, match="has 5 tokens; one window needs 8"):
        data.token_windows(np.arange(5), 8)
    with pytest.raises(DataError, match=r"asked for 4 windows of 3 tokens.*10 tokens: only 3 fit \(need 12\)"):
        data.token_windows(np.arange(10), 3, n_windows=4)
    with pytest.raises(DataError, match="1-D"):
        data.token_windows(np.zeros((2, 8), np.int32), 4)
    with pytest.raises(DataError, match="integer"):
        data.token_windows(np.zeros(8, np.float32), 4)
    with pytest.raises(DataError, match=">= 1"):
        data.token_windows(np.arange(8), 0)


def test_calibration_windows_deterministic() -> None:
    ids = np.arange(1000, dtype=np.int32)
    a = data.calibration_windows(ids, 16, 64, seed=0)
    b = data.calibration_windows(ids, 16, 64, seed=0)
    c = data.calibration_windows(ids, 16, 64, seed=1)
    assert a.shape == (16, 64) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(np.diff(a, axis=1), 1)  # contiguous slices of the text
    assert a.min() >= 0 and a.max() <= 999
    np.testing.assert_array_equal(data.calibration_windows(ids[:64], 3, 64, seed=5), np.tile(ids[:64], (3, 1)))


def test_calibration_windows_errors() -> None:
    with pytest.raises(DataError, match="calibration data is empty"):
        data.calibration_windows(np.zeros(0, np.int32), 4, 8)
    with pytest.raises(DataError, match="has 7 tokens; one window needs 8"):
        data.calibration_windows(np.arange(7), 4, 8)


# ------------------------------------------------------------------------------------ split
def test_split_documents_disjoint_at_midpoint() -> None:
    docs = ["a" * 10, "b" * 10, "c" * 50, "d" * 10]
    first, second = data.split_documents(docs)
    assert first + second == docs and first and second
    assert first == docs[:3]  # midpoint (char 43 of 86) falls inside "c..."; cut after it
    assert data.split_documents(["x" * 10, "y" * 10]) == (["x" * 10], ["y" * 10])
    with pytest.raises(DataError, match="at least 2"):
        data.split_documents(["only one"])


@pytest.fixture(scope="module")
def articles() -> list[str]:
    return data.wikipedia_articles()


def test_wikipedia_articles(articles: list[str]) -> None:
    assert len(articles) == 106
    assert sum(map(len, articles)) == 3_102_949
    assert articles[0].startswith("'''Anarchism''' is a political philosophy")
    assert all(a == a.strip() and a for a in articles)
    assert not any(a.lower().startswith("#redirect") for a in articles)
    titles = [t for t, _ in data.wikipedia_pages()]
    assert len(set(titles)) == len(titles) == 106


def test_wikipedia_split_disjoint_and_deterministic(articles: list[str]) -> None:
    calib, evals = data.split_wikipedia()
    assert calib + evals == articles and calib and evals
    assert not set(calib) & set(evals)
    joined = data.join_documents(articles)
    head = len(data.join_documents(calib))
    assert head >= len(joined) / 2 and head - len(calib[-1]) - 2 < len(joined) / 2  # first boundary after midpoint
    assert (len(calib), len(evals)) == (49, 57)
    again = [text for _, text in data._wikipedia_pages.__wrapped__()]  # re-parse from the file
    assert again == articles
    assert data.split_wikipedia(again) == (calib, evals)


def test_news_text() -> None:
    arts = data.news_articles()
    text = data.news_text()
    assert len(arts) == 300 and text == "\n\n".join(arts)
    assert text.startswith("Hundreds of people have been forced to vacate their homes")


# ------------------------------------------------------------------------------------ files
def test_load_text_file(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes("\ufeffline one\r\nline two – ünïcode\n".encode())
    assert data.load_text_file(p) == "line one\nline two – ünïcode\n"
    with pytest.raises(DataError, match=r"missing\.txt: no such file"):
        data.load_text_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.txt: the file is empty"):
        data.load_text_file(tmp_path / "empty.txt")
    (tmp_path / "blank.txt").write_bytes(b" \n\t\n")
    with pytest.raises(DataError, match="only whitespace"):
        data.load_text_file(tmp_path / "blank.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ok".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8 text \(byte 0xe9 at offset 3"):
        data.load_text_file(tmp_path / "latin1.txt")
    with pytest.raises(DataError, match="not a regular file"):
        data.load_text_file(tmp_path)


# ------------------------------------------------------------------------------------ cache
def test_encode_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EQJAX_CACHE", str(tmp_path / "cache"))
    assert data.cache_dir() == tmp_path / "cache"
    tok = CountingTokenizer()
    ids = data.encode_cached(tok, "héllo")
    assert ids.dtype == np.int32 and ids.tolist() == list("héllo".encode())
    files = list((tmp_path / "cache").glob("tokens-*.npy"))
    assert len(files) == 1
    np.testing.assert_array_equal(np.load(files[0], allow_pickle=False), ids)
    again = data.encode_cached(tok, "héllo")
    assert tok.calls == 1 and again.tolist() == ids.tolist()
    data.encode_cached(tok, "other text")
    assert tok.calls == 2 and len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 2
    files[0].write_bytes(b"garbage")  # a corrupt entry is recomputed and rewritten, with a warning
    with pytest.warns(UserWarning, match="token cache .* is damaged"):
        assert data.encode_cached(tok, "héllo").tolist() == ids.tolist() and tok.calls == 3
    assert np.load(files[0], allow_pickle=False).tolist() == ids.tolist()
    data.encode_cached(tok, "héllo", cache=False)
    assert tok.calls == 4


def test_encode_cached_keyed_by_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EQJAX_CACHE", str(tmp_path))
    a, b = CountingTokenizer(), CountingTokenizer()
    b.fingerprint = "0" * 64
    data.encode_cached(a, "same text")
    data.encode_cached(b, "same text")
    assert a.calls == b.calls == 1 and len(list(tmp_path.glob("*.npy"))) == 2

    class NoFingerprint:
        def encode(self, text: str) -> list[int]:
            return [1, 2]

    data.encode_cached(NoFingerprint(), "same text")
    assert len(list(tmp_path.glob("*.npy"))) == 2  # never cached without a fingerprint


@pytest.mark.slow
def test_wikipedia_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from eqjax.io.gguf import load_tokenizer

    monkeypatch.setenv("EQJAX_CACHE", str(tmp_path))
    tok = load_tokenizer()
    calib, evals = data.wikipedia_tokens(tok)
    assert (calib.size, evals.size) == (368_233, 362_454)
    assert data.token_windows(evals, 1024, n_windows=32).shape == (32, 1024)
    w = data.calibration_windows(calib, 128, 512, seed=0)
    assert w.shape == (128, 512)
    c2, e2 = data.wikipedia_tokens(tok)  # from the cache
    np.testing.assert_array_equal(c2, calib)
    np.testing.assert_array_equal(e2, evals)
    assert data.news_tokens(tok).size == 75_678
