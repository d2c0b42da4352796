"""The edge package in onnxruntime-genai: greedy tokens equal eqjax's, atomic writes, refused recipes.

A tiny Llama (GQA, vocabulary of the 256 byte-level BPE characters, no merges) with random weights; the
oracle is eqjax's own greedy decoding (``Model.generate``) of the same params.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from eqjax.cli.export import recipe_for_export
from eqjax.core.errors import OutputError
from eqjax.export.graph import ExportError
from eqjax.export.package import export_package
from eqjax.io.tokenizer import Tokenizer, bytes_to_unicode
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.registry import weight_rule

EOS = 255


@pytest.fixture(scope="module")
def tiny():
    model = Model(LlamaConfig(vocab=256, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2))
    tok = Tokenizer(list(bytes_to_unicode().values()), [], bos_id=0, eos_id=EOS)
    return model, model.init_params(jax.random.key(3), std=0.1), tok


def _w4(model, params):
    from eqjax.methods.rtn import RTN
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.types import Recipe

    return quantize(params, Recipe("w4g32", (RTN((weight_rule(4, symmetric=False, group=32),)),)), model=model)


def _w7a8(model, params):
    from eqjax.methods.rtn import RTN
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.registry import embedding_step
    from eqjax.recipes.types import Recipe

    steps = (RTN((weight_rule(7, act_bits=8),)), embedding_step("w7a8"))
    return quantize(params, Recipe("w7a8+emb-w7a8", steps), model=model)


def _genai_greedy(d, prompt, new):
    import onnxruntime_genai as og

    model = og.Model(str(d))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens([int(i) for i in prompt])
    while not gen.is_done():
        gen.generate_next_token()
    return np.asarray(gen.get_sequence(0))


def _w4_rot(model, params):
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.registry import get_recipe

    cal = jax.random.randint(jax.random.key(0), (2, 16), 0, model.config.vocab)
    return quantize(params, get_recipe("w4g128-rot-rtn"), model=model, calibration=cal)


@pytest.mark.parametrize("quant", ["fp32", "w4g32", "w7a8", "w4-rot"])
def test_genai_generator_greedy_tokens_equal_eqjax(tiny, tmp_path, quant):
    """W4: Q/K/V packed into one MatMulNBits; W7A8 (a tied model, its head W8A8 too): one u8 x s8
    MatMulIntegerToFloat per sibling group and for the head; both feed GQA directly (rotary inside).
    W4 with rotation (QuaRot): down_proj's input rotated online, intermediate 96 = 12 x 8 (a Paley
    factor as SmolLM2's 1536 = 12 x 128)."""
    model, params, tok = tiny
    if quant in ("w7a8", "w4-rot"):
        model = Model(dataclasses.replace(model.config, tie_word_embeddings=True,
                                          intermediate=96 if quant == "w4-rot" else model.config.intermediate))
        params = model.init_params(jax.random.key(3), std=0.1)
    qp = {"fp32": lambda m, p: p, "w4g32": _w4, "w7a8": _w7a8, "w4-rot": _w4_rot}[quant](model, params)
    d = tmp_path / "pkg"
    man = export_package(model, qp, d, tokenizer=tok, target="cpu", context_length=64)
    assert man["fused"].get("GroupQueryAttention") == 2 and man["check"]["max_rel_diff"] <= man["check"]["tolerance"]
    # W4: Q/K/V packed into one MatMulNBits feed GQA directly (rotary inside), as genai's builder does
    import onnx

    proto = onnx.load(str(d / "model.onnx"))
    ops = [n.op_type for n in proto.graph.node]
    assert man["packed_attention"] == (0 if quant == "fp32" else 2)
    assert ops.count("RotaryEmbedding") == (4 if quant == "fp32" else 0)
    if quant == "w4-rot":  # per layer: down_proj's input times the 8 x 8 Sylvester and the 12 x 12 Paley factor
        from eqjax.core.qarray import RotatedKernel

        assert all(isinstance(qp[f"layers_{i}"]["mlp"]["down_proj"]["kernel"], RotatedKernel) for i in range(2))
        rot = [n for n in proto.graph.node if n.op_type == "MatMul" and any(i.startswith("rotation.") for i in n.input)]
        assert len(rot) == 4 and ops.count("MatMulNBits") >= 6
    if quant == "w7a8":  # 2 layers x (QKV, gate/up, o, down) + the head, every weight int8 within +-64
        mm = [n for n in proto.graph.node if n.op_type == "MatMulIntegerToFloat"]
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
        producers = {o: n for n in proto.graph.node for o in n.output}
        # the head reads the table's own initializer through a Transpose (one copy in the file)
        bs = [inits[producers[n.input[1]].input[0] if n.input[1] in producers else n.input[1]] for n in mm]
        assert len(mm) == 9 and all(b.dtype == np.int8 and np.abs(b).max() <= 64 for b in bs)
        (table,) = [b for b in bs if b.shape == (256, 64)]
        gathers = [n for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in inits
                   and inits[n.input[0]].dtype == np.int8]
        assert len(gathers) == 1 and inits[gathers[0].input[0]] is not None
        assert sum(b.size for b in inits.values() if b.dtype == np.int8 and b.shape == (256, 64)) == table.size
    cfg = json.loads((d / "genai_config.json").read_text())
    assert cfg["model"]["eos_token_id"] == EOS and cfg["model"]["decoder"]["num_key_value_heads"] == 2
    prompt = np.array([0, 72, 101, 108, 108, 111, 32, 119], np.int32)
    new = 24
    ref = np.asarray(model.generate(qp, prompt[None], new)[0])
    got = _genai_greedy(d, prompt, new)
    # genai stops at EOS (included); eqjax's greedy loop does not
    assert len(got) == len(ref) or got[-1] == EOS, (got, ref)
    np.testing.assert_array_equal(got, ref[:len(got)])
    assert len(got) > len(prompt) + 4  # the comparison covers real decode steps


