"""compressed-tensors checkpoints against the format's own package and transformers (the independent oracles):
the package packs and decompresses what eqjax writes to eqjax's weights exactly, transformers 4.57 loads it and
computes eqjax's logits, and checkpoints the package makes load into eqjax's QArrays without a float detour."""

from __future__ import annotations

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.config import CompressionFormat  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402

import eqjax.cli.sources as sources  # noqa: E402
from eqjax.cli.main import main  # noqa: E402
from eqjax.core.numerics import dequantize_leaf  # noqa: E402
from eqjax.core.qarray import ActQuantKernel, QArray  # noqa: E402
from eqjax.io.compressed_tensors import (  # noqa: E402
    FormatError,
    check_recipe,
    load_compressed_tensors,
    save_compressed_tensors,
    stream_compressed_tensors,
)
from eqjax.io.hf import load_hf_checkpoint  # noqa: E402
from eqjax.io.hf_quantized import pack_int32, unpack_int32  # noqa: E402
from eqjax.io.load import stream_model  # noqa: E402
from eqjax.recipes.apply import quantize  # noqa: E402
from eqjax.recipes.registry import get_recipe  # noqa: E402

pytestmark = pytest.mark.reference
EPS32 = float(np.finfo(np.float32).eps)
IDS = np.arange(3, 43, dtype=np.int32)[None]


def _is_q(x):
    return isinstance(x, (QArray, ActQuantKernel))


@pytest.fixture(scope="module")
def fp_dir(tmp_path_factory) -> pathlib.Path:
    """A random Llama in transformers' own code; hidden 160 makes group 128 ragged (128 + 32), the head untied."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=160, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("ct") / "fp"
    transformers.LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def quantized(fp_dir):
    """recipe -> (model, qparams, written directory) (file dtype float32: the integers and scales exactly)."""
    model, params = load_hf_checkpoint(fp_dir)
    cal = np.random.default_rng(0).integers(0, 256, (4, 32)).astype(np.int32)
    out = {}
    for name in ("w4g128-rtn", "w4g128-rtn-sym", "w8-zeropoint", "w8a8-smoothquant"):
        q = quantize(params, name, model=model, calibration=cal, seed=0)
        d = fp_dir.parent / name
        info = save_compressed_tensors(d, model, q, dtype="float32")
        out[name] = (model, q, d, info)
    return out


def _same_leaves(a, b) -> None:
    """The same tree of the same QArrays (fields bit for bit) and float arrays."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _dequantized(tree):
    return jax.tree.map(lambda x: np.asarray(dequantize_leaf(x, jnp.float32)), tree, is_leaf=_is_q)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(3, 20), (5, 64), (1, 7)])
def test_packing_is_the_librarys(bits: int, shape: tuple[int, int]) -> None:
    u = np.random.default_rng(bits).integers(0, 2**bits, shape).astype(np.uint8)
    signed = torch.tensor(u.astype(np.int32) - 2 ** (bits - 1), dtype=torch.int8)
    assert np.array_equal(pack_int32(u, bits), pack_to_int32(signed, bits).numpy())
    assert np.array_equal(pack_int32(u.T, bits).T, pack_to_int32(signed, bits, packed_dim=0).numpy())
    assert np.array_equal(unpack_int32(pack_int32(u, bits), bits, shape[1]), u)


@pytest.mark.parametrize("name", ["w4g128-rtn", "w4g128-rtn-sym", "w8-zeropoint", "w8a8-smoothquant"])
def test_round_trip_keeps_every_weight(quantized, name: str) -> None:
    model, q, d, info = quantized[name]
    model2, q2 = load_compressed_tensors(d)
    assert model2.config == model.config
    for a, b in zip(jax.tree.leaves(_dequantized(q)), jax.tree.leaves(_dequantized(q2))):
        np.testing.assert_array_equal(a, b)
    kinds = {type(x).__name__ for x in jax.tree.leaves(q2, is_leaf=_is_q) if _is_q(x)}
    assert kinds == {"ActQuantKernel" if "a8" in name else "QArray"}
    if name.startswith("w4"):  # 160 inputs in groups of 128 + 32, written as groups of 32 (the same values)
        assert info["schemes"]["model.layers.0.self_attn.q_proj"]["weights"]["group_size"] == 32
        assert "model.layers.0.self_attn.q_proj" in info["regrouped"]


