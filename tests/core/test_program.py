"""Tracing any callable into a flat program: evaluation equals the original call for every model
kind; call-like sub-jaxprs are inlined, param scans unrolled, literal conds resolved."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.analysis import analyze
from eqjax.core.interpret import evaluate
from eqjax.core.program import ProgramError, trace
from eqjax.core.pytree import flatten_with_paths
from tests import zoo


def _eval(fn, params, args):
    prog = trace(fn, params, args)
    paths, leaves, _ = flatten_with_paths(params)
    return prog, jax.jit(lambda pm, a: evaluate(prog, analyze(prog), pm, a))(dict(zip(paths, leaves)), list(args))


@pytest.fixture(scope="module")
def models():
    return zoo.all_models()


@pytest.mark.parametrize("name", ["linen", "nnx", "hf-llama", "hf-gpt2", "eqjax-llama", "eqjax-gpt2"])
def test_program_evaluates_like_the_model(models, name):
    fn, params, batches = models[name]
    prog, out = _eval(fn, params, batches[0])
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(params, *batches[0])), rtol=1e-5, atol=1e-5)
    assert not any(n.name in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call") for n in prog.nodes)


def test_control_flow_is_inlined_or_kept():
    @jax.custom_vjp
    def twice(x):
        return 2 * x

    twice.defvjp(lambda x: (2 * x, None), lambda r, g: (2 * g,))

    def fn(p, x):
        y = jax.nn.relu(x @ p["w"])  # custom_jvp
        y = jax.checkpoint(lambda t: jnp.sin(t) @ p["w"])(y)  # remat
        y = twice(jax.jit(lambda t: t @ p["w"])(y))  # custom_vjp + jit
        y, _ = jax.lax.scan(lambda c, w: (c @ w, None), y, p["stack"])  # scan over stacked params
        y = jax.lax.cond(True, lambda: y @ p["w"], lambda: y)  # literal predicate
        y = jax.lax.fori_loop(0, 2, lambda i, c: c * 0.5, y)  # a while without params
        return y

    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32), "stack": jnp.asarray(rng.normal(size=(3, 4, 4)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)
    prog, out = _eval(fn, p, (x,))
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(p, x)), rtol=1e-5)
    an = analyze(prog)
    stack_uses = an.uses_of("stack")
    assert sorted(dict(u.view.index)[0] for u in stack_uses) == [0, 1, 2]  # unrolled: one use per slice
    assert len(an.uses_of("w")) == 4 and an.roles["w"].kind == "matmul"
    assert not prog.opaque


def test_params_inside_a_while_are_reported_opaque():
    def fn(p, x):  # a data-dependent while (a static fori_loop becomes a scan, which is unrolled)
        return jax.lax.while_loop(lambda c: jnp.sum(c) < 100.0, lambda c: c @ p["w"] + 1.0, x)

    p = {"w": jnp.eye(3)}
    prog = trace(fn, p, (jnp.ones((1, 3)),))
    assert prog.opaque
    assert analyze(prog).roles["w"].kind == "other"


def test_trace_errors_name_the_model():
    def bad(p, x):
        return p["missing"] @ x

    with pytest.raises(ProgramError, match="tracing the call failed"):
        trace(bad, {"w": jnp.ones((2, 2))}, (jnp.ones((2,)),), what="mymodel")


def test_static_and_dynamic_arguments():
    def fn(p, x, *, scale, flag=False):
        return (x @ p["w"]) * scale if flag else x @ p["w"]

    p = {"w": jnp.ones((3, 2))}
    prog = trace(fn, p, (jnp.ones((1, 3)),), {"scale": jnp.float32(2.0), "flag": True})
    assert len(prog.args) == 2  # x and the array kwarg; flag is static
