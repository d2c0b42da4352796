import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.calibration.ema import ema_absmax, scale_from_state


def test_ema_first_step_then_smooths():
    t = ema_absmax(decay=0.5)
    s = t.init()
    s = t.update(s, jnp.asarray([1.0, -4.0]))
    assert float(s.absmax) == 4.0
    s = t.update(s, jnp.asarray([2.0]))
    assert float(s.absmax) == 3.0 and int(s.count) == 2
    assert float(scale_from_state(s)) == pytest.approx(3.0 / 127)


def test_ema_is_jittable_and_never_zero_scale():
    t = ema_absmax(0.9)
    s = jax.jit(t.update)(t.init(), jnp.zeros(4))
    assert float(scale_from_state(s)) > 0


def test_ema_syncs_replicas_with_pmax():
    t = ema_absmax(0.9, axis_name="d")
    x = jnp.arange(jax.device_count() * 2, dtype=jnp.float32).reshape(jax.device_count(), 2)
    out = jax.pmap(t.update, axis_name="d", in_axes=(None, 0))(t.init(), x)
    np.testing.assert_array_equal(np.asarray(out.absmax), float(x.max()))


def test_bad_decay():
    with pytest.raises(ValueError):
        ema_absmax(1.0)
