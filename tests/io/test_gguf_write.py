"""GGUF export: eqjax's quantized Llama params written as Q4_0 / Q4_1 / Q8_0 blocks and read back.

Oracles: ``gguf.quants.dequantize`` (the gguf package's own decoder of each block type, independent of
the writer) on the written bytes against eqjax's dequantized weights; :func:`load_gguf` of the file; and
llama.cpp's own permutation (the test loader's ``llamacpp_permute``) for the Q/K rows.
"""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
from test_gguf import hf_weights, llamacpp_permute, write_tiny

from eqjax.core.numerics import dequantize_leaf
from eqjax.io.gguf import GGUFError, load_gguf
from eqjax.io.gguf_write import export_gguf, gguf_blocks, permute_qk
from eqjax.methods.rtn import RTN
from eqjax.models import Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import get_recipe, weight_rule
from eqjax.recipes.types import Recipe

DIMS = (64, 96, 4, 2, 16, 1)  # D, F, HQ, HKV, HD, L: every width a multiple of 32


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("src") / "src.gguf", weights=hf_weights(dims=DIMS), dims=DIMS)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_permute_qk_matches_llamacpp():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    np.testing.assert_array_equal(permute_qk(w, 4), llamacpp_permute(w, 4))


@pytest.mark.parametrize("bits, zp, kind", [(4, 8, "Q4_0"), (4, None, "Q4_1"), (8, 128, "Q8_0")])
def test_blocks_decode_with_ggufs_own_dequantizer(bits, zp, kind):
    rng = np.random.default_rng(0)
    rows, K = 3, 96
    codes = rng.integers(0, 2**bits - (bits == 8), (rows, K)) + (bits == 8)
    scales = rng.uniform(0.01, 0.1, (rows, K // 32)).astype(np.float16).astype(np.float32)
    zps = np.full_like(scales, zp, dtype=np.int32) if zp is not None else rng.integers(0, 16, scales.shape)
    got_kind, data = gguf_blocks(codes, scales, zps, bits, "w")
    assert got_kind == kind
    qt = getattr(gguf.GGMLQuantizationType, kind)
    dec = gguf.quants.dequantize(data, qt).reshape(rows, K)
    exact = (codes - np.repeat(zps, 32, axis=1)) * np.repeat(scales, 32, axis=1)
    if kind == "Q4_1":  # m = -scale * zp rounded to float16: within half a float16 ulp of m
        m = np.repeat(scales * zps, 32, axis=1)
        assert np.all(np.abs(dec - exact) <= np.abs(m) * 2.0**-11 + 1e-7)
    else:
        np.testing.assert_array_equal(dec, exact.astype(np.float32))


@pytest.mark.parametrize("recipe", ["w4g32-sym", "w4g64-asym", "w8", "w4g32-sym+emb-int8"])
def test_export_reads_back_as_eqjax_weights(source, tmp_path, recipe):
    cfg, params, _ = load_gguf(source)
    model = Model(cfg)
    name, _, emb = recipe.partition("+")
    rule = {"w4g32-sym": weight_rule(4, group=32), "w4g64-asym": weight_rule(4, symmetric=False, group=64),
            "w8": weight_rule(8)}[name]
    steps = (RTN((rule,)),) + (get_recipe("fp+" + emb).steps if emb else ())
    q = quantize(params, Recipe(recipe, steps), model=model)
    out = tmp_path / "m.gguf"
    info = export_gguf(q, out, source=source)
    want = {"w4g32-sym": "Q4_0", "w4g64-asym": "Q4_1", "w8": "Q8_0"}[name]
    assert info["tensor_types"][want] == 7 and (emb or info["file_type"] == want)  # file_type: the most bytes
    assert info["tensor_types"].get("Q8_0" if emb else "F32") >= 1
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == want and types["blk.0.attn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == ("Q8_0" if emb else "F32")
    assert reader.fields["tokenizer.ggml.tokens"].contents()[:2] == gguf.GGUFReader(source).fields[
        "tokenizer.ggml.tokens"].contents()[:2]
    # read back through eqjax's loader: every weight equals eqjax's own dequantized weight (Q4_1: m rounded)
    _, back, _ = load_gguf(out)
    fb, fq = _flat(back), _flat(q)
    assert fb.keys() == fq.keys()
    rounded = want == "Q4_1"
    for p, leaf in fq.items():
        ref = np.asarray(dequantize_leaf(leaf), np.float32)
        got = np.asarray(fb[p])
        scale = np.asarray(getattr(leaf, "scale", np.float32(1)), np.float32)
        if want == "Q4_1" and p.startswith("layers"):
            np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max())
        elif np.array_equal(scale.astype(np.float16).astype(np.float32), scale):  # float16 scales (groups): exact
            np.testing.assert_array_equal(got, ref, err_msg=p)
        else:  # float32 per-channel scales, rounded to GGUF's float16 d: relative error <= 2**-11
            assert np.all(np.abs(got - ref) <= np.abs(ref) * 2.0**-11 + 1e-30), p
            rounded = True
    # and the model computes the same logits from the file (exactly, up to float summation, where no
    # scale or m was rounded to float16; random weights of std 1 amplify those roundings)
    ids = jax.numpy.asarray([[1, 5, 9, 200, 3]])
    got, ref = np.asarray(model.apply(back, ids)[0]), np.asarray(model.apply(q, ids)[0])
    tol = (2e-2 if rounded else 1e-5) * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)


@pytest.mark.parametrize("recipe, match", [
    ("w8a8-naive", "activation quantization"),
    ("w3g128-rtn", "3-bit"),
    ("w4g16", "every 16 inputs"),
])
def test_unrepresentable_params_are_refused_before_writing(source, tmp_path, recipe, match):
    cfg, params, _ = load_gguf(source)
    model = Model(cfg)
    r = (Recipe("w4g16", (RTN((weight_rule(4, group=16),)),)) if recipe == "w4g16" else get_recipe(recipe))
    q = quantize(params, r, model=model)
    out = tmp_path / "m.gguf"
    with pytest.raises(GGUFError, match=match):
        export_gguf(q, out, source=source)
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_smollm2_w4_gguf_has_eqjaxs_perplexity(tmp_path):
    """SmolLM2: W4 g128 asymmetric (Q4_1 blocks, the ragged 576 = 4 x 128 + 64 inputs included) + the table
    int8 (Q8_0); the file read back by eqjax's GGUF loader has eqjax's own perplexity (m and the table's row
    scales rounded to float16). The writer takes QArrays whatever method chose the codes (GPTQ's codes
    are written by the tiny model's tests and the calibrated CLI export below)."""
    from eqjax.data import token_windows, wikipedia_tokens
    from eqjax.evaluate import perplexity
    from eqjax.io.gguf import default_model_path

    out = tmp_path / "smollm2-w4.gguf"
    cfg, params, tok = load_gguf(default_model_path())
    model = Model(cfg)
    _, eval_ids = wikipedia_tokens(tok)
    q = quantize(params, get_recipe("w4g128-rtn+emb-int8"), model=model)
    export_gguf(q, out, source=default_model_path())
    windows = token_windows(eval_ids, 256, 2)
    _, back, tok2 = load_gguf(out)
    assert tok2.encode("The capital of France") == tok.encode("The capital of France")
    ours, theirs = perplexity(model, q, windows).ppl, perplexity(model, back, windows).ppl
    assert abs(theirs / ours - 1) < 2e-3, (ours, theirs)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.3.ffn_down.weight"] == "Q4_1" and types["token_embd.weight"] == "Q8_0"


def test_cli_calibrated_export_takes_the_calibration_flags(source, tmp_path, capsys):
    """``export-gguf`` with a calibrated recipe quantizes on ``--calib-windows`` windows of ``--calib-len``
    tokens and writes Q4_1 blocks (asymmetric GPTQ)."""
    from eqjax.cli.main import main

    out = tmp_path / "g.gguf"
    assert main(["export-gguf", "--model", str(source), "--recipe", "w4g128-gptq", "--out", str(out),
                 "--calib-windows", "2", "--calib-len", "32"]) == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q4_1"


@pytest.mark.parametrize("argv, match", [
    (["--recipe", "w8a8-smoothquant"], "SmoothQuant"),
    (["--recipe", "w3g128-gptq"], "3-bit"),
    (["--recipe", "kv4"], "KV cache"),
    (["--recipe", "nope"], "unknown recipe"),
])
def test_cli_refuses_before_work(tmp_path, capsys, argv, match):
    from eqjax.cli.main import main

    out = tmp_path / "x.gguf"
    assert main(["export-gguf", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eqjax: error:") and match in err[0], err
    assert not out.exists()


def test_cli_keeps_an_existing_file_unless_overwrite(source, tmp_path, capsys):
    """An existing --out is refused before any work (one line, exit 2, the file untouched); with
    --overwrite it is replaced by a complete GGUF file (written beside it, then renamed)."""
    from eqjax.cli.main import main

    out = tmp_path / "m.gguf"
    out.write_bytes(b"previous")
    args = ["export-gguf", "--model", str(source), "--recipe", "w4g128-rtn-sym", "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite" in err[0], err
    assert out.read_bytes() == b"previous"
    assert main(args + ["--overwrite"]) == 0
    assert "file type Q4_0" in capsys.readouterr().out
    assert out.read_bytes()[:4] == b"GGUF" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    assert load_gguf(out)[0].hidden == DIMS[0]


def test_half_floats_are_written_as_f16(source, tmp_path):
    """``+f16``: the table and norms as GGUF ``F16`` tensors, read back bit-exact."""
    from eqjax.core.pytree import flatten

    cfg, params, _ = load_gguf(source)
    q = quantize(params, get_recipe("w4g128-rtn-sym+f16"), model=Model(cfg))
    info = export_gguf(q, tmp_path / "m.gguf", source=source)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["token_embd.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F16"
    assert types["blk.0.attn_q.weight"] == "Q4_0" and info["check"]["F16"] == 0.0
    back = dict(flatten(load_gguf(tmp_path / "m.gguf")[1]))
    for path, leaf in flatten(q):
        np.testing.assert_array_equal(np.asarray(back[path], np.float32), np.asarray(dequantize_leaf(leaf), np.float32),
                                      err_msg=path)


def test_read_back_check_reads_every_piece_of_the_file(source, tmp_path, monkeypatch):
    """The read-back check dequantizes the file's own bytes a few rows at a time: the same figures in pieces of
    two rows as in one, 0 for exact Q4_0 blocks, and a flipped byte in the last row of one tensor is seen."""
    import eqjax.io.gguf_write as gw
    from eqjax.io.gguf import tensor_plan

    cfg, params, _ = load_gguf(source)
    q = quantize(params, Recipe("w4g32-sym", (RTN((weight_rule(4, group=32),)),)), model=Model(cfg))
    out = tmp_path / "m.gguf"
    info = export_gguf(q, out, source=source)
    assert info["check"]["Q4_0"] == 0.0
    plan = {n: (w, lin, h) for n, (w, _, lin, h) in tensor_plan(cfg, tied="lm_head" not in q).items()}
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    kinds = {n: t.tensor_type.name for n, t in tensors.items()}
    monkeypatch.setattr(gw, "_CHECK_PIECE", 2 * 18 * 96 // 32)  # two rows of ffn_down's Q4_0 blocks
    get = lambda where: gw._get(q, where, "q")  # noqa: E731
    assert gw._check(out, cfg, get, plan, kinds) == info["check"]
    t = tensors["blk.0.ffn_down.weight"]
    data = bytearray(out.read_bytes())
    data[int(t.data_offset) + int(t.n_bytes) - 1] ^= 0xFF
    out.write_bytes(bytes(data))
    assert gw._check(out, cfg, get, plan, kinds)["Q4_0"] > 0
