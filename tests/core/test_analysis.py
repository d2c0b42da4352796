"""Roles and canonical matrices: weights found by what the model does with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.analysis import activation_matrix, analyze, from_weight_matrix, matrix_to_slice, slice_to_matrix, weight_matrix
from eqjax.core.interpret import run
from eqjax.core.program import trace
from eqjax.core.pytree import flatten_with_paths
from eqjax.core.qdot import assemble_output
from tests import zoo


@pytest.fixture(scope="module")
def models():
    return zoo.all_models()


def _roles(models, name):
    fn, params, batches = models[name]
    an = analyze(trace(fn, params, batches[0]))
    return an, {k: sorted(p for p, r in an.roles.items() if r.kind == k) for k in ("matmul", "embedding", "other")}


def test_roles_linen(models):
    an, r = _roles(models, "linen")
    assert r["embedding"] == ["embed/embedding"]
    assert "head/kernel" in r["matmul"]  # a top-level Dense is found too
    assert "block_0/qkv/kernel" in r["matmul"] and "block_1/out/kernel" in r["matmul"]  # 4-D and 3-D kernels
    assert all(p.endswith(("scale", "bias")) for p in r["other"])
    out = an.uses_of("block_0/out/kernel")[0]
    assert out.contracting == (0, 1) and out.free == (2,)  # [h, hd, d] contracted over (h, hd)


def test_roles_nnx_weight_as_lhs(models):
    an, r = _roles(models, "nnx")
    u = an.uses_of("blocks/0/qkv/kernel")[0]
    assert u.side == 0 and u.contracting == (1,) and u.free == (0, 2, 3)
    assert r["embedding"] == ["embed/embedding"] and "head/kernel" in r["matmul"]


def test_roles_hf_gpt2_transposed_conv1d(models):
    an, r = _roles(models, "hf-gpt2")
    u = an.uses_of("transformer/h/0/attn/c_attn/kernel")[0]
    assert u.contracting == (1,) and u.free == (0,)  # stored [out, in], transposed in the graph
    assert r["embedding"] == sorted(["transformer/wpe/embedding", "transformer/wte/embedding"])


@pytest.mark.parametrize("name", ["linen", "nnx", "hf-gpt2", "eqjax-llama"])
def test_canonical_matrices_reproduce_every_dot(models, name):
    """activation_matrix(x) @ weight_matrix(w), laid out by assemble_output, equals the model's dot."""
    fn, params, batches = models[name]
    prog = trace(fn, params, batches[0])
    an = analyze(prog)
    paths, leaves, _ = flatten_with_paths(params)
    pm = dict(zip(paths, leaves))
    checked = []

    def hook(use, x, w, default):
        y = default(x, w)
        y2 = jnp.matmul(activation_matrix(x, use), weight_matrix(w, use), precision="highest")
        got = assemble_output(y2, use, prog.nodes[use.node], prog, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(y), rtol=1e-5, atol=1e-5, err_msg=use.path)
        checked.append(use.path)
        return y

    run(prog, an, dict(zip(prog.args, batches[0])), pm, dot_hook=hook)
    assert len(checked) == len(an.uses)


def test_matrix_round_trips_including_stacked():
    def fn(p, x):
        y, _ = jax.lax.scan(lambda c, w: (jnp.einsum("bi,oi->bo", c, w), None), x, p["w"])
        return y

    p = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 5)), jnp.float32)}
    an = analyze(trace(fn, p, (jnp.ones((2, 5)),)))
    for u in an.uses_of("w"):
        w2 = weight_matrix(p["w"], u)
        assert w2.shape == (5, 5)
        np.testing.assert_array_equal(np.asarray(w2), np.asarray(p["w"][dict(u.index)[0]]).T)
        back = from_weight_matrix(w2 * 2, u, p["w"])
        i = dict(u.index)[0]
        np.testing.assert_array_equal(np.asarray(back[i]), np.asarray(p["w"][i]) * 2)
        np.testing.assert_array_equal(np.asarray(slice_to_matrix(matrix_to_slice(w2, u), u)), np.asarray(w2))
