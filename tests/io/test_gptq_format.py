"""GPTQ-format checkpoints: AutoRound's ``auto_gptq`` export (the peer) reads into eqjax's QArrays as round to
nearest on its own grid (every weight within half a step of the float weight: a wrong packing order, zero
offset or transposition breaks that bound), eqjax's own GPTQ directories read back to the same integers and
follow the layout's conventions as AutoRound writes them."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("auto_round")

from eqjax.core.numerics import dequantize_leaf  # noqa: E402
from eqjax.core.pytree import flatten_with_paths  # noqa: E402
from eqjax.core.qarray import QArray  # noqa: E402
from eqjax.io.gptq import FormatError, check_recipe, load_gptq, save_gptq, stream_gptq  # noqa: E402
from eqjax.io.hf import load_hf_checkpoint  # noqa: E402
from eqjax.io.load import load_model  # noqa: E402
from eqjax.recipes.apply import quantize  # noqa: E402
from eqjax.recipes.registry import get_recipe  # noqa: E402

pytestmark = pytest.mark.reference
EPS16 = float(np.finfo(np.float16).eps)
EPS_BF16 = 2.0**-7


@pytest.fixture(scope="module")
def fp_dir(tmp_path_factory) -> pathlib.Path:
    """A random Llama (transformers' code) with a byte-level tokenizer; hidden 160: groups of 64 leave 32."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=160, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=64)
    d = tmp_path_factory.mktemp("gptq") / "fp"
    transformers.LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="b", eos_token="e", pad_token="p")
    fast.save_pretrained(d)
    return d


def _autoround(fp_dir: pathlib.Path, out: pathlib.Path, *, sym: bool, group: int, fmt: str = "auto_gptq",
               layer_config: dict | None = None) -> pathlib.Path:
    """AutoRound's round to nearest (no tuning), exported in its ``fmt`` format (``auto_gptq`` or its own
    ``auto_round``)."""
    from auto_round import AutoRound

    ar = AutoRound(str(fp_dir), bits=4, group_size=group, sym=sym, iters=0, disable_opt_rtn=True, nsamples=1,
                   seqlen=16, layer_config=layer_config)
    ar.quantize_and_save(output_dir=str(out), format=fmt)
    (d,) = {p.parent for p in out.rglob("config.json")}
    return d


