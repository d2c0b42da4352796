"""Quantization-aware training: straight-through gradients against a float64 oracle, the exported QArray
against the trained forward bit for bit, a tiny model whose distillation loss falls, the recipe step.

Oracles: the straight-through (STE) gradient is the derivative of the surrogate in which each rounding
``round(t)`` is replaced by ``round(t0) + (t - t0)`` around the point ``t0`` (identity gradient, the same value
there); away from the clip boundaries that surrogate is smooth, so a float64 central difference of it (written
here in numpy, independently of eqjax's grid code) is the oracle. Exactness of the export: ``dequantize`` of the
QArray and the fake-quantized forward are the same float32 operations on the same integers and scales.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eqjax.core.errors import InputError, RecipeError
from eqjax.core.numerics import QuantSpec, codes, dequantize, quantize
from eqjax.core.qarray import ActQuantKernel, per_channel, per_group
from eqjax.methods.qat import (
    QAT,
    FakeQuant,
    default_optimizer,
    fake_value,
    from_qarray,
    kl_to_teacher,
    leaf_kind,
    to_qarray,
    trainable,
)
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize as run_recipe
from eqjax.recipes.registry import get_recipe, recipe_from_dict
from eqjax.recipes.schema import SchemaError
from eqjax.recipes.types import Recipe

LAYOUTS = [  # (shape, granularity, bits, symmetric, scale dtype)
    ((48, 6), per_group(0, 16), 4, False, "float16"),
    ((40, 5), per_group(0, 16), 3, False, "float32"),  # ragged last group
    ((4, 8, 6), per_group((0, 1), 16), 2, False, "bfloat16"),  # groups along a flattened 2-axis contraction
    ((32, 7), per_channel(1), 8, True, "float32"),
    ((32, 7), per_group(0, 8), 4, True, "float16"),
    ((24, 5), per_channel(1), 6, False, "float32"),
]


def _fq(shape, gran, bits, sym, sd, seed=0) -> FakeQuant:
    w = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    return from_qarray(quantize(w, QuantSpec(bits, sym, gran, "minmax", scale_dtype=sd)))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[2]}b-{x[1].kind}-{x[4]}")
def test_fake_value_starts_at_the_quantized_weight_and_exports_it_back(layout):
    w = jax.random.normal(jax.random.key(1), layout[0], jnp.float32)
    q = quantize(w, QuantSpec(layout[2], layout[3], layout[1], "minmax", scale_dtype=layout[4]))
    fq = from_qarray(q)
    assert np.array_equal(np.asarray(fake_value(fq)), np.asarray(dequantize(q)))
    back = to_qarray(fq)
    assert np.array_equal(np.asarray(codes(back)), np.asarray(codes(q)))
    assert np.array_equal(np.asarray(back.scale), np.asarray(q.scale))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(range(len(LAYOUTS))), st.integers(0, 2**16), st.floats(0.5, 2.0), st.floats(-3.0, 3.0))
def test_export_equals_the_trained_forward_bit_for_bit(i, seed, scale_factor, zero_shift):
    """After any training (scale moved, zero point off-integer, weights moved) the stored QArray dequantizes to
    exactly the forward's weights, eagerly and under jit."""
    fq = _fq(*LAYOUTS[i], seed=seed)
    key = jax.random.key(seed + 1)
    fq = dataclasses.replace(
        fq, weight=fq.weight + 0.3 * jax.random.normal(key, fq.weight.shape),
        scale=fq.scale * scale_factor,
        zero=None if fq.zero is None else fq.zero + zero_shift)
    q = to_qarray(fq)
    want = np.asarray(fake_value(fq))
    assert np.array_equal(np.asarray(dequantize(q)), want)
    assert np.array_equal(np.asarray(jax.jit(fake_value)(fq)), want)


