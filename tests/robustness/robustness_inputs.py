"""Robustness cases: inputs. Every weight file of an HF directory is read and checked (shards, conflicts,
index, headers), config values that cannot work are refused naming the key (config.json and GGUF
metadata), a text that is not text is refused naming the file, and a damaged token cache is rebuilt."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
from typing import Any, Callable
from unittest import mock

from robustness_fixtures import Case, Fixtures, Result, write_gguf

ON_MODEL = ["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64", "--recipe", "fp"]
ON_TEXT = ["eval", "--model", "{tiny}", "--text", "{t}", "--eval-len", "32", "--eval-tokens", "64", "--recipe", "fp"]

Setup = Callable[[Fixtures, pathlib.Path], dict[str, str]]


def _tiny_copy(edit: Callable[[pathlib.Path], None]) -> Setup:
    """A copy of the tiny HF model, edited."""
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        d = work / "m"
        shutil.copytree(fx.root / "tiny", d)
        edit(d)
        return {"m": str(d), "json_out": str(work / "row.json")}
    return setup


def _split_shards(d: pathlib.Path) -> list[str]:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i, f in enumerate(shards):
        save_file({n: tensors[n] for n in names[i::2]}, str(d / f))
    return shards


def _index(body: Any) -> Callable[[pathlib.Path], None]:
    def edit(d: pathlib.Path) -> None:
        shards = _split_shards(d)
        text = body if isinstance(body, str) else json.dumps(body(shards))
        (d / "model.safetensors.index.json").write_text(text)
    return edit


def _config(**change: Any) -> Callable[[pathlib.Path], None]:
    def edit(d: pathlib.Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(change)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _negative_offset(d: pathlib.Path) -> None:
    p = d / "model.safetensors"
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["model.norm.weight"]["data_offsets"][0] = -4
    blob = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


def _cut_mid_tensor(d: pathlib.Path) -> None:
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])


def _zero_heads_gguf(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    import gguf

    def zero(self: Any, n: int) -> None:
        self.add_uint32("llama.attention.head_count", 0)

    with mock.patch.object(gguf.GGUFWriter, "add_head_count", zero):
        return {"m": str(write_gguf(work / "h0.gguf"))}


def _text(data: bytes) -> Setup:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        (work / "t.txt").write_bytes(data)
        return {"t": str(work / "t.txt"), "json_out": str(work / "row.json")}
    return setup


def _fifo(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    os.mkfifo(work / "t.txt")
    return {"t": str(work / "t.txt")}


def _row_ok(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    p = pathlib.Path(v["json_out"])
    if not p.is_file():
        return f"no result file {p}"
    ppl = json.loads(p.read_text()).get("ppl")
    return None if isinstance(ppl, (int, float)) and 1 < ppl < float("inf") else f"bad ppl {ppl!r}"


def _same_row_as_tiny(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    """The split model's ppl equals the unsplit one's (both shards were read)."""
    from robustness_run import run_cli_inprocess

    problem = _row_ok(fx, work, v, res)
    if problem:
        return problem
    ref = work / "ref.json"
    run_cli_inprocess(["eval", "--model", v["tiny"], "--text", v["text"], "--eval-len", "32", "--eval-tokens", "64",
                       "--recipe", "fp", "--json", str(ref)])
    a, b = (json.loads(pathlib.Path(p).read_text())["ppl"] for p in (v["json_out"], ref))
    return None if a == b else f"ppl {a} of the shards, {b} of the single file"


def api_flipped_token_cache(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    """Tokenize, flip one bit of the cache file's data, tokenize again: the ids must be the true ones."""
    from eqjax.data import cache_path, encode_cached
    from eqjax.io import HFTokenizer

    os.environ["EQJAX_CACHE"] = str(work / "cache")
    tok = HFTokenizer(fx.root / "tiny" / "tokenizer.json")
    text = (fx.root / "text.txt").read_text()
    encode_cached(tok, text)
    p = cache_path(tok, text)
    blob = bytearray(p.read_bytes())
    blob[len(blob) // 2] ^= 0x04
    p.write_bytes(bytes(blob))
    return encode_cached(tok, text).tolist(), tok.encode(text)


def _true_ids(fx: Fixtures, work: pathlib.Path, v: dict, res: Result) -> str | None:
    got, truth = res.value
    return None if got == truth else "ids from a damaged token cache were used"


def inputs_cases() -> list[Case]:
    """The inputs cases of the catalogue."""
    T = "inputs"
    missing = lambda s: {"weight_map": {"model.norm.weight": "model-00003-of-00003.safetensors"}}  # noqa: E731
    return [
        Case("inputs: two safetensors shards, no index", T, expect="ok", argv=[*ON_MODEL, "--json", "{json_out}"],
             setup=_tiny_copy(_split_shards), check=_same_row_as_tiny),
        Case("inputs: a second complete weight file", T, argv=ON_MODEL,
             cause=r"duplicate tensor \(.*copy\.safetensors, .*model\.safetensors\)",
             setup=_tiny_copy(lambda d: shutil.copy(d / "model.safetensors", d / "copy.safetensors"))),
        Case("inputs: index names a missing shard", T, argv=ON_MODEL,
             cause=r"lists shard model-00003-of-00003\.safetensors, which is missing", setup=_tiny_copy(_index(missing))),
        Case("inputs: index JSON is not an object", T, argv=ON_MODEL,
             cause=r"bad safetensors index \(.*index\.json\).*found list", setup=_tiny_copy(_index("[1, 2]"))),
        Case("inputs: a weight file that is a directory", T, argv=ON_MODEL,
             cause=r"x\.safetensors\): expected a regular file, found a directory",
             setup=_tiny_copy(lambda d: (d / "x.safetensors").mkdir())),
        Case("inputs: safetensors header with a negative offset", T, argv=ON_MODEL,
             cause=r"model\.safetensors: not a valid safetensors file.*model\.norm\.weight.*data_offsets",
             setup=_tiny_copy(_negative_offset)),
        Case("inputs: shard cut in the middle of a tensor", T, argv=ON_MODEL,
             cause=r"model\.safetensors: not a valid safetensors file \(truncated: tensor model\.\S+ needs",
             setup=_tiny_copy(_cut_mid_tensor)),
        Case("inputs: config.json rope_theta = 0", T, argv=ON_MODEL,
             cause=r"config\.json: rope_theta\): expected a finite number > 0, found 0", setup=_tiny_copy(_config(rope_theta=0))),
        Case("inputs: config.json num_attention_heads = 0", T, argv=ON_MODEL,
             cause=r"config\.json: num_attention_heads\): expected an integer >= 1, found 0",
             setup=_tiny_copy(_config(num_attention_heads=0))),
        Case("inputs: config.json kv heads do not divide heads", T, argv=ON_MODEL,
             cause=r"config\.json: num_key_value_heads\): expected a divisor of num_attention_heads 2, found 3",
             setup=_tiny_copy(_config(num_key_value_heads=3))),
        Case("inputs: config.json vocab_size = -1", T, argv=ON_MODEL,
             cause=r"config\.json: vocab_size\): expected an integer >= 1, found -1", setup=_tiny_copy(_config(vocab_size=-1))),
        Case("inputs: config.json width disagrees with the tensors", T, argv=ON_MODEL,
             cause=r"model\.safetensors: tensor model\.\S+ has shape .* but config\.json implies",
             setup=_tiny_copy(_config(intermediate_size=96))),
        Case("inputs: GGUF with head_count 0", T, argv=ON_MODEL,
             cause=r"h0\.gguf: llama\.attention\.head_count\): expected an integer >= 1, found 0", setup=_zero_heads_gguf),
        Case("inputs: text in UTF-16 without a BOM", T, argv=ON_TEXT, cause=r"not text \(.*t\.txt\).*NUL.*--encoding",
             setup=_text(("The quick brown fox. " * 200).encode("utf-16-le"))),
        Case("inputs: text of 4000 control bytes", T, argv=ON_TEXT,
             cause=r"not text \(.*t\.txt\).*4000 control characters", setup=_text(bytes(range(1, 9)) * 500)),
        Case("inputs: text in UTF-16 with a BOM evaluates", T, expect="ok", argv=[*ON_TEXT, "--json", "{json_out}"],
             setup=_text(("The quick brown fox jumps over the lazy dog. " * 80).encode("utf-16")), check=_row_ok),
        Case("inputs: text that is only a BOM", T, argv=ON_TEXT, cause=r"t\.txt: the file is empty",
             setup=_text(b"\xef\xbb\xbf")),
        Case("inputs: text that is a FIFO", T, argv=ON_TEXT, cause=r"t\.txt: not a regular file", setup=_fifo),
        Case("inputs: --encoding not a codec", T, argv=[*ON_TEXT, "--encoding", "klingon"],
             cause=r"--encoding.*unknown text encoding.*'klingon'", setup=_text(b"hello " * 100)),
        Case("inputs: token cache with a flipped bit", T, expect="ok", api=api_flipped_token_cache, check=_true_ids),
    ]
