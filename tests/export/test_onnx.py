"""ONNX export: every layer kind and whole tiny models vs eqjax in onnxruntime (CPU).

Tolerances: single layers agree to 1e-5 relative (W8A8 bit-exact integer path; MatMul summation order
is the only difference); whole tiny models to 2e-5 absolute on logits of magnitude ~3. Sessions use
``qdq_accuracy_level=0`` (float activations in ORT's DQ->MatMulNBits rewrite); a separate test shows
ORT's default level changes W8 results.
"""

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest

from eqjax.core.linear import ActQuantKernel, linear
from eqjax.core.numerics import QuantSpec, quantize
from eqjax.core.qarray import per_channel, per_group, per_tensor
from eqjax.export.onnx import ExportError, build_model, linear_graph, make_session, onnx_logits, onnx_perplexity
from eqjax.models import GPT2Config, LlamaConfig, Model
from eqjax.recipes.registry import weight_rule

RNG = np.random.default_rng(0)
K, N, M = 256, 96, 7
W = jnp.asarray(RNG.normal(size=(K, N)).astype(np.float32) * 0.05)
X = RNG.normal(size=(M, K)).astype(np.float32)
BIAS = jnp.asarray(RNG.normal(size=(N,)).astype(np.float32))


def _q(bits, sym, gran, sd="float32"):
    return quantize(W, QuantSpec(bits, sym, gran, scale_dtype=sd))


LAYERS = {
    "fp": lambda: W,
    "w8-per-channel": lambda: _q(8, True, per_channel(-1)),
    "w8-per-tensor-asym": lambda: _q(8, False, per_tensor()),
    "w8-g64": lambda: _q(8, True, per_group(0, 64)),
    "w8-g64-asym-f16": lambda: _q(8, False, per_group(0, 64), "float16"),
    "w4-g128-asym": lambda: _q(4, False, per_group(0, 128), "float16"),
    "w4-g64-sym": lambda: _q(4, True, per_group(0, 64), "float16"),
    "w4-per-channel": lambda: _q(4, False, per_channel(-1)),
    "w2-g64-asym": lambda: _q(2, False, per_group(0, 64), "float16"),
    "w8a8-token": lambda: ActQuantKernel(_q(8, True, per_channel(-1)), None, 8, "token"),
    "w8a8-tensor": lambda: ActQuantKernel(_q(8, True, per_channel(-1)), None, 8, "tensor"),
    "w8a8-g64": lambda: ActQuantKernel(_q(8, True, per_group(0, 64)), None, 8, "token"),
    "w8a8-static": lambda: ActQuantKernel(_q(8, True, per_channel(-1)), jnp.float32(0.02), 8, "token"),
    # the compressed-tensors package's grid (absmax / 127.5, codes down to -128), as read from its checkpoints
    "w8a8-token-full": lambda: ActQuantKernel(_q(8, True, per_channel(-1)), None, 8, "token", True),
    "w8a8-tensor-full": lambda: ActQuantKernel(_q(8, True, per_channel(-1)), None, 8, "tensor", True),
    "w8a8-static-full": lambda: ActQuantKernel(_q(8, True, per_channel(-1)), jnp.float32(0.02), 8, "token", True),
}
EXPECTED_OP = {"fp": "MatMul", "w8": "MatMulNBits", "w4": "MatMulNBits", "w2": "MatMulNBits", "w8a8": "MatMulInteger"}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_kinds_match_eqjax_linear(name):
    layer = {"kernel": LAYERS[name](), "bias": BIAS}
    ref = np.asarray(linear(jnp.asarray(X), layer))
    m = linear_graph(layer, path=name)
    onnx.checker.check_model(m)
    ops = {n.op_type for n in m.graph.node}
    expected = EXPECTED_OP[name.split("-")[0]]
    if expected == "MatMulInteger" and "g64" not in name:
        expected = "MatMulIntegerToFloat"  # the integer product and the weight scales fused in one op
    assert expected in ops
    y = make_session(m).run(None, {"x": X})[0]
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("k", [256, 96])  # 96 = 12 x 8: the Paley factor's MatMul too (SmolLM2: 12 x 128)
@pytest.mark.parametrize("inner", ["fp", "w4-g32-asym", "w8a8-token"])
def test_rotated_layer_matches_eqjax_linear(k, inner):
    """A QuaRot RotatedKernel: the online Hadamard lowered as Mul + MatMuls by its small factors, then
    the inner kernel's own lowering; onnxruntime's output against eqjax's ``linear``. W8A8 rounds the
    rotated activation to int8 codes, where float32 summation-order differences can flip a code at a
    tie: within one code per element there, float rounding elsewhere."""
    from eqjax.core.qarray import RotatedKernel

    w = W[:k]
    inner_k = {"fp": lambda: w, "w4-g32-asym": lambda: quantize(w, QuantSpec(4, False, per_group(0, 32), scale_dtype="float16")),
               "w8a8-token": lambda: ActQuantKernel(quantize(w, QuantSpec(8, True, per_channel(-1))), None, 8, "token")}[inner]()
    layer = {"kernel": RotatedKernel(inner_k, seed=5), "bias": BIAS}
    x = X[:, :k]
    ref = np.asarray(linear(jnp.asarray(x), layer))
    m = linear_graph(layer, path="layers_0/mlp/down_proj")
    onnx.checker.check_model(m)
    rot = [n for n in m.graph.node if n.op_type == "MatMul" and any(i.startswith("rotation.") for i in n.input)]
    assert len(rot) == (2 if k == 96 else 1)
    y = make_session(m).run(None, {"x": x})[0]
    tol = 1e-5 if inner != "w8a8-token" else 1.5 / 127
    np.testing.assert_allclose(y, ref, rtol=0, atol=tol * np.abs(ref).max())


