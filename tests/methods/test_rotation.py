"""Rotations: Hadamard matrices and the fast transform against explicit matrices, the online-rotated
weight (RotatedKernel) in eqjax's linear and in the core's interpreter on a user's linen model, the
offline rotation preserving the float function of eqjax's Llama family, the Rotation step with
quantizing steps inside it (statistics of the rotated activations), refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.analysis import analyze
from eqjax.core.errors import InputError
from eqjax.core.hadamard import HadamardError, hadamard_factors, hadamard_matrix, hadamard_transform, random_signs, rotation_matrix
from eqjax.core.interpret import evaluate
from eqjax.core.linear import linear
from eqjax.core.numerics import QuantSpec, dequantize, dequantize_leaf, quantize
from eqjax.core.program import trace
from eqjax.core.pytree import flatten_with_paths
from eqjax.core.qarray import ActQuantKernel, QArray, RotatedKernel, per_channel
from eqjax.methods.rotation import LAYERS, Rotation, rotate_params
from eqjax.methods.rtn import RTN
from eqjax.models import GPT2Config, LlamaConfig, Model
from eqjax.recipes.apply import quantize as quantize_recipe
from eqjax.recipes.registry import recipe_from_dict, weight_rule
from eqjax.recipes.types import Recipe, with_paths
from tests import zoo

ORDERS = [1, 2, 8, 12, 20, 24, 28, 36, 44, 64, 72, 576, 1536]


# ----------------------------------------------------------------------------- Hadamard
@pytest.mark.parametrize("n", ORDERS)
def test_hadamard_matrix_is_hadamard(n):
    h = hadamard_matrix(n)
    assert set(np.unique(h)) <= {-1, 1}
    np.testing.assert_array_equal(h @ h.T, n * np.eye(n, dtype=np.int64))


@pytest.mark.parametrize("n", ORDERS)
def test_fast_transform_equals_explicit_matrix(n):
    """``hadamard_transform`` (butterflies + a small dense factor) equals ``x @ diag(s) H / sqrt(n)``
    with ``H`` as an explicit matrix (float64), and its inverse ``x @ Q^T``; along any axis."""
    rng = np.random.default_rng(n)
    x = rng.normal(size=(3, n, 2))
    s = random_signs(n, 7)
    q = np.asarray(s, np.float64)[:, None] * hadamard_matrix(n) / np.sqrt(n)
    np.testing.assert_allclose(rotation_matrix(n, s), q, atol=1e-15)
    with jax.enable_x64(True):
        xt = jnp.asarray(x)
        got = np.asarray(hadamard_transform(xt, s, axis=1))
        inv = np.asarray(hadamard_transform(xt, s, axis=1, inverse=True))
        plain = np.asarray(hadamard_transform(xt, axis=1))
    np.testing.assert_allclose(got, np.einsum("anb,nm->amb", x, q), atol=1e-12)
    np.testing.assert_allclose(inv, np.einsum("anb,mn->amb", x, q), atol=1e-12)
    np.testing.assert_allclose(plain, np.einsum("anb,nm->amb", x, hadamard_matrix(n) / np.sqrt(n)), atol=1e-12)


def test_hadamard_orders_refused_by_name():
    assert hadamard_factors(576) == (36, 16) and hadamard_factors(1536) == (12, 128)
    for n in (6, 18, 92):
        with pytest.raises(HadamardError, match=f"order {n}"):
            hadamard_factors(n)


# ----------------------------------------------------------------------------- RotatedKernel
def _qarray(w):
    return quantize(jnp.asarray(w, jnp.float32), QuantSpec(8, True, per_channel(1), "minmax"), name="w")


def test_rotated_kernel_in_linear_equals_explicit_rotation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 12)).astype(np.float32)
    w = rng.normal(size=(12, 7)).astype(np.float32)
    s = random_signs(12, 3)
    q = rotation_matrix(12, s)
    rk = RotatedKernel(jnp.asarray(q.T @ w, jnp.float32), 3, 0)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), {"kernel": rk})), x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dequantize_leaf(rk)), w, atol=1e-5)
    # a quantized inner kernel: (x Q) @ dequant(inner)
    qa = _qarray(q.T @ w)
    got = linear(jnp.asarray(x), {"kernel": RotatedKernel(qa, 3, 0)})
    want = (x.astype(np.float64) @ q) @ np.asarray(dequantize(qa), np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert RotatedKernel(qa, 3).nbytes == qa.nbytes


def test_rotated_kernel_in_a_linen_model_through_the_interpreter():
    """A user's linen model run by the core: its MLP ``down`` weight replaced by a RotatedKernel of
    ``Q^T W`` gives the float model's outputs (float inner and W8 inner vs the explicit rotation)."""
    net, params, batches = zoo.make_linen()
    fn = lambda p, ids: net.apply({"params": p}, ids)  # noqa: E731
    prog = trace(fn, params, batches[0])
    an = analyze(prog)
    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    ref = evaluate(prog, an, flat, batches[0])
    path = "block_0/down/kernel"
    w = np.asarray(flat[path], np.float64)
    q = rotation_matrix(w.shape[0], random_signs(w.shape[0], 5))
    rot = dict(flat)
    rot[path] = RotatedKernel(jnp.asarray(q.T @ w, jnp.float32), 5, 0)
    np.testing.assert_allclose(np.asarray(evaluate(prog, an, rot, batches[0])), np.asarray(ref), rtol=1e-4, atol=1e-5)
    # W8 inner: equals the model whose down weight is Q @ dequant(inner), i.e. the explicit rotation
    qa = _qarray(q.T @ w)
    rot[path] = RotatedKernel(qa, 5, 0)
    explicit = dict(flat)
    explicit[path] = jnp.asarray(q @ np.asarray(dequantize(qa), np.float64), jnp.float32)
    np.testing.assert_allclose(np.asarray(evaluate(prog, an, rot, batches[0])),
                               np.asarray(evaluate(prog, an, explicit, batches[0])), rtol=1e-4, atol=1e-5)
    # a weight contracted over two axes (the Einsum "out" kernel [h, k, d]) is refused, naming it
    o = "block_0/out/kernel"
    bad = dict(flat)
    bad[o] = RotatedKernel(flat[o], 0, 0)
    with pytest.raises(InputError, match="block_0/out/kernel"):
        evaluate(prog, an, bad, batches[0])


