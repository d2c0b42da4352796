"""Quantized execution inside any model: weight-only equals the float model on the dequantized
weights; W8A8 equals an independent oracle (per-token fake-quantized activations times the
dequantized weight, in float64); quantized embedding gathers equal gathers of the dequantized table."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.analysis import activation_matrix, analyze, weight_matrix
from eqjax.core.interpret import evaluate
from eqjax.core.linear import use_backend
from eqjax.core.numerics import QuantSpec, dequantize, quantize
from eqjax.core.program import trace
from eqjax.core.pytree import flatten_with_paths, unflatten_paths
from eqjax.core.qarray import ActQuantKernel, per_channel, per_group, per_input_group, per_output_channel
from eqjax.core.qdot import assemble_output
from eqjax.core.roles import resolve_granularity, weight_layout
from tests import zoo

MODES = {
    "w8": (QuantSpec(8, True, per_output_channel()), None),
    "w4g8": (QuantSpec(4, False, per_input_group(8), scale_dtype="float16"), None),
    "w8a8": (QuantSpec(8, True, per_output_channel()), 8),
    "w4a8g8": (QuantSpec(4, True, per_input_group(8), scale_dtype="float16"), 8),
}


@pytest.fixture(scope="module")
def models():
    return zoo.all_models()


def _quantized(an, flat, spec, act_bits):
    q, deq = dict(flat), dict(flat)
    for path, role in an.roles.items():
        if role.kind != "matmul":
            continue
        shape = tuple(flat[path].shape)
        gran = resolve_granularity(spec.granularity, weight_layout(an, path, shape), shape, path)
        qa = quantize(flat[path], dataclasses.replace(spec, granularity=gran), name=path)
        deq[path] = dequantize(qa)
        q[path] = qa if act_bits is None else ActQuantKernel(qa, None, act_bits)
    return q, deq


def _w8a8_oracle(prog, an, deq, act_bits):
    """A dot hook computing each quantized dot in float64 from fake-quantized activation rows."""
    qmax = 2 ** (act_bits - 1) - 1

    def hook(use, x, w, default):
        if an.roles[use.path].kind != "matmul":  # not quantized (a tied embedding head stays float)
            return default(x, w)
        x2 = np.asarray(activation_matrix(x, use), np.float32)  # the scale is defined in float32
        amax = np.abs(x2).max(1, keepdims=True)
        s = np.where(amax > 0, amax / np.float32(qmax), np.float32(1.0)).astype(np.float32)
        xq = np.clip(np.round(x2 / s), -qmax, qmax).astype(np.float64) * s
        y2 = xq @ np.asarray(weight_matrix(deq[use.path], use), np.float64)
        return assemble_output(jnp.asarray(y2, jnp.float32), use, prog.nodes[use.node], prog, x)

    return hook


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["linen", "nnx", "hf-llama", "hf-gpt2", "eqjax-llama"])
def test_quantized_execution(models, name, mode):
    fn, params, batches = models[name]
    prog = trace(fn, params, batches[0])
    an = analyze(prog)
    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    spec, act_bits = MODES[mode]
    q, deq = _quantized(an, flat, spec, act_bits)
    got = np.asarray(jax.jit(lambda pm, a: evaluate(prog, an, pm, a))(q, list(batches[0])))
    if act_bits is None:
        ref = np.asarray(fn(unflatten_paths(deq, params), *batches[0]))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    else:
        with jax.disable_jit():
            ref = np.asarray(evaluate(prog, an, deq, list(batches[0]), dot_hook=_w8a8_oracle(prog, an, deq, act_bits)))
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)
        # and the integer path really quantizes: it differs from the weight-only result
        assert not np.allclose(got, np.asarray(fn(unflatten_paths(deq, params), *batches[0])), atol=1e-7)


@pytest.mark.parametrize("gran", [per_channel(0), per_group(1, 8)])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_embedding_gather(models, gran, bits):
    fn, params, batches = models["linen"]
    prog = trace(fn, params, batches[0])
    an = analyze(prog)
    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    qa = quantize(flat["embed/embedding"], QuantSpec(bits, False, gran), name="embed")
    q = {**flat, "embed/embedding": qa}
    got = np.asarray(jax.jit(lambda pm, a: evaluate(prog, an, pm, a))(q, list(batches[0])))
    ref = np.asarray(fn(unflatten_paths({**flat, "embed/embedding": dequantize(qa)}, params), *batches[0]))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_pallas_interpret_backend_matches_xla(models):
    fn, params, batches = models["eqjax-llama"]
    prog = trace(fn, params, batches[0])
    an = analyze(prog)
    paths, leaves, _ = flatten_with_paths(params)
    q, _ = _quantized(an, dict(zip(paths, leaves)), QuantSpec(8, True, per_output_channel()), 8)
    run = jax.jit(lambda pm, a: evaluate(prog, an, pm, a))
    ref = np.asarray(run(q, list(batches[0])))
    with use_backend("pallas_interpret"):
        got = np.asarray(jax.jit(lambda pm, a: evaluate(prog, an, pm, a))(q, list(batches[0])))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["linen", "eqjax-llama"])
def test_input_permuted_weights_run_as_the_weights_they_stand_for(models, name):
    """A traced model whose quantized 2-D weights are input-permuted (activation-ordered groups) gathers each
    dot's input features: the same output as the float model on the weights the kernels stand for."""
    from eqjax.core.numerics import dequantize_leaf
    from eqjax.core.qarray import PermutedKernel

    fn, params, batches = models[name]
    prog = trace(fn, params, batches[0])
    an = analyze(prog)
    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    q, _ = _quantized(an, flat, *MODES["w4g8"])
    rng = np.random.default_rng(0)
    deq, permuted = dict(flat), 0
    for use in an.uses:
        w = q[use.path]
        if use.contracting == (0,) and len(w.shape) == 2 and not use.batch and not use.view.index:
            q[use.path] = PermutedKernel(w, jnp.asarray(rng.permutation(w.shape[0]), jnp.int32))
            permuted += 1
    assert permuted
    for path in q:
        if an.roles.get(path) is not None and an.roles[path].kind == "matmul":
            deq[path] = dequantize_leaf(q[path])
    got = np.asarray(jax.jit(lambda pm, a: evaluate(prog, an, pm, a))(q, list(batches[0])))
    ref = np.asarray(fn(unflatten_paths(deq, params), *batches[0]))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