def test_ort_default_qdq_rewrite_quantizes_activations():
    """ORT's default DQ->MatMul rewrite (accuracy level 4) is not exact; level 0 is (what we default to)."""
    layer = {"kernel": LAYERS["w8-per-channel"]()}
    ref = np.asarray(linear(jnp.asarray(X), layer))
    m = linear_graph(layer)
    exact = make_session(m, qdq_accuracy_level=0).run(None, {"x": X})[0]
    default = make_session(m, qdq_accuracy_level=None).run(None, {"x": X})[0]
    assert np.abs(exact - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(default - ref).max() < 0.02 * np.abs(ref).max()  # close, but int8 activations


@pytest.mark.parametrize(
    "kernel, match",
    [
        (lambda: _q(3, False, per_group(0, 64), "float16"), r"layers_0/mlp/down_proj/kernel: 3-bit"),
        (lambda: ActQuantKernel(_q(8, False, per_channel(-1)), None, 8, "token"), r"layers_0/mlp/down_proj/kernel: W8A8 with an asymmetric"),
        (lambda: quantize(jnp.ones((96, 8)), QuantSpec(4, False, per_group(0, 96))), r"down_proj/kernel: group size 96 .* power of two"),
    ],
)
def test_inexpressible_layer_fails_naming_it(kernel, match):
    with pytest.raises(ExportError, match=match):
        linear_graph({"kernel": kernel()}, path="layers_0/mlp/down_proj")


CONFIGS = {
    "llama-gqa": LlamaConfig(vocab=128, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2),
    "qwen2-bias-tied": LlamaConfig(vocab=128, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                   attention_bias=True, model_type="qwen2", tie_word_embeddings=True),
    "qwen3-qknorm-window": LlamaConfig(vocab=128, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=1,
                                       head_dim=32, qk_norm=True, model_type="qwen3", sliding_window=5),
    "gpt2": GPT2Config(vocab=128, hidden=64, n_layers=2, n_heads=4, n_positions=64),
}
RECIPES = {
    "fp32": None,
    "w8": (weight_rule(8),),
    "w8a8": (weight_rule(8, act_bits=8),),
    "w4g32": (weight_rule(4, symmetric=False, group=32),),
    "w7a8": (weight_rule(7, act_bits=8),),  # int8 weights within +-64: the u8 x s8 lowering
}
# a tied head W7A8 as well (the +emb-w7a8 option): the table gathered from the head's int8 initializer
W7A8_HEAD = (weight_rule(7, act_bits=8), weight_rule(7, act_bits=8, role="embedding"))
TOKENS = np.random.default_rng(1).integers(0, 128, (2, 12)).astype(np.int32)


def _rtn(model, params, rules):
    from eqjax.methods.rtn import RTN
    from eqjax.recipes.apply import quantize as run_recipe
    from eqjax.recipes.types import Recipe

    return run_recipe(params, Recipe("t", (RTN(tuple(rules)),)), model=model)


@pytest.fixture(scope="module")
def tiny():
    out = {}
    for name, c in CONFIGS.items():
        model = Model(c)
        out[name] = (model, model.init_params(jax.random.key(1), std=0.1))
    return out


# every recipe on Llama (GQA, untied) and GPT-2; the Qwen variants (bias + tied head, qk-norm + window)
# with the float and W8A8 graphs (the layer kinds are covered above), to keep the run short.
PAIRS = [(a, r) for a in ("llama-gqa", "gpt2") for r in RECIPES] + [
    (a, r) for a in ("qwen2-bias-tied", "qwen3-qknorm-window") for r in ("fp32", "w8a8")] + [
    ("qwen2-bias-tied", "w7a8-head")]


@pytest.mark.parametrize("arch, recipe", PAIRS)
def test_model_export_matches_eqjax(tiny, arch, recipe):
    model, params = tiny[arch]
    rules = W7A8_HEAD if recipe == "w7a8-head" else RECIPES[recipe]
    qp = params if rules is None else _rtn(model, params, rules)
    if recipe == "w7a8-head":
        assert isinstance(qp["embed"]["embedding"], ActQuantKernel)
    ref = np.asarray(model.apply(qp, jnp.asarray(TOKENS))[0])
    m = build_model(model, qp)
    onnx.checker.check_model(m)
    y = onnx_logits(make_session(m), TOKENS)
    if "a8" in recipe:
        # int8 activation codes: a float sum that differs in its last bit (fused norms, summation order) can
        # flip one code at a rounding boundary, which moves that token's logits by ~1 % of their range;
        # the other token rows stay float-exact
        row_ok = np.abs(y - ref).max(-1) <= 2e-5
        assert row_ok.mean() >= 0.9 and np.abs(y - ref).max() < 0.05 * np.abs(ref).max(), row_ok
    else:
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5)