# ----------------------------------------------------------------------------- offline rotation
CONFIGS = {
    "tied": dict(tie_word_embeddings=True),
    "qwen2-bias": dict(attention_bias=True, model_type="qwen2"),
    "qwen3-qknorm": dict(qk_norm=True, model_type="qwen3"),
    "llama-o-bias": dict(attention_bias=True, model_type="llama"),
}


def _tiny(kind: str, seed: int = 0):
    cfg = LlamaConfig(vocab=64, hidden=24, intermediate=40, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      **CONFIGS[kind])
    model = Model(cfg)
    p = model.init_params(jax.random.key(seed), std=0.3)
    leaves, tdef = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    # non-unit norm scales and non-zero biases, so that folding them matters
    p = jax.tree.unflatten(tdef, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    toks = np.asarray(jax.random.randint(jax.random.key(seed + 2), (4, 12), 0, 64), np.int32)
    return model, p, toks


def _flat(tree):
    paths, leaves, _ = flatten_with_paths(tree)
    return dict(zip(paths, leaves))


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("residual", ["hadamard", "random"])
def test_rotation_preserves_the_float_function(kind, residual):
    """Rotated params (norms folded, residual / values rotated, online Hadamard before down_proj)
    give the original logits; a wrong rotation (no online transform) does not."""
    model, p, toks = _tiny(kind)
    rot, online = rotate_params(_flat(p), model.config, seed=3, residual=residual)
    assert set(online) == {f"layers_{i}/mlp/down_proj/kernel" for i in range(2)}
    assert "lm_head/kernel" in rot
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(rot[f"layers_{i}/attn_norm/scale"]), 1.0)
    wrapped = {k: RotatedKernel(v, online[k], 0) if k in online else v for k, v in rot.items()}
    ref = np.asarray(model.apply(p, toks)[0])
    got = np.asarray(model.apply(with_paths(p, wrapped), toks)[0])
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, atol=2e-5 * scale)
    broken = np.asarray(model.apply(with_paths(p, rot), toks)[0])
    assert np.abs(broken - ref).max() > 100 * 2e-5 * scale
    # the embedding rows are rotated: row norms kept, rows changed
    e0, e1 = np.asarray(p["embed"]["embedding"]), rot["embed/embedding"]
    np.testing.assert_allclose(np.linalg.norm(e1, axis=1), np.linalg.norm(e0, axis=1), rtol=1e-5)
    assert np.abs(e1 - e0).max() > 0.1