def _surrogate64(w, s, z, w0, s0, z0, bits, sym, group):
    """float64 STE surrogate of one [K] column grouped along K (groups of ``group``): rounding linearized at
    the point ``(w0, s0, z0)``; scale used as given (its dtype rounding is a constant shift there)."""
    out = np.empty_like(w)
    lo, hi = ((-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if sym else (0, 2**bits - 1))
    for g in range(len(s)):
        sl = slice(g * group, (g + 1) * group)
        t, t0 = w[sl] / s[g], w0[sl] / s0[g]
        r = np.round(t0) + (t - t0)
        if sym:
            out[sl] = np.clip(r, lo, hi) * s[g]
        else:
            zr = np.round(z0[g]) + (z[g] - z0[g])
            out[sl] = (np.clip(r + zr, lo, hi) - zr) * s[g]
    return out


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_straight_through_gradients_match_a_float64_finite_difference(sym):
    """Gradients in the FakeQuant's own (grid-unit) parameters: latent weight v (float weight v * u), relative
    scale r (scale r * u), zero point z, with u the constant grid unit."""
    bits, group, k = 3, 8, 32
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=k)
    q = quantize(jnp.asarray(w0[:, None], jnp.float32), QuantSpec(bits, sym, per_group(0, group), "minmax",
                                                                  scale_dtype="float32"))
    fq = from_qarray(q)
    # move the point off the grid: weights inside their bins, zero points off-integer, scales slightly changed;
    # a weight is kept off clip boundaries (where the surrogate has a kink) and off rounding boundaries
    r0 = np.full(k // group, 1.07)
    z0 = None if sym else np.asarray(fq.zero, np.float64)[:, 0] + 0.2
    v0 = np.asarray(fq.weight, np.float64)[:, 0] * 1.07 + rng.uniform(-0.3, 0.3, k) * 1.07
    fq = dataclasses.replace(fq, weight=jnp.asarray(v0[:, None], jnp.float32),
                             scale=jnp.asarray(r0[:, None], jnp.float32),
                             zero=None if sym else jnp.asarray(z0[:, None], jnp.float32))
    v0, r0 = np.asarray(fq.weight, np.float64)[:, 0], np.asarray(fq.scale, np.float64)[:, 0]
    u = np.asarray(fq.unit, np.float64)[:, 0]
    z0 = np.zeros(len(r0)) if sym else np.asarray(fq.zero, np.float64)[:, 0]
    c = rng.normal(size=k)
    g = jax.grad(lambda f: jnp.sum(jnp.asarray(c[:, None], jnp.float32) * fake_value(f)))(fq)

    def loss(v, r, z):
        sur = _surrogate64(v * np.repeat(u, group), r * u, z, v0 * np.repeat(u, group), r0 * u, z0, bits, sym, group)
        return float(np.sum(c * sur))

    eps = 1e-6
    fd_v = np.array([(loss(v0 + eps * e, r0, z0) - loss(v0 - eps * e, r0, z0)) / (2 * eps) for e in np.eye(k)])
    fd_r = np.array([(loss(v0, r0 + eps * e, z0) - loss(v0, r0 - eps * e, z0)) / (2 * eps) for e in np.eye(len(r0))])
    # float32 gradients of O(u) terms summed over a group: a few float32 epsilons of the term magnitudes
    tol = 8 * np.finfo(np.float32).eps * (np.abs(c).sum() + 1) * (2**bits) * max(1.0, u.max())
    np.testing.assert_allclose(np.asarray(g.weight)[:, 0], fd_v, atol=tol)
    np.testing.assert_allclose(np.asarray(g.scale)[:, 0], fd_r, atol=tol)
    if not sym:
        fd_z = np.array([(loss(v0, r0, z0 + eps * e) - loss(v0, r0, z0 - eps * e)) / (2 * eps) for e in np.eye(len(r0))])
        np.testing.assert_allclose(np.asarray(g.zero)[:, 0], fd_z, atol=tol * np.max(u))
    assert not np.any(np.asarray(g.unit))  # the grid unit is a constant
    assert np.any(np.abs(fd_r) > 10 * tol)  # the oracle is not vacuous


def test_kl_to_teacher_against_float64():
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(3, 5, 11)), rng.normal(size=(3, 5, 11))

    def logsm(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    want = np.mean(np.sum(np.exp(logsm(t)) * (logsm(t) - logsm(s)), -1))
    got = float(kl_to_teacher(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32)))
    assert abs(got - want) <= 16 * np.finfo(np.float32).eps * max(1.0, abs(want)) * 11
    assert float(kl_to_teacher(jnp.asarray(t, jnp.float32), jnp.asarray(t, jnp.float32))) == pytest.approx(0, abs=1e-6)