def test_existing_package_kept_without_overwrite(tiny, tmp_path):
    model, params, tok = tiny
    d = tmp_path / "pkg"
    d.mkdir()
    (d / "model.onnx").write_bytes(b"previous")
    with pytest.raises(OutputError, match="not empty"):
        export_package(model, params, d, tokenizer=tok, check=False)
    assert (d / "model.onnx").read_bytes() == b"previous"
    export_package(model, params, d, tokenizer=tok, check=False, overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == ["eqjax_export.json", "genai_config.json", "model.onnx",
                                                   "model.onnx.data", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("name, match", [("kv4", r"'kv4' quantizes the KV cache"), ("w3g128-rtn", r"3-bit"),
                                         ("w4a8-rot-gptq", r"activations with asymmetric weights")])
def test_unrepresentable_recipes_are_refused_before_work(name, match):
    with pytest.raises(ExportError, match=match):
        recipe_for_export(name)


def test_context_length_above_the_models_is_refused_before_work(tiny, tmp_path):
    """``context_length`` beyond ``max_position_embeddings`` would be written into genai_config: refused
    (API: before tracing; CLI: from the GGUF header, before loading the weights), nothing written."""
    from eqjax.cli.export import check_context_length
    from eqjax.core.errors import CompatibilityError

    model, params, tok = tiny
    mx = model.config.max_position_embeddings
    with pytest.raises(ExportError, match=rf"context length above the model's.*expected <= {mx}, found {mx + 1}"):
        export_package(model, params, tmp_path / "pkg", tokenizer=tok, context_length=mx + 1, check=False)
    assert not (tmp_path / "pkg").exists()
    from tests.robustness.robustness_fixtures import write_gguf

    g = write_gguf(tmp_path / "t.gguf")  # context_length 64 in its header
    check_context_length(str(g), 64)
    with pytest.raises(CompatibilityError, match=r"--context-length vs .*t\.gguf.*expected <= 64, found 100000"):
        check_context_length(str(g), 100000)


def test_embedding_flag_and_suffix_together_are_refused():
    with pytest.raises(ExportError, match=r"--embedding int8 vs --recipe w8\+emb-int4"):
        recipe_for_export("w8+emb-int4", "int8")
    assert [s.name for s in recipe_for_export("w8+f16", "int8").steps] == ["rtn", "embedding-int8", "half-floats"]


def test_a_rotated_recipe_is_checked_inside_its_rotation():
    """A rotation's ``then`` steps are checked like top-level ones (3-bit refused before any work), and
    a rotation the lowering does not cover is refused naming the weight."""
    import jax.numpy as jnp

    from eqjax.core.qarray import RotatedKernel
    from eqjax.export.package import check_recipe
    from eqjax.export.qlower import check_exportable
    from eqjax.methods.rotation import Rotation
    from eqjax.methods.rtn import RTN
    from eqjax.recipes.registry import get_recipe
    from eqjax.recipes.types import Recipe

    with pytest.raises(ExportError, match="3-bit"):
        check_recipe(Recipe("rot-w3", (Rotation(then=(RTN((weight_rule(3, symmetric=False, group=128),)),)),)))
    for name in ("w8a8-rot", "w4g128-rot-gptq", "w7a8-smoothquant", "w4a8-zeroquant-lkd", "w8a8-naive"):
        check_recipe(get_recipe(name))  # symmetric W8A8, or weight-only: exportable
    with pytest.raises(ExportError, match=r"blk/w: an online rotation .* axis 1"):
        check_exportable("blk/w", RotatedKernel(jnp.ones((8, 8)), seed=0, axis=1))


def test_self_check_with_int8_activations_catches_a_wrong_graph(tiny, tmp_path):
    """W8A8: the package's self-check passes for the exported params (within eqjax's own one-ulp spread)
    and fails for a graph whose weights differ from the params eqjax runs."""
    import jax.numpy as jnp

    from eqjax.export.onnx import build_model
    from eqjax.export.runtime import check_against_eqjax
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.registry import get_recipe

    model, params, _ = tiny
    toks = np.asarray(jax.random.randint(jax.random.key(3), (4, 16), 0, model.config.vocab), np.int32)
    qp = quantize(params, get_recipe("w8a8-naive"), model=model, calibration=toks)
    path = tmp_path / "m.onnx"
    import onnx

    onnx.save_model(build_model(model, qp), str(path))
    ok = check_against_eqjax(model, qp, path, accuracy_level=4)
    assert ok["max_rel_diff"] <= ok["tolerance"] and ok["eqjax_one_ulp_spread"] is not None
    wrong = jax.tree.map(lambda x: x * 1.5 if jnp.issubdtype(x.dtype, jnp.floating) else x, qp)
    with pytest.raises(ExportError, match="differ from eqjax's"):
        check_against_eqjax(model, wrong, path, accuracy_level=4)


def test_params_handed_over_are_released_before_onnxruntime_loads(tiny, tmp_path, monkeypatch):
    """Given a loader, the writer holds the only reference to the params and drops it before the onnxruntime
    check: the weights are never in memory twice (what a model near the memory's size needs)."""
    import weakref

    import eqjax.export.package as package

    model, params, tok = tiny
    held = [jax.tree.map(lambda x: x.copy(), _w4(model, params))]  # shares no float leaf with the fixture's
    leaves = [weakref.ref(x) for x in jax.tree.leaves(held[0]) if isinstance(x, jax.Array)]
    assert leaves
    alive_at_check = []
    compare = package.compare_with_eqjax

    def spy(pkg, reference):
        import gc

        gc.collect()
        alive_at_check.append(sum(r() is not None for r in leaves))
        return compare(pkg, reference)

    monkeypatch.setattr(package, "compare_with_eqjax", spy)
    man = export_package(model, held.pop, tmp_path / "pkg", tokenizer=tok)
    assert alive_at_check == [0] and man["check"]["max_rel_diff"] <= man["check"]["tolerance"]
