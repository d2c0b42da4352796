"""A tiny eqjax Llama, W3 RTN, trained with ``eqjax.qat.train`` (12 steps, saves every 4): the digest of the
trained params, for the kill-and-resume test (run in-process and as ``main`` in a subprocess)."""

from __future__ import annotations

import hashlib
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np

import eqjax.qat as qat
from eqjax.methods.qat import default_optimizer
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize


def digest(ckpt: str | None, kill_at: int) -> str:
    """SHA-256 of the trained params' leaves; the process kills itself (SIGKILL) after step ``kill_at``."""
    model = Model(LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=2, n_heads=4, n_kv_heads=2))
    params = model.init_params(jax.random.key(0), std=0.2)
    toks = np.asarray(jax.random.randint(jax.random.key(1), (6, 16), 0, 64, dtype=jnp.int32))
    q = quantize(params, "w3g128-rtn", model=model)
    data = [(toks[i:i + 2],) for i in range(0, 6, 2)]

    def on_step(t: int, loss: float) -> None:
        if t == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    out = qat.train(model, q, teacher=params, data=data, steps=12, checkpoint=ckpt, save_every=4, on_step=on_step,
                    optimizer=default_optimizer(12, lr_scale=1e-3, lr_weight=1e-3))
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(out):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def main(ckpt: str, kill_at: int) -> None:
    print("DIGEST", digest(None if ckpt == "-" else ckpt, kill_at))