def test_rotation_spreads_an_outlier_channel():
    """A residual channel 100x larger than the rest: after the rotation every channel of the
    residual stream carries a share (max/rms over the channels drops from ~sqrt(D) towards 1)."""
    model, p, toks = _tiny("tied")
    emb = np.asarray(p["embed"]["embedding"]).copy()
    emb[:, 5] *= 100.0
    p = dict(p, embed={"embedding": jnp.asarray(emb)})
    rot, _ = rotate_params(_flat(p), model.config, seed=0)
    h0, h1 = emb[toks], np.asarray(rot["embed/embedding"])[toks]
    ratio = lambda h: (np.abs(h).max(-1) / np.sqrt((h**2).mean(-1))).mean()  # noqa: E731
    assert ratio(h0) > 4 and ratio(h1) < 2  # a single spike: sqrt(24) = 4.9; flat: 1


# ----------------------------------------------------------------------------- the step
def test_rotation_step_without_quantization_keeps_the_model():
    model, p, toks = _tiny("tied")
    q = quantize_recipe(p, Recipe("r", (Rotation(),)), model=model, calibration=toks)
    assert "lm_head" in q and isinstance(q["layers_0"]["mlp"]["down_proj"]["kernel"], RotatedKernel)
    ref = np.asarray(model.apply(p, toks)[0])
    np.testing.assert_allclose(np.asarray(model.apply(q, toks)[0]), ref, atol=2e-5 * np.abs(ref).max())


