"""A recipe means the same quantization whatever the layout of a weight: eqjax's own Llama and two
third-party layouts of the same weights (examples/layout_models.py: a gemma-style NNX model with fused kv
``[2, K, D, H]`` / gate-up ``[2, F, D]`` einsum weights and an ``[N, H, D]`` attention output; an einsum
linen model with ``DenseGeneral`` / ``Einsum`` and gate/up fused on the output axis) quantized with the
same calibration must hold the same quantized weights, report the groups used, take the same bytes and
compute the same logits.

Head dim 64 with groups of 128: the attention output's contraction [3, 64] (192 inputs) is grouped
along the flattened 192 (128 + a short 64), as eqjax's own ``o_proj [192, D]`` is.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqjax
from eqjax.core.numerics import dequantize_leaf, expand_scale
from eqjax.core.pytree import flatten, tree_nbytes
from eqjax.core.qarray import ActQuantKernel, is_quantized
from eqjax.models import LlamaConfig, Model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import layout_models as lm  # noqa: E402

CFG = LlamaConfig(vocab=96, hidden=192, intermediate=256, n_layers=1, n_heads=3, n_kv_heads=1, head_dim=64,
                  tie_word_embeddings=True)  # a tied head stays float: every quantized weight sees one block
CALIB = np.random.default_rng(0).integers(0, 96, (8, 32)).astype(np.int32)
IDS = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 24)), jnp.int32)
EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def own():
    model = Model(CFG)
    return model, model.init_params(jax.random.key(0), std=0.1)


def _quantized(style: str, recipe: str, params) -> tuple[dict, object, list]:
    """(flat quantized params, logits function, report) of a layout model quantized with ``recipe``."""
    batches = [(jnp.asarray(CALIB[i:i + 4]),) for i in range(0, len(CALIB), 4)]
    if style == "gemma":
        qm = eqjax.quantize_model(lm.gemma_style_from_llama(CFG, params), recipe, calibration=batches)
        return dict(flatten(qm.params)), qm, list(qm.report)
    mod, variables = lm.einsum_linen_from_llama(CFG, params)
    qmod, qp = eqjax.quantize_model(mod, recipe, params=variables, calibration=batches)
    return dict(flatten(qp)), (lambda t: qmod.apply({"params": qp}, t)), []


def _step(leaf) -> np.ndarray:
    q = leaf.weight if isinstance(leaf, ActQuantKernel) else leaf
    return np.asarray(expand_scale(q))


# Each method on the layout that exercises it most: GPTQ's Hessian on the [N, H, D] output grouped across heads
# (gemma), SmoothQuant's smoothing of gate/up fused on the output axis (linen), AWQ's per-column clip on a
# fused kv in both, RTN in both.
@pytest.mark.parametrize("style, recipe", [("gemma", "w4g128-rtn"), ("linen", "w4g128-rtn"), ("gemma", "w4g128-gptq"),
                                           ("gemma", "w4g128-awq"), ("linen", "w4g128-awq"),
                                           ("linen", "w8a8-smoothquant")])
def test_same_quantization_in_every_layout(own, style, recipe):
    model, params = own
    ref_q = dict(flatten(eqjax.quantize(params, recipe, model=model, calibration=CALIB)))
    got, run, report = _quantized(style, recipe, params)
    for own_path, (path, kind) in lm.weight_correspondence(CFG, style).items():
        want = np.asarray(dequantize_leaf(ref_q[own_path], jnp.float32))
        leaf = got[next(p for p in got if p == path or p.startswith(path + "/"))]
        have = np.asarray(lm.to_llama_kernel(kind, dequantize_leaf(leaf, jnp.float32)))
        if recipe == "w4g128-rtn" or not is_quantized(leaf):
            np.testing.assert_array_equal(have, want, err_msg=own_path)
            continue
        # calibrated recipes see activations computed in another summation order (einsum vs matmul): a
        # weight within a few ulps of a rounding boundary may land on the neighbouring code (GPTQ then
        # carries the difference into the later inputs of that column, so there it may differ by more)
        step = np.asarray(lm.to_llama_kernel(kind, _step(leaf)))
        off = np.abs(have - want) > 4 * EPS * np.abs(want).max()
        assert recipe == "w4g128-gptq" or np.all(np.abs(have - want)[off] <= step[off] * (1 + 1e-3)), own_path
        assert off.mean() <= 0.01, (own_path, off.mean())
    assert tree_nbytes(got) == tree_nbytes(ref_q)
    if style == "gemma" and recipe == "w4g128-rtn":
        assert ("layers/0/attn/attn_vec_einsum/w", "rtn: int4 asym group128@axes0-1") in report
        assert ("layers/0/attn/kv_einsum/w", "rtn: int4 asym group128@axis2") in report


def test_quantized_logits_agree_as_the_float_ones_do(own):
    """The RTN-quantized layout models compute the own model's quantized logits up to the float
    summation-order difference the float models already show."""
    model, params = own
    f = jax.jit(lambda p, t: model.apply(p, t)[0])
    ref_f, ref_q = np.asarray(f(params, IDS)), np.asarray(f(eqjax.quantize(params, "w4g128-rtn", model=model, calibration=CALIB), IDS))
    float_gap = float(np.abs(np.asarray(lm.gemma_style_from_llama(CFG, params)(IDS)) - ref_f).max())
    for style in ("gemma", "linen"):
        _, run, _ = _quantized(style, "w4g128-rtn", params)
        gap = float(np.abs(np.asarray(run(IDS)) - ref_q).max())
        assert gap <= 4 * max(float_gap, EPS * np.abs(ref_q).max()), (style, gap, float_gap)