@pytest.mark.parametrize("name", ["w4g128-rtn", "w4g128-rtn-sym"])
def test_codes_read_a_piece_of_rows_at_a_time_are_the_whole_reading(quantized, name: str, monkeypatch) -> None:
    """4-bit codes are unpacked and packed again a few output rows at a time (an LM head's are never unpacked
    whole): the same QArrays, bit for bit, as with every weight in one piece."""
    import eqjax.io.compressed_tensors as ct

    _, _, d, _ = quantized[name]
    _, whole = load_compressed_tensors(d)
    monkeypatch.setattr(ct, "_PIECE", 3 * 160)  # three rows of 160 inputs a piece: fused parts cut mid-way
    _, cut = load_compressed_tensors(d)
    _same_leaves(cut, whole)


@pytest.mark.parametrize("name", ["w4g128-rtn", "w4g128-rtn-sym", "w8-zeropoint", "w8a8-smoothquant"])
def test_streamed_reading_gives_the_whole_reading(quantized, name: str) -> None:
    from eqjax.core.pytree import nest_paths

    _, _, d, _ = quantized[name]
    model, whole = load_compressed_tensors(d)
    model2, streamed = stream_compressed_tensors(d)
    assert model2.config == model.config
    _same_leaves(nest_paths(streamed.load(streamed.paths)), whole)
    part = streamed.load([p for p in streamed.paths if p.startswith("layers_1/")])
    _same_leaves(nest_paths(part), {"layers_1": whole["layers_1"]})


@pytest.mark.parametrize("name", ["w4g128-rtn", "w4g128-rtn-sym", "w8-zeropoint", "w8a8-smoothquant"])
def test_the_library_decompresses_eqjax_weights(quantized, name: str) -> None:
    model, q, d, _ = quantized[name]
    cfg = json.loads((d / "config.json").read_text())["quantization_config"]
    stem = "model.layers.1.mlp.down_proj"
    (group,) = [g for g in cfg["config_groups"].values() if g["targets"] in (["Linear"], [stem]) or stem in g["targets"]]
    scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"})
    compressor = BaseCompressor.load_from_registry(CompressionFormat(group["format"]).value)
    from safetensors.torch import load_file

    tensors = load_file(d / "model.safetensors")
    state = {k[len(stem) + 1:]: v for k, v in tensors.items() if k.startswith(stem + ".")}
    out = compressor.decompress(state, scheme)
    want = _dequantized(q)["layers_1"]["mlp"]["down_proj"]["kernel"].T
    np.testing.assert_array_equal(out["weight"].float().numpy(), want)


