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


def _autoround(fp_dir: pathlib.Path, out: pathlib.Path, *, sym: bool, group: int) -> pathlib.Path:
    """AutoRound's round to nearest (no tuning), exported in its ``auto_gptq`` format."""
    from auto_round import AutoRound

    ar = AutoRound(str(fp_dir), bits=4, group_size=group, sym=sym, iters=0, disable_opt_rtn=True, nsamples=1,
                   seqlen=16)
    ar.quantize_and_save(output_dir=str(out), format="auto_gptq")
    (d,) = {p.parent for p in out.rglob("config.json")}
    return d


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
        w = np.asarray(fp[path[0]][path[1]][path[2]]["kernel"], np.float64)
        got = np.asarray(dequantize_leaf(qa, jnp.float32), np.float64)
        step = np.repeat(np.asarray(qa.scale, np.float64), 64, axis=0)[: w.shape[0]]
        zp = np.repeat(np.asarray(qa.effective_zero_point, np.float64), 64, axis=0)[: w.shape[0]]
        grid = (np.arange(16)[:, None, None] - zp) * step  # the 16 values each weight's group can hold
        nearest = np.abs(grid - w).min(axis=0)
        # round to nearest on the stored grid, clamped to its ends: a wrong zero offset, packing order or
        # transposition decodes other grid points. Near a midpoint either neighbour is right: the peer rounds
        # the weights in bfloat16 (relative error EPS_BF16) against float16 scales
        assert np.all(np.abs(got - w) <= nearest + 2 * EPS_BF16 * np.abs(w) + 16 * EPS16 * step), path
    cfg = json.loads((d / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "gptq" and cfg["sym"] == sym


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


def test_activation_ordered_groups_are_refused(written, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    d = written["w4g128-rtn"][2]
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.g_idx"] = np.random.default_rng(0).permutation(160).astype(np.int32) // 128
    bad = tmp_path / "perm"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text((d / "config.json").read_text())
    for read in (load_gptq, stream_gptq):  # streamed: refused before any part is read
        with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.up_proj\.g_idx: activation-ordered groups"):
            read(bad)
    del tensors["model.layers.0.mlp.up_proj.g_idx"]
    tensors["model.layers.1.self_attn.o_proj.scales"] = tensors["model.layers.1.self_attn.o_proj.scales"][:, :-1].copy()
    save_file(tensors, bad / "model.safetensors")
    for read in (load_gptq, stream_gptq):
        with pytest.raises(FormatError, match=r"model\.layers\.1\.self_attn\.o_proj\.scales: expected shape"):
            read(bad)


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