def _feeds(ids, past, length, n_layers):
    """The decoder's inputs (onnxruntime-genai's names and its shared buffer: ``past`` has fixed slots,
    ``attention_mask`` covers the ``length`` tokens already in it and the new ones)."""
    B, T = ids.shape
    feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((B, length + T), np.int64),
             "position_ids": np.broadcast_to(length + np.arange(T, dtype=np.int64), (B, T)).copy()}
    for i in range(n_layers):
        feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
    return feeds


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "qwen3-qknorm-window"])
def test_decode_with_kv_cache_matches_full_prefill(tiny, arch):
    model, params = tiny[arch]
    qp = _rtn(model, params, RECIPES["w8a8"])
    ref = np.asarray(model.apply(qp, jnp.asarray(TOKENS))[0])
    s = make_session(build_model(model, qp))
    c = model.config
    names = [o.name for o in s.get_outputs()]
    past = [np.zeros((2, c.n_kv_heads, 12, c.head_dim), np.float32)] * (2 * c.n_layers)  # genai's shared buffer
    out = dict(zip(names, s.run(None, _feeds(TOKENS[:, :8], past, 0, c.n_layers))))
    np.testing.assert_allclose(out["logits"], ref[:, :8], atol=2e-5)
    for t in range(8, 12):  # one token at a time
        past = [out[f"present.{i}.{kind}"] for i in range(c.n_layers) for kind in ("key", "value")]
        out = dict(zip(names, s.run(None, _feeds(TOKENS[:, t:t + 1], past, t, c.n_layers))))
        np.testing.assert_allclose(out["logits"][:, 0], ref[:, t], atol=2e-5)
    assert out["present.0.key"].shape == (2, c.n_kv_heads, 12, c.head_dim)


def test_w8a8_token_zero_points_are_one_tensor(tiny):
    """Every per-token QuantizeLinear over the same [batch, sequence] reads one zero-point tensor (each
    node costs onnxruntime time), not one Shape + ConstantOfShape per product."""
    model, params = tiny["llama-gqa"]
    nodes = build_model(model, _rtn(model, params, RECIPES["w8a8"])).graph.node
    quant = [n for n in nodes if n.op_type == "QuantizeLinear"]
    assert len(quant) >= 4 * model.config.n_layers  # q/k/v, o, gate/up, down of every layer (+ the head)
    assert len({n.input[2] for n in quant}) == 1
    assert sum(n.op_type == "ConstantOfShape" for n in nodes) == 1


def test_saved_graph_perplexity_matches_float64_reference(tiny, tmp_path):
    model, params = tiny["llama-gqa"]
    qp = _rtn(model, params, RECIPES["w4g32"])
    path = tmp_path / "m.onnx"
    onnx.save_model(build_model(model, qp), str(path), save_as_external_data=True, location="m.onnx.data",
                    size_threshold=1024)
    onnx.checker.check_model(str(path))
    ppl = onnx_perplexity(make_session(path), TOKENS)
    logits = np.asarray(model.apply(qp, jnp.asarray(TOKENS))[0], np.float64)
    lse = np.log(np.exp(logits[:, :-1]).sum(-1))
    nll = lse - np.take_along_axis(logits[:, :-1], TOKENS[:, 1:, None], -1)[..., 0]
    assert abs(ppl / np.exp(nll.mean()) - 1) < 1e-5


def test_model_export_names_the_bad_layer(tiny):
    model, params = tiny["llama-gqa"]
    qp = _rtn(model, params, (weight_rule(3, symmetric=False, group=32),))
    with pytest.raises(ExportError, match=r"layers_0/attn/[qkv]_proj/kernel: 3-bit weights cannot be exported"):
        build_model(model, qp)