def test_rotation_step_quantizes_inside_and_wraps():
    """W8A8 inside the rotation: every layer weight an ActQuantKernel (down_proj's inside its
    RotatedKernel); the untied head float; closer to float than W8A8 without rotation is not asserted
    (tiny random models have no outliers), only that it stays close."""
    model, p, toks = _tiny("tied")
    r = Recipe("r", (Rotation(then=(RTN((weight_rule(8, act_bits=8, pattern=LAYERS),)),)),))
    q = quantize_recipe(p, r, model=model, calibration=toks)
    assert isinstance(q["layers_1"]["attn"]["q_proj"]["kernel"], ActQuantKernel)
    down = q["layers_1"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(down, RotatedKernel) and isinstance(down.kernel, ActQuantKernel)
    assert not isinstance(q["lm_head"]["kernel"], (QArray, ActQuantKernel))
    ref = np.asarray(model.apply(p, toks)[0])
    err = np.abs(np.asarray(model.apply(q, toks)[0]) - ref).max()
    assert 0 < err < 0.1 * np.abs(ref).max()
    # act_bits wraps the quantized weights of a weight-only inner step
    r4 = Recipe("r4", (Rotation(then=(RTN((weight_rule(4, symmetric=False, group=8, pattern=LAYERS),)),),
                                act_bits=8),))
    q4 = quantize_recipe(p, r4, model=model, calibration=toks)
    assert isinstance(q4["layers_0"]["mlp"]["up_proj"]["kernel"], ActQuantKernel)
    assert q4["layers_0"]["mlp"]["up_proj"]["kernel"].weight.bits == 4


def test_inner_steps_see_the_rotated_activations():
    """A step inside the rotation gets a context whose model includes the online transform: the
    activation its calibrator sees at down_proj equals ``(silu(x W_gate) * x W_up) @ Q_F`` computed
    from the rotated params with an explicit Q_F."""
    model, p, toks = _tiny("qwen2-bias")
    seen = {}

    class Capture:
        name = "capture"
        needs_calibration = True

        def __call__(self, params, ctx):
            cal = ctx.calibrator(self.name)

            def per_block(bc, pp):
                if not bc.name.startswith("layers_"):  # the untied LM head's block
                    return pp
                u = next(u for u in bc.uses if u.path.endswith("down_proj/kernel"))
                up = next(v for v in bc.uses if v.path.endswith("up_proj/kernel"))
                seen[bc.name] = (bc.statistics({"xtx": _xtx()}, [u])[u.path]["xtx"],
                                 bc.statistics({"xtx": _xtx()}, [up])[up.path]["xtx"])
                return pp

            cal.run_blocks(params, per_block)
            seen["params"] = params
            return params

    quantize_recipe(p, Recipe("c", (Rotation(then=(Capture(),), seed=4),)), model=model, calibration=toks)
    rp = seen["params"]
    # explicit forward of layer 0's MLP input from the rotated params
    from eqjax.models import llama

    cfg = model.config
    pos = model.positions(*toks.shape)
    h = model.embed(with_paths(p, rp), jnp.asarray(toks), pos)
    a, _ = llama._attention(cfg, with_paths(p, rp)["layers_0"]["attn"],
                            llama.rms_norm(h, rp["layers_0/attn_norm/scale"], cfg.rms_norm_eps), pos, 0, None, None)
    x = llama.rms_norm(h + a, rp["layers_0/mlp_norm/scale"], cfg.rms_norm_eps)
    act = jax.nn.silu(x @ rp["layers_0/mlp/gate_proj/kernel"]) * (x @ rp["layers_0/mlp/up_proj/kernel"])
    act = np.asarray(act, np.float64).reshape(-1, cfg.intermediate)
    qf = rotation_matrix(cfg.intermediate, random_signs(cfg.intermediate, 4 + 2))
    n = act.shape[0]
    want = (act @ qf).T @ (act @ qf) / n
    got, got_up = (np.asarray(v, np.float64) for v in seen["layers_0"])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    assert np.abs(act.T @ act / n - got).max() > 0.01 * np.abs(want).max()  # not the unrotated statistics
    xr = np.asarray(x, np.float64).reshape(-1, cfg.hidden)
    np.testing.assert_allclose(got_up, xr.T @ xr / n, rtol=1e-3, atol=1e-3 * np.abs(got_up).max())


def _xtx():
    from eqjax.calibration.statistics import xtx

    return xtx()


def test_refusals_name_why():
    model, p, toks = _tiny("tied")
    with pytest.raises(InputError, match="Llama-family Model"):
        quantize_recipe(p, Recipe("r", (Rotation(),)), model=lambda pp, t: model.apply(pp, t)[0], calibration=[(toks,)])
    gpt = Model(GPT2Config(vocab=64, n_positions=16, hidden=16, n_layers=1, n_heads=2))
    gp = gpt.init_params(jax.random.key(0))
    with pytest.raises(InputError, match="LayerNorm subtracts the mean"):
        quantize_recipe(gp, Recipe("r", (Rotation(),)), model=gpt, calibration=toks[:, :8])
    q = quantize_recipe(p, Recipe("w8", (RTN((weight_rule(8),)),)), model=model, calibration=toks)
    with pytest.raises(InputError, match="already quantized"):
        rotate_params(_flat(q), model.config)
    odd = Model(LlamaConfig(vocab=64, hidden=24, intermediate=18, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8))
    op = odd.init_params(jax.random.key(0))
    with pytest.raises(InputError, match="online_down=False"):
        rotate_params(_flat(op), odd.config)
    rot, online = rotate_params(_flat(op), odd.config, online_down=False)
    assert not online


def test_recipe_file_form():
    r = recipe_from_dict({"name": "x", "steps": [{"method": "rotation", "seed": 2, "act_bits": 8, "then": [
        {"method": "rtn", "rules": [{"pattern": "layers_.*", "bits": 4, "role": "matmul"}]}]}]})
    (step,) = r.steps
    assert isinstance(step, Rotation) and step.seed == 2 and step.act_bits == 8 and len(step.then) == 1
    assert not r.needs_calibration
    with pytest.raises(InputError, match="residual"):
        recipe_from_dict({"name": "x", "steps": [{"method": "rotation", "residual": 3}]})


@pytest.mark.slow
def test_smollm2_rotated_logits_equal_the_original():
    """SmolLM2-135M (30 layers, D 576 = 36 x 16 Paley II, F 1536, GQA 9/3, tied embedding): the rotated
    model (folded norms, residual and value rotations, online Hadamard before down_proj) gives the
    original float32 logits on real text, and the same next-token predictions."""
    from eqjax import data
    from eqjax.io.gguf import load_gguf

    cfg, params, tok = load_gguf()
    model = Model(cfg)
    _, ev_ids = data.wikipedia_tokens(tok)
    toks = np.asarray(data.token_windows(ev_ids, 128)[:1], np.int32)
    rot, online = rotate_params(_flat(params), cfg, seed=0)
    assert len(online) == cfg.n_layers
    wrapped = {k: RotatedKernel(jnp.asarray(v), online[k], 0) if k in online else jnp.asarray(v) for k, v in rot.items()}
    ref = np.asarray(model.apply(params, toks)[0], np.float64)
    got = np.asarray(model.apply(with_paths(params, wrapped), toks)[0], np.float64)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, atol=2e-3 * scale)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.99
    broken = np.asarray(model.apply(with_paths(params, rot), toks)[0], np.float64)
    assert np.abs(broken - ref).max() > 50 * 2e-3 * scale