def _assert_round_to_nearest(qa: QArray, w: np.ndarray, group: int, where: object) -> None:
    """``qa`` decodes every weight of ``w`` ``[in, out]`` to the nearest of the values its group's grid holds,
    clamped to the grid's ends: a wrong zero offset, packing order or transposition decodes other grid points.
    Near a midpoint either neighbour is right: the peer rounds the weights in bfloat16 (relative error
    EPS_BF16) against float16 scales."""
    got = np.asarray(dequantize_leaf(qa, jnp.float32), np.float64)
    step = np.repeat(np.asarray(qa.scale, np.float64), group, axis=0)[: w.shape[0]]
    zp = np.repeat(np.asarray(qa.effective_zero_point, np.float64), group, axis=0)[: w.shape[0]]
    grid = (np.arange(2**qa.bits)[:, None, None] - zp) * step  # the values each weight's group can hold
    nearest = np.abs(grid - w).min(axis=0)
    assert np.all(np.abs(got - w) <= nearest + 2 * EPS_BF16 * np.abs(w) + 16 * EPS16 * step), where


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_an_autoround_gptq_checkpoint_reads_as_its_rounding(fp_dir, tmp_path, sym: bool) -> None:
    d = _autoround(fp_dir, tmp_path / "ar", sym=sym, group=64)
    _, fp = load_hf_checkpoint(fp_dir)
    model, q = load_model(d)[:2]
    leaf = q["layers_1"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(leaf, QArray) and leaf.bits == 4
    for path in (("layers_0", "attn", "q_proj"), ("layers_0", "attn", "o_proj"), ("layers_1", "mlp", "down_proj"),
                 ("layers_1", "mlp", "gate_proj")):
        qa = q[path[0]][path[1]][path[2]]["kernel"]
        _assert_round_to_nearest(qa, np.asarray(fp[path[0]][path[1]][path[2]]["kernel"], np.float64), 64, path)
    cfg = json.loads((d / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "gptq" and cfg["sym"] == sym


def _qarrays(tree) -> dict[str, QArray]:
    paths, leaves, _ = flatten_with_paths(tree)
    return {p: x for p, x in zip(paths, leaves) if isinstance(x, QArray)}


@pytest.mark.parametrize("sym, packing", [(True, "auto_round:auto_gptq"), (False, "auto_round")], ids=["sym", "asym"])
def test_autoround_own_format_reads_as_its_gptq_export(fp_dir, tmp_path, sym: bool, packing: str) -> None:
    """AutoRound's own ``auto_round`` format (symmetric: packed as GPTQ v1, zero points minus 1; asymmetric: zero
    points as they are; inputs padded to whole groups by its model-free export) reads as round to nearest on its
    stored grid, a layer given 8 bits by ``extra_config`` included, and as the QArrays of its ``auto_gptq``
    export of the same recipe (a GPTQModel ``dynamic`` override there): the same kinds and shapes, weights
    within half of each one's step of each other (the two exports round some weights the other way, and the
    padded last group of a ragged weight has its own range)."""
    layers = {"model.layers.1.mlp.down_proj": {"bits": 8}}
    own = _autoround(fp_dir, tmp_path / "own", sym=sym, group=64, fmt="auto_round", layer_config=layers)
    ref = _autoround(fp_dir, tmp_path / "ref", sym=sym, group=64, layer_config=layers)
    qc = json.loads((own / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "auto-round" and qc["packing_format"] == packing
    assert qc["extra_config"]["model.layers.1.mlp.down_proj"]["bits"] == 8
    a, b = _qarrays(load_model(own)[1]), _qarrays(load_model(ref)[1])
    fp = dict(zip(*flatten_with_paths(load_hf_checkpoint(fp_dir)[1])[:2]))
    assert a.keys() == b.keys() and len(a) == 14
    assert a["layers_1/mlp/down_proj/kernel"].bits == 8 and b["layers_1/mlp/down_proj/kernel"].bits == 8
    assert a["layers_0/mlp/down_proj/kernel"].bits == 4
    for p, x in a.items():
        y = b[p]
        assert (x.bits, x.granularity, x.shape) == (y.bits, y.granularity, y.shape), p
        w = np.asarray(fp[p], np.float64)
        _assert_round_to_nearest(x, w, 64, p)
        sx, sy = (np.repeat(np.asarray(z.scale, np.float64), 64, axis=0)[: w.shape[0]] for z in (x, y))
        gap = np.abs(np.asarray(dequantize_leaf(x), np.float64) - np.asarray(dequantize_leaf(y), np.float64))
        # each within half its own step of w (no clamping: both grids span the group's weights)
        assert np.all(gap <= (sx + sy) / 2 * (1 + 16 * EPS16) + 4 * EPS_BF16 * np.abs(w)), p


@pytest.fixture(scope="module")
def own_asym(fp_dir, tmp_path_factory) -> pathlib.Path:
    """AutoRound's own-format export of its asymmetric round to nearest (groups of 64)."""
    return _autoround(fp_dir, tmp_path_factory.mktemp("own") / "own", sym=False, group=64, fmt="auto_round")


@pytest.mark.parametrize("edit, match", [
    ({"packing_format": "auto_round:auto_awq"}, r"packing_format 'auto_round:auto_awq'"),
    ({"data_type": "fp"}, r"data_type 'fp'"),
    ({"act_bits": 8}, r"act_bits 8"),
    ({"extra_config": ["model.layers.0.mlp.up_proj"]}, r"extra_config / dynamic must map"),
    ({"extra_config": {"model.layers.0.mlp.up_proj": {"bits": 2}}}, r"extra_config gives model\.layers\.0\.mlp\.up_proj bits 2"),
])
def test_autoround_own_format_beyond_the_layout_is_refused(own_asym, tmp_path, edit: dict, match: str) -> None:
    import shutil

    d = tmp_path / "own"
    shutil.copytree(own_asym, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    for read in (load_gptq, stream_gptq):
        with pytest.raises(FormatError, match=rf"config\.json: quantization_config: .*{match}"):
            read(d)


@pytest.fixture(scope="module")
def written(fp_dir):
    model, params = load_hf_checkpoint(fp_dir)
    out = {}
    for name in ("w4g128-rtn-sym", "w4g128-rtn"):
        q = quantize(params, get_recipe(name), model=model, seed=0)
        d = fp_dir.parent / name
        info = save_gptq(d, model, q, copy_from=fp_dir)
        out[name] = (model, q, d, info)
    return out


@pytest.mark.parametrize("name", ["w4g128-rtn-sym", "w4g128-rtn"])
def test_eqjax_gptq_directories_read_back_to_the_same_integers(written, name: str) -> None:
    model, q, d, info = written[name]
    assert info["group_size"] == 128 and info["sym"] == name.endswith("sym")
    model2, q2 = load_gptq(d)
    assert model2.config == model.config
    pick = lambda t: [x for x in jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, QArray)) if isinstance(x, QArray)]  # noqa: E731
    for a, b in zip(pick(q), pick(q2)):
        assert (a.bits, a.symmetric, a.granularity, a.shape) == (b.bits, b.symmetric, b.granularity, b.shape)
        np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))
        np.testing.assert_array_equal(np.asarray(a.scale, np.float16), np.asarray(b.scale))
    assert (d / "tokenizer.json").is_file()


def test_symmetric_zero_points_are_written_as_autoround_writes_them(fp_dir, written, tmp_path) -> None:
    from safetensors.numpy import load_file

    ours = load_file(written["w4g128-rtn-sym"][2] / "model.safetensors")
    peer_dir = _autoround(fp_dir, tmp_path / "ar", sym=True, group=128)
    peer = load_file(next(peer_dir.glob("*.safetensors")))
    for stem in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        for part in ("qzeros", "g_idx"):
            np.testing.assert_array_equal(ours[f"{stem}.{part}"], peer[f"{stem}.{part}"])
        for part in ("qweight", "scales"):
            assert ours[f"{stem}.{part}"].dtype == peer[f"{stem}.{part}"].dtype
            assert ours[f"{stem}.{part}"].shape == peer[f"{stem}.{part}"].shape


@pytest.mark.parametrize("name, why", [("w8a8-smoothquant", "activations"), ("w3g128-rtn", "3-bit"),
                                       ("kv8", "KV cache")])
def test_what_the_layout_cannot_hold_is_refused(name: str, why: str) -> None:
    with pytest.raises(FormatError, match=rf"cannot be written as gptq: .*{why}"):
        check_recipe(get_recipe(name))


def _act_ordered(written, tmp_path: pathlib.Path, g_idx_of=None) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
    """The ``w4g128-rtn`` directory made activation-ordered as a GPTQ ``desc_act`` checkpoint is: every linear's
    ``g_idx`` a random balanced group index (``permutation(in) // 128``) and its codes random words."""
    from safetensors.numpy import load_file, save_file

    d = written["w4g128-rtn"][2]
    tensors = load_file(d / "model.safetensors")
    rng = np.random.default_rng(7)
    for name in [n for n in tensors if n.endswith(".g_idx")]:
        n_in = tensors[name].shape[0]
        tensors[name] = (g_idx_of or (lambda n: rng.permutation(n) // 128))(n_in).astype(np.int32)
        qw = name[: -len("g_idx")] + "qweight"
        tensors[qw] = rng.integers(-(2**31), 2**31, tensors[qw].shape, dtype=np.int64).astype(np.int32)
    out = tmp_path / "desc_act"
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    for f in d.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (out / "config.json").write_text(json.dumps(config))
    return out, tensors


def _gptq_weight(tensors: dict[str, np.ndarray], stem: str) -> np.ndarray:
    """``[in, out]`` float64 weight of a v1 GPTQ 4-bit linear by the layout's definition, unpacked here bit by bit:
    ``scale[g_idx[k]] * (q[k] - (qzero[g_idx[k]] + 1))``."""
    qw, qz, s, g = (tensors[f"{stem}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx"))
    k = np.arange(g.shape[0])
    q = (qw.view(np.uint32)[k // 8] >> (4 * (k % 8))[:, None].astype(np.uint32)) & 15
    n = np.arange(s.shape[1])
    z = ((qz.view(np.uint32)[:, n // 8] >> (4 * (n % 8)).astype(np.uint32)) & 15) + 1
    return s.astype(np.float64)[g] * (q.astype(np.float64) - z.astype(np.float64)[g])


def test_activation_ordered_groups_read_as_the_stored_weights(written, tmp_path) -> None:
    from eqjax.core.qarray import PermutedKernel

    d, tensors = _act_ordered(written, tmp_path)
    model, q = load_gptq(d)
    kernel = q["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert isinstance(kernel, PermutedKernel) and isinstance(kernel.kernel, QArray)
    for leaf, stem in ((q["layers_0"]["mlp"]["up_proj"], "model.layers.0.mlp.up_proj"),
                       (q["layers_1"]["attn"]["o_proj"], "model.layers.1.self_attn.o_proj")):
        # exact: a float16 scale times a 4-bit code difference is a float32 number
        np.testing.assert_array_equal(np.asarray(dequantize_leaf(leaf["kernel"]), np.float64), _gptq_weight(tensors, stem))

    # the model gathers its inputs: the same logits as transformers' Llama on the stored weights
    ref = transformers.LlamaForCausalLM.from_pretrained(written["w4g128-rtn"][2].parent / "fp", torch_dtype=torch.float32)
    state = ref.state_dict()
    for name in [n for n in tensors if n in state]:  # the float params as stored (float16)
        state[name] = torch.tensor(tensors[name].astype(np.float32))
    for name in [n for n in tensors if n.endswith(".g_idx")]:
        stem = name[: -len(".g_idx")]
        state[f"{stem}.weight"] = torch.tensor(_gptq_weight(tensors, stem).T, dtype=torch.float32)
    ref.load_state_dict(state)
    ids = np.random.default_rng(1).integers(0, 256, (2, 12)).astype(np.int32)
    with torch.no_grad():
        want = ref(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    got = np.asarray(model.apply(q, jnp.asarray(ids))[0])
    # the same float32 products summed in other orders (dot products of up to 256 terms, two blocks, the head):
    # tens of float32 eps of the logits' magnitude; a wrong input order moves them by far more than that
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * float(np.finfo(np.float32).eps) * max(scale, 1.0))


def test_activation_ordered_groups_are_written_back_as_they_were_read(written, tmp_path) -> None:
    from safetensors.numpy import load_file

    d, tensors = _act_ordered(written, tmp_path)
    model, q = load_gptq(d)
    info = save_gptq(tmp_path / "again", model, q, copy_from=d)
    again = load_file(tmp_path / "again" / "model.safetensors")
    for name in [n for n in tensors if n.endswith((".qweight", ".qzeros", ".g_idx"))]:
        np.testing.assert_array_equal(again[name], tensors[name], err_msg=name)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]["desc_act"] is True
    assert info["bits"] == 4
    _, streamed = stream_gptq(d)  # streamed: the same permuted kernels, part by part
    from eqjax.core.pytree import nest_paths

    got = nest_paths(streamed.load(streamed.paths))
    assert jax.tree.structure(got) == jax.tree.structure(q)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(q)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_activation_ordered_checkpoint_exports_to_onnx_and_is_refused_by_gguf(written, tmp_path) -> None:
    """ONNX: the input gathered before each MatMulNBits, the package's logits checked against eqjax's by the
    export itself; GGUF's blocks run along the inputs as stored, so a permuted weight is refused, naming it."""
    from eqjax.cli.main import main

    d, _ = _act_ordered(written, tmp_path)
    pkg = tmp_path / "onnx"
    assert main(["export-onnx", "--checkpoint", str(d), "--out", str(pkg)]) == 0
    man = json.loads((pkg / "eqjax_export.json").read_text())
    assert man["check"]["max_rel_diff"] <= man["check"]["tolerance"] and man["check"]["top1_agreement"] > 0.9
    from eqjax.io.gguf import GGUFError
    from eqjax.io.gguf_write import export_gguf

    model, q = load_gptq(d)
    with pytest.raises(GGUFError, match=r"/kernel: activation-ordered groups \(a GPTQ desc_act g_idx"):
        export_gguf(q, tmp_path / "m.gguf", source=d, metadata=(model.config, []))
    assert not (tmp_path / "m.gguf").exists()


def test_a_group_index_with_groups_of_other_sizes_is_refused(written, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    def lopsided(n: int) -> np.ndarray:  # group 0 holds one input too many
        g = np.arange(n) // 128
        g[-1] = 0
        return np.random.default_rng(3).permutation(g)

    d, tensors = _act_ordered(written, tmp_path, lopsided)
    for read in (load_gptq, stream_gptq):  # streamed: refused before any part is read
        with pytest.raises(FormatError, match=r"model\.layers\.0\.\w+\.\w+_proj\.g_idx: groups of other sizes than "
                                              r"the group size 128"):
            read(d)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.scales"] = tensors["model.layers.1.self_attn.o_proj.scales"][:, :-1].copy()
    for name in [n for n in tensors if n.endswith(".g_idx")]:
        del tensors[name]
    save_file(tensors, d / "model.safetensors")
    for read in (load_gptq, stream_gptq):
        with pytest.raises(FormatError, match=r"model\.layers\.1\.self_attn\.o_proj\.scales: expected shape"):
            read(d)


@pytest.mark.parametrize("name", ["w4g128-rtn-sym", "w4g128-rtn"])
def test_streamed_reading_gives_the_whole_reading(written, name: str) -> None:
    from eqjax.core.pytree import nest_paths

    _, _, d, _ = written[name]
    _, whole = load_gptq(d)
    _, streamed = stream_gptq(d)
    got = nest_paths(streamed.load(streamed.paths))
    assert jax.tree.structure(got) == jax.tree.structure(whole)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(whole)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_cli_quantize_to_gptq_then_eval(fp_dir, tmp_path) -> None:
    from eqjax.cli.main import main
    from tests.robustness.robustness_fixtures import TEXT

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "g"
    assert main(["quantize", "--model", str(fp_dir), "--recipe", "w4g128-rtn", "--out", str(out), "--format", "gptq"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    common = ["--text", str(text), "--eval-len", "32", "--eval-tokens", "64"]
    ppl = []
    for argv in (["eval", "--checkpoint", str(out)], ["eval", "--model", str(fp_dir), "--recipe", "w4g128-rtn"]):
        assert main([*argv, *common, "--json", str(tmp_path / f"{len(ppl)}.json")]) == 0
        ppl.append(json.loads((tmp_path / f"{len(ppl)}.json").read_text())["ppl"])
    # the same codes; the layout's float16 scales move each weight by at most 2**-11 of itself
    assert abs(ppl[0] / ppl[1] - 1) < 1e-2