@pytest.mark.slow
def test_smollm2_w4_and_w8a8_onnx_perplexity_matches_eqjax(tmp_path):
    """Real model, packages as `eqjax export-onnx` writes them, 1 window of 256 tokens: onnxruntime perplexity
    within 0.5 % of eqjax's at the default target (float activations in MatMulNBits) for W4; the cpu-int8
    target (int8 activations, level 4) within 3 % (measured +1.5 %).

    W8A8 (SmoothQuant, int8 activations per token) against eqjax's own rounding band
    (:func:`eqjax.evaluate.rounding_band`). The integer products are exact on both sides, but the
    per-token activation scales and the float parts (norms, softmax, RoPE) are not, and a last-bit
    difference there (XLA's fusions on another CPU, onnxruntime's kernels) flips an int8 activation code
    now and then; the flips propagate through the layers. So no bound in float32 ulps of the
    log-likelihood holds: on 256 tokens eqjax's perplexity moves by 1-2 % between 1..8-ulp copies of its
    own params (20.58..20.89 measured on a 2-core AVX-512 CPU, onnxruntime 20.67; 20.62..20.98 over 0..3
    ulps on an AVX2-only EPYC, onnxruntime 20.64). onnxruntime's result is one more draw of that noise.
    The check: eqjax's perplexity and its 1..8-ulp copies (9 draws) give ``[lo, hi]``; onnxruntime's must
    lie in ``[lo - (hi - lo) / 2, hi + (hi - lo) / 2]``. For 9 exchangeable Gaussian draws the range is
    about 3.0 sigma wide, so the accepted interval is about 6 sigma wide (3 sigma each side of the
    centre) and a tenth draw falls outside it with probability 2.3 % (1e6-sample Monte Carlo; 6 % for
    the earlier 4 draws widened by the full width, whose extra 0.5 % had no derivation). The band itself
    must stay under 5 %."""
    from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
    from eqjax.evaluate import perplexity, rounding_band
    from eqjax.export.package import export_package
    from eqjax.io.gguf import load_gguf
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.registry import get_recipe

    cfg, params, tok = load_gguf()
    model = Model(cfg)
    cal_ids, eval_ids = wikipedia_tokens(tok)
    win = token_windows(eval_ids, 256, 1)
    w4 = quantize(params, get_recipe("w4g128-rtn"), model=model)
    sq = quantize(params, get_recipe("w8a8-smoothquant"), model=model,
                  calibration=calibration_windows(cal_ids, 4, 128, 0))
    for name, qp, target, tol in (("w4", w4, "cpu", 0.005), ("w8a8", sq, "cpu", None), ("w4", w4, "cpu-int8", 0.03)):
        d = export_package(model, qp, tmp_path / f"{name}-{target}", tokenizer=tok, target=target, check=False)
        assert d["accuracy_level"] == (0 if target == "cpu" else 4)
        ort_ppl = onnx_perplexity(make_session(tmp_path / f"{name}-{target}"), win)
        if name == "w8a8":
            band = rounding_band(model, qp, win, bumps=tuple(range(1, 9)))
            lo, hi = min(band), max(band)
            assert hi / lo - 1 < 0.05, band
            assert lo - (hi - lo) / 2 <= ort_ppl <= hi + (hi - lo) / 2, (name, target, ort_ppl, band)
            continue
        ref = perplexity(model, qp, win).ppl
        assert abs(ort_ppl / ref - 1) < tol, (name, target, ort_ppl, ref)


def test_half_float_params_are_float16_initializers(tiny):
    """``+f16``: every param a float16 initializer (2 bytes per value, as eqjax counts them), widened by
    a Cast; the logits are eqjax's."""
    from eqjax.core.pytree import flatten
    from eqjax.recipes.apply import quantize as run_recipe
    from eqjax.recipes.registry import get_recipe

    model, params = tiny["llama-gqa"]
    q = run_recipe(params, get_recipe("fp+f16"), model=model)
    m = build_model(model, q)
    onnx.checker.check_model(m)
    leaves = dict(flatten(q))
    stored = {t.name.rsplit("_", 1)[0].replace(".", "/"): t for t in m.graph.initializer}
    stored = {p: t for p, t in stored.items() if p in leaves}
    assert len(stored) >= 14 and {t.data_type for t in stored.values()} == {onnx.TensorProto.FLOAT16}
    assert {p: len(t.raw_data) for p, t in stored.items()} == {p: leaves[p].nbytes for p in stored}
    ref = np.asarray(model.apply(q, jnp.asarray(TOKENS))[0])
    np.testing.assert_allclose(onnx_logits(make_session(m), TOKENS), ref, rtol=0, atol=2e-5)