@pytest.mark.parametrize("name,bits,act", [("w8a8-rot", 8, True), ("w4g128-rot-rtn", 4, False),
                                           ("w4g128-rot-gptq", 4, False), ("w4a8-rot-gptq", 4, True),
                                           ("w4g128-rot-gptq-search", 4, False)])
def test_named_rotation_recipes(name, bits, act):
    """The built-in rotated recipes, by name: a Rotation step quantizing every layer weight (down_proj
    inside its RotatedKernel) with the recipe's bits, activations quantized where named, the untied
    LM head float (int8 per channel in ``w4g128-rot-gptq-search``). Oracle: the float model whose weights are the dequantized kernels (down_proj's
    rotated back explicitly, ``Q_F @ dequant(inner)``) gives the same logits as the online path
    (weight-only; for A8 within the activation rounding), and differs from the float model."""
    from eqjax.recipes.registry import get_recipe

    model, p, toks = _tiny("tied")
    r = get_recipe(name)
    assert r.name == name and isinstance(r.steps[0], Rotation)
    q = quantize_recipe(p, r, model=model, calibration=toks)
    flat = _flat(q)
    kinds = {k: v for k, v in flat.items() if k.endswith("/kernel") and k.startswith("layers_")}
    assert len(kinds) == 2 * 7
    explicit = dict(flat)
    for path, leaf in kinds.items():
        qf = None
        if path.endswith("down_proj/kernel"):
            assert isinstance(leaf, RotatedKernel), path
            qf = rotation_matrix(leaf.shape[0], leaf.signs())
            leaf = leaf.kernel
        assert isinstance(leaf, ActQuantKernel if act else QArray), path
        w = leaf.weight if act else leaf
        assert w.bits == bits
        w = np.asarray(dequantize(w), np.float64)
        explicit[path] = jnp.asarray(w if qf is None else qf @ w, jnp.float32)
    head = q["lm_head"]["kernel"]
    if name == "w4g128-rot-gptq-search":
        assert isinstance(head, QArray) and head.bits == 8 and head.granularity.kind == "channel"
        explicit["lm_head/kernel"] = dequantize(head)
    else:
        assert not isinstance(head, (QArray, ActQuantKernel, RotatedKernel))
    ref = np.asarray(model.apply(p, toks)[0])
    scale = np.abs(ref).max()
    got = np.asarray(model.apply(q, toks)[0])
    want = np.asarray(model.apply(with_paths(q, explicit), toks)[0])
    if act:  # per-token int8 activations: small on average (a few tokens of a random tiny model move more)
        assert np.abs(got - want).mean() < 0.01 * scale
    else:
        np.testing.assert_allclose(got, want, atol=1e-4 * scale)
    assert np.abs(got - ref).max() > 1e-3 * scale