def _torch_logits(d: pathlib.Path) -> np.ndarray:
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor(IDS, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("name", ["w4g128-rtn-sym", "w8-zeropoint", "w8a8-smoothquant"])
def test_transformers_computes_eqjax_logits(quantized, name: str) -> None:
    model, q, d, _ = quantized[name]
    ref = np.asarray(model.apply(q, jnp.asarray(IDS))[0])
    got = _torch_logits(d)
    scale = float(np.abs(ref).max())
    if "a8" in name:  # activations re-quantized per token by the loader: within a few int8 steps of the range
        assert np.abs(got - ref).max() <= 4 / 127 * scale
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    else:  # the same float32 weights: op order only
        assert np.abs(got - ref).max() <= 256 * EPS32 * scale


def _peer_checkpoint(fp_dir: pathlib.Path, out: pathlib.Path, weights: dict, acts: dict | None) -> pathlib.Path:
    """A checkpoint the compressed-tensors package makes itself (min/max scales, its compressor, its config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    m = transformers.AutoModelForCausalLM.from_pretrained(fp_dir, dtype=torch.float32).eval()
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=None if acts is None else QuantizationArgs(**acts))
    apply_quantization_config(m, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                    quantization_status="initialized"))
    for mod in m.modules():
        if hasattr(mod, "weight_scale"):
            w = mod.weight.data
            g = weights.get("group_size")
            lo, hi = (w.reshape(w.shape[0], -1, g).amin(-1), w.reshape(w.shape[0], -1, g).amax(-1)) if g else (
                w.amin(-1, keepdim=True), w.amax(-1, keepdim=True))
            s, z = calculate_qparams(lo, hi, mod.quantization_scheme.weights)
            mod.weight_scale.data = s.to(mod.weight_scale.dtype)
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.data = z.to(mod.weight_zero_point.dtype)
            mod.quantization_status = QuantizationStatus.CALIBRATION
    compressor = ModelCompressor.from_pretrained_model(m)
    compressor.compress_model(m)
    m.save_pretrained(out)
    compressor.update_config(out)
    return out


@pytest.mark.parametrize("weights, acts", [
    ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}, None),
    ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
     {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
], ids=["w4a16-g32", "w8a8"])
def test_a_peer_checkpoint_loads_as_qarrays(fp_dir, tmp_path, weights, acts) -> None:
    d = _peer_checkpoint(fp_dir, tmp_path / "peer", weights, acts)
    model, q = load_compressed_tensors(d)
    leaf = q["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert isinstance(leaf, ActQuantKernel if acts else QArray)
    ref = _torch_logits(d)
    got = np.asarray(model.apply(q, jnp.asarray(IDS))[0])
    scale = float(np.abs(ref).max())
    tol = 4 / 127 * scale if acts else 256 * EPS32 * scale
    assert np.abs(got - ref).max() <= tol


def test_a_peer_w8a8_linear_quantizes_its_activations_as_the_package_does(fp_dir, tmp_path) -> None:
    """A W8A8 linear of a package-made checkpoint, read by eqjax, against the package's own forward in
    transformers on the same rows (a zero row, a row whose largest magnitude is negative, rows of every
    size): the same activation codes, so the outputs differ by summation order only,
    ``|d| <= (K + 4) u s ws sum |q||w|``. eqjax's own grid (``absmax / 127``) on the same weights does not."""
    from eqjax.core.linear import act_quant_matmul

    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    d = _peer_checkpoint(fp_dir, tmp_path / "peer", {"num_bits": 8, "type": "int", "symmetric": True,
                                                     "strategy": "channel"}, acts)
    _, q = load_compressed_tensors(d)
    leaf = q["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert isinstance(leaf, ActQuantKernel) and leaf.act_full_range
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    K = leaf.shape[0]
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((12, K)) * np.exp(rng.uniform(-6, 6, (12, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, 7] = -4 * np.abs(x[1]).max()
    with torch.no_grad():
        m(torch.tensor(IDS, dtype=torch.long))  # the package decompresses the weights on the first forward
        ref = m.model.layers[0].mlp.up_proj(torch.from_numpy(x)[None])[0].numpy().astype(np.float64)
    got = np.asarray(act_quant_matmul(jnp.asarray(x), leaf), np.float64)
    s = np.where(np.abs(x).max(1) > 0, np.abs(x).max(1) / 127.5, 1.0)[:, None]
    w = np.abs(np.asarray(dequantize_leaf(leaf.weight), np.float64))
    bound = (K + 4) * EPS32 * (np.abs(x) / s + 1) @ w * s
    assert np.all(np.abs(got - ref) <= bound)
    own = np.asarray(act_quant_matmul(jnp.asarray(x), ActQuantKernel(leaf.weight)), np.float64)
    assert np.any(np.abs(own - ref) > bound)


@pytest.mark.parametrize("name, why", [
    ("fp", "quantizes no weight"), ("kv8", "KV cache"), ("w3g128-rtn", "3-bit"),
    ("w4a8-zeroquant-lkd", "4-bit weights with int8 activations"), ("w4g128-rtn+emb-int8", "embedding"),
])
def test_recipes_the_format_cannot_hold_are_refused(name: str, why: str) -> None:
    with pytest.raises(FormatError, match=rf"recipe '{re.escape(name)}' cannot be written as compressed-tensors: .*{why}"):
        check_recipe(get_recipe(name))


def test_activation_ordered_groups_read_as_the_stored_weights(quantized, tmp_path) -> None:
    """A group index (``actorder: group``, older llm-compressor releases) is read as the weight it defines,
    ``scale[:, g_idx[k]] * q[:, k]`` on the package's own unpacking; such a weight is not written back."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.numpy import load_file, save_file

    from eqjax.core.qarray import PermutedKernel

    model, _, d, _ = quantized["w4g128-rtn-sym"]
    bad = tmp_path / "perm"
    bad.mkdir()
    tensors = load_file(d / "model.safetensors")
    stem = "model.layers.0.mlp.up_proj"
    size = tensors[f"{stem}.weight_shape"][1] // tensors[f"{stem}.weight_scale"].shape[1]
    g_idx = (np.random.default_rng(0).permutation(160) // size).astype(np.int32)
    tensors[f"{stem}.weight_g_idx"] = g_idx
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text((d / "config.json").read_text())
    _, q = load_compressed_tensors(bad)
    leaf = q["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert isinstance(leaf, PermutedKernel)
    codes = unpack_from_int32(torch.tensor(tensors[f"{stem}.weight_packed"]), 4,
                              torch.Size(tensors[f"{stem}.weight_shape"].tolist())).numpy().astype(np.float64)
    want = tensors[f"{stem}.weight_scale"].astype(np.float64)[:, g_idx] * codes  # [out, in]
    np.testing.assert_array_equal(np.asarray(dequantize_leaf(leaf), np.float64), want.T)
    with pytest.raises(FormatError, match=r"up_proj\.weight \(compressed-tensors\): activation-ordered groups .* as gptq"):
        save_compressed_tensors(tmp_path / "again", model, q)
    assert not (tmp_path / "again").exists()


def test_a_malformed_group_index_or_scale_is_refused(quantized, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    _, _, d, _ = quantized["w4g128-rtn-sym"]
    bad = tmp_path / "perm"
    bad.mkdir()
    tensors = load_file(d / "model.safetensors")
    g = np.arange(160) // 32
    g[-1] = 0  # group 0 holds one input too many
    tensors["model.layers.0.mlp.up_proj.weight_g_idx"] = np.random.default_rng(0).permutation(g).astype(np.int32)
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text((d / "config.json").read_text())
    for read in (load_compressed_tensors, stream_compressed_tensors):  # streamed: refused before any part is read
        with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.up_proj\.weight_g_idx: groups of other sizes"):
            read(bad)
            read(bad)
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, bad / "model.safetensors")
    for read in (load_compressed_tensors, stream_compressed_tensors):
        with pytest.raises(FormatError, match=r"tensor model\.layers\.0\.mlp\.up_proj\.weight_scale is missing"):
            read(bad)


def test_cli_quantize_to_compressed_tensors_then_eval(fp_dir, tmp_path, capsys, monkeypatch) -> None:
    from tests.robustness.robustness_fixtures import TEXT, _byte_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    for f in fp_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    _byte_tokenizer(src / "tokenizer.json")
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "ct"
    common = ["--text", str(text), "--eval-len", "32", "--eval-tokens", "64"]
    assert main(["quantize", "--model", str(src), "--recipe", "w4g128-rtn", "--out", str(out),
                 "--format", "compressed-tensors", "--dtype", "float32"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    capsys.readouterr()
    rows = []
    for argv in (["eval", "--checkpoint", str(out)], ["eval", "--model", str(src), "--checkpoint", str(out)],
                 ["eval", "--model", str(src), "--recipe", "w4g128-rtn"]):
        json_out = tmp_path / f"r{len(rows)}.json"
        assert main([*argv, *common, "--json", str(json_out)]) == 0
        rows.append(json.loads(json_out.read_text())["ppl"])
    assert rows[0] == rows[1]
    assert abs(rows[0] / rows[2] - 1) <= 1e-5  # the same weights; float32 accumulation order
    # block at a time, the checkpoint read one block at a time: the same model, size and bits
    assert main(["eval", "--checkpoint", str(out), "--by-block", *common, "--json", str(tmp_path / "b.json")]) == 0
    whole, by_block = (json.loads((tmp_path / f).read_text()) for f in ("r0.json", "b.json"))
    assert abs(by_block["ppl"] / whole["ppl"] - 1) <= 1e-5
    for k in ("size_bytes", "w_bits", "a_bits", "eval_tokens"):
        assert by_block[k] == whole[k], k
    # a model whose float32 weights exceed the available memory is evaluated block at a time, and says so
    n_float = 4 * sum(int(np.prod(s)) for s in jax.tree.leaves(
        stream_model(out)[0].param_shapes(), is_leaf=lambda x: isinstance(x, tuple)))
    for avail, auto in ((n_float - 1, True), (n_float + 1, False)):
        capsys.readouterr()
        monkeypatch.setattr(sources, "_available_bytes", lambda a=avail: a)
        assert main(["eval", "--checkpoint", str(out), *common, "--json", str(tmp_path / f"a{auto}.json")]) == 0
        assert ("one decoder block at a time" in capsys.readouterr().err) == auto
        assert json.loads((tmp_path / f"a{auto}.json").read_text())["ppl"] == (by_block if auto else whole)["ppl"]
    assert main(["quantize", "--model", str(src), "--recipe", "kv8", "--out", str(tmp_path / "x"),
                 "--format", "compressed-tensors"]) == 2
    assert "cannot be written as compressed-tensors" in capsys.readouterr().err
