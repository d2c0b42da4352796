"""Independent numpy oracles for the Pallas kernel tests (CPU interpret tests and GPU tests alike)."""

import jax.numpy as jnp
import numpy as np


def np_quantize(x, qmax=127, scale=None):
    """Independent oracle of the documented arithmetic, in numpy float32: ``s = absmax * fl(1/qmax)``,
    ``q = clip(np.round(x * fl(1/s)))`` (np.round rounds half to even)."""
    xf = np.asarray(jnp.asarray(x, jnp.float32))
    one = np.float32(1)
    if scale is None:
        amax = np.max(np.abs(xf), axis=1)
        s = np.where(amax > 0, amax * (one / np.float32(qmax)), one).astype(np.float32)
    else:
        s = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (xf.shape[0],))
    q = np.clip(np.round(xf * (one / s)[:, None]), -qmax, qmax).astype(np.int64)
    return q, s
