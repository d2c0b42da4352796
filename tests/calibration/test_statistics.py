"""Statistics: associative merges (one state equals merged partial states), oracles in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.calibration import statistics as S

STATS = {"absmax": S.absmax(), "min": S.minimum(), "max": S.maximum(), "abs_mean": S.abs_sum(), "xtx": S.xtx(),
         "n": S.count(), "nonfinite": S.nonfinite()}


def test_statistics_merge_associatively():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(40, 6)), jnp.float32)
    w = jnp.asarray(rng.uniform(size=40) * (rng.uniform(size=40) > 0.2), jnp.float32)
    for name, st in STATS.items():
        whole = S.accumulate(st, st.init(6), x, w)
        a = S.accumulate(st, st.init(6), x[:17], w[:17])
        b = S.accumulate(st, st.init(6), x[17:], w[17:])
        merged = S.merge(st, a, b)
        assert st.merge in ("max", "min", "sum")
        for u, v in zip(jax.tree.leaves(merged), jax.tree.leaves(whole)):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-5, err_msg=name)


def test_statistics_against_numpy():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 5)).astype(np.float32)
    w = (rng.uniform(size=50) > 0.3).astype(np.float32) * rng.uniform(size=50).astype(np.float32)
    xs = x[w > 0]
    fin = lambda st: st.finalize(S.accumulate(st, st.init(5), jnp.asarray(x), jnp.asarray(w)))  # noqa: E731
    np.testing.assert_allclose(fin(S.absmax()), np.abs(xs).max(0), rtol=1e-6)
    np.testing.assert_allclose(fin(S.minimum()), xs.min(0), rtol=1e-6)
    np.testing.assert_allclose(fin(S.xtx()), (x * w[:, None]).T.astype(np.float64) @ x / w.sum(), rtol=1e-4)
    np.testing.assert_allclose(fin(S.abs_sum()), (np.abs(x) * w[:, None]).sum(0) / w.sum(), rtol=1e-5)
    bad = x.copy()
    bad[3, 2] = np.nan
    assert float(S.nonfinite().partial(jnp.asarray(bad), jnp.asarray(w))) == 1.0


def test_hessian_is_twice_xtx_bit_for_bit():
    """GPTQ's Hessian statistic doubles ``xtx`` as it finalizes: exact in float32, so the same bits as doubling
    the finalized ``xtx`` afterwards (what GPTQ did before, with one K x K copy more)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(64, 24)) * np.exp(rng.normal(size=24)), jnp.float32)
    w = jnp.asarray(rng.uniform(size=64), jnp.float32)
    fin = lambda st: np.asarray(st.finalize(S.accumulate(st, st.init(24), x, w)))  # noqa: E731
    np.testing.assert_array_equal(fin(S.hessian()), 2.0 * fin(S.xtx()))


def test_channel_local_statistics_read_only_their_channel():
    """``channel_local`` is what lets eqjax.distributed skip gathering K-sharded activations."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(30, 8)), jnp.float32)
    w = jnp.asarray(rng.uniform(size=30) > 0.3, jnp.float32)
    local = {name: st for name, st in STATS.items() if st.channel_local}
    assert set(local) == {"absmax", "min", "max"}
    for name, st in local.items():
        whole = np.asarray(st.finalize(st.partial(x, w)))
        part = np.asarray(st.finalize(st.partial(x[:, 3:7], w)))
        np.testing.assert_array_equal(part, whole[3:7], err_msg=name)