def test_leaf_kinds_and_optimizer_move_only_what_it_trains():
    fq = _fq((32, 4), per_group(0, 16), 4, False, "float16")
    tree = {"a/kernel": fq}
    kinds = jax.tree_util.tree_map_with_path(lambda kp, _: leaf_kind(kp), tree)
    k = kinds["a/kernel"]
    assert (k.weight, k.scale, k.zero, k.unit) == ("weight", "scale", "zero", "unit")
    grads = jax.tree.map(jnp.ones_like, tree)
    for lr_scale, lr_weight in ((1e-2, 0.0), (0.0, 1e-2)):
        tx = default_optimizer(10, lr_scale=lr_scale, lr_weight=lr_weight)
        state = tx.init(tree)
        for _ in range(3):
            upd, state = tx.update(grads, state, tree)
        u = upd["a/kernel"]
        assert not np.any(np.asarray(u.unit))  # never updated, whatever its gradient
        assert np.all(np.asarray(u.scale) < 0) == (lr_scale > 0) and not np.any(np.asarray(u.scale)) == (lr_scale == 0)
        for moved in (u.weight, u.zero):  # both in codes: lr_weight
            assert np.all(np.asarray(moved) < 0) == (lr_weight > 0) and not np.any(np.asarray(moved)) == (lr_weight == 0)


def test_trainable_refuses_activation_quantized_leaves_naming_the_path():
    q = quantize(jnp.ones((16, 4)), QuantSpec(8, True, per_channel(1), "absmax"))
    with pytest.raises(InputError, match="layers_0/mlp/kernel.*ActQuantKernel"):
        trainable({"layers_0/mlp/kernel": ActQuantKernel(q, 8)})
    with pytest.raises(InputError, match="found none"):
        trainable({"w": jnp.ones((4, 4))})


CFG = LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=2, n_heads=4, n_kv_heads=2)


def test_qat_step_lowers_the_distillation_loss_and_stores_what_it_trained():
    model = Model(CFG)
    params = model.init_params(jax.random.key(0), std=0.2)
    toks = np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 64, dtype=jnp.int32))
    base = run_recipe(params, get_recipe("w3g128-rtn"), model=model)
    step = QAT(tokens=2 * 16 * 40, lr_scale=5e-2, lr_weight=3e-2)  # 40 steps of 2 windows
    q = run_recipe(params, Recipe("t", (get_recipe("w3g128-rtn").steps[0], step)), model=model, calibration=toks)
    rep = step.report
    assert rep["steps"] == 40 and rep["tokens"] == 2 * 16 * 40 and np.isfinite(rep["loss_last"]), rep

    def kl(p):
        return float(kl_to_teacher(model.apply(p, jnp.asarray(toks))[0], model.apply(params, jnp.asarray(toks))[0]))

    assert kl(q) < 0.8 * kl(base)
    flat_q = {k: v for k, v in jax.tree_util.tree_flatten_with_path(q, is_leaf=lambda x: hasattr(x, "bits"))[0]}
    assert all(hasattr(v, "bits") and v.bits == 3 for k, v in flat_q.items() if "kernel" in jax.tree_util.keystr(k))


def test_qat_step_needs_the_model_and_data():
    model = Model(CFG)
    params = model.init_params(jax.random.key(0), std=0.2)
    with pytest.raises(RecipeError, match="needs the model and calibration"):
        run_recipe(params, Recipe("t", (get_recipe("w3g128-rtn").steps[0], QAT(tokens=16))), model=model)
    with pytest.raises(ValueError, match="tokens"):
        QAT(tokens=0)


def test_recipe_file_step_and_suffix():
    rule = {"pattern": ".*", "role": "matmul", "bits": 4, "symmetric": False, "granularity": "group", "group_size": 32}
    r = recipe_from_dict({"name": "mine", "steps": [{"method": "rtn", "rules": [rule]},
                                                    {"method": "qat", "tokens": 64, "lr_scale": 1e-3}]})
    assert r.steps[1] == QAT(tokens=64, lr_scale=1e-3) and r.needs_calibration
    with pytest.raises(SchemaError, match=r"steps\[0\].tokens"):
        recipe_from_dict({"name": "x", "steps": [{"method": "qat", "tokens": "64"}]})
    assert [s.name for s in get_recipe("w2g64-gptq-search+qat+emb-int8").steps] == ["gptq", "qat", "embedding-int8"]
