"""Hostile text inputs and token-cache damage: a file that is not text in its encoding is refused naming
the file, a byte-order mark or ``encoding`` decodes it as declared, and a damaged token cache is rebuilt."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from eqjax import data
from eqjax.data import DataError, load_text_file

TEXT = "The quick brown fox jumps over the lazy dog. Ça va très bien.\n" * 20


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_utf16_32_without_bom_is_refused(tmp_path: Path, encoding: str) -> None:
    p = tmp_path / "t.txt"
    raw = TEXT.encode(encoding)
    p.write_bytes(raw[2:] if encoding == "utf-16" else raw[4:] if encoding == "utf-32" else raw)
    with pytest.raises(DataError, match=r"not text \(.*t\.txt\): expected UTF-8 text, found a NUL byte.*--encoding"):
        load_text_file(p)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-8-sig"])
def test_bom_decodes_as_declared(tmp_path: Path, encoding: str) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes(TEXT.replace("\n", "\r\n").encode(encoding))  # Python writes the BOM for these codecs
    assert load_text_file(p) == TEXT


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "latin-1", "cp1252"])
def test_encoding_decodes_as_given(tmp_path: Path, encoding: str) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes(TEXT.encode(encoding))
    assert load_text_file(p, encoding) == TEXT


def test_unknown_or_non_text_encoding_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_text(TEXT)
    with pytest.raises(DataError, match=r"unknown text encoding \(--encoding\).*found 'nope'"):
        load_text_file(p, "nope")
    with pytest.raises(DataError, match=r"not a text encoding \(--encoding\).*'base64'"):
        load_text_file(p, "base64")


def test_wrong_encoding_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes("abc".encode("utf-16-le") + b"\x00")  # odd length: truncated UTF-16
    with pytest.raises(DataError, match=r"t\.txt: not utf-16-le text .*check --encoding"):
        load_text_file(p, "utf-16-le")


def test_control_bytes_are_not_text(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes(bytes(range(1, 9)) * 500)  # 4000 C0 control bytes, no NUL
    with pytest.raises(DataError, match=r"not text \(.*t\.txt\): expected UTF-8 text, found 4000 control characters"):
        load_text_file(p)
    p.write_bytes(b"\x00" * 4000)
    with pytest.raises(DataError, match=r"t\.txt.*NUL byte at offset 0"):
        load_text_file(p)


def test_text_with_few_controls_is_text(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    body = "line\twith tab\fand form feed\x1b[1mbold\x1b[0m\n" * 10  # 2 escapes in ~45 characters
    p.write_text(body)
    assert load_text_file(p) == body
    p.write_text("x\x01" * 100)
    with pytest.raises(DataError, match="control characters"):
        load_text_file(p)


@pytest.mark.parametrize("raw", [b"\xef\xbb\xbf", b"\xff\xfe", b"\xff\xfe\x00\x00", b"\xef\xbb\xbf \r\n"])
def test_empty_after_the_bom(tmp_path: Path, raw: bytes) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes(raw)
    with pytest.raises(DataError, match=r"t\.txt: the file is empty"):
        load_text_file(p)


def test_fifo_is_not_read(tmp_path: Path) -> None:
    p = tmp_path / "fifo.txt"
    os.mkfifo(p)
    with pytest.raises(DataError, match=r"fifo\.txt: not a regular file"):
        load_text_file(p)  # returns at once: a FIFO with no writer is never opened


def test_encoding_flag_is_checked_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    from eqjax.cli.main import build_parser

    args = build_parser().parse_args(["eval", "--recipe", "fp", "--encoding", "UTF-16LE"])
    assert args.encoding == "utf-16-le"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "--encoding", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("eqjax: error: argument --encoding: unknown text encoding")


def test_check_text_path_uses_the_encoding(tmp_path: Path) -> None:
    from eqjax.cli.main import _check_text_path

    p = tmp_path / "t.txt"
    p.write_bytes(TEXT.encode("utf-16-le"))
    with pytest.raises(DataError, match="NUL"):
        _check_text_path(str(p))
    _check_text_path(str(p), "utf-16-le")


# ------------------------------------------------------------------------------------ token cache
class _Tok:
    fingerprint = "f" * 64

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return list(text.encode())


def test_cache_file_carries_its_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EQJAX_CACHE", str(tmp_path))
    ids = data.encode_cached(_Tok(), "hello")
    path = data.cache_path(_Tok(), "hello")
    blob = path.read_bytes()
    assert data.unseal_tokens(blob).tolist() == ids.tolist()
    assert np.load(path, allow_pickle=False).tolist() == ids.tolist()  # still an .npy file
    assert data.unseal_tokens(blob[:-1]) is None and data.unseal_tokens(b"") is None


@pytest.mark.parametrize("where", ["data", "header", "digest"])
def test_flipped_bit_in_the_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    monkeypatch.setenv("EQJAX_CACHE", str(tmp_path))
    tok = _Tok()
    ids = data.encode_cached(tok, "hello world")
    path = data.cache_path(tok, "hello world")
    blob = bytearray(path.read_bytes())
    i = {"data": len(blob) - 32 - len(data._SEAL) - 4, "header": 20, "digest": len(blob) - 1}[where]
    blob[i] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.warns(UserWarning, match=r"token cache .* is damaged.*rebuilding"):
        again = data.encode_cached(tok, "hello world")
    assert again.tolist() == ids.tolist() and tok.calls == 2
    assert data.unseal_tokens(path.read_bytes()).tolist() == ids.tolist()  # rewritten whole
    assert data.encode_cached(tok, "hello world").tolist() == ids.tolist() and tok.calls == 2
