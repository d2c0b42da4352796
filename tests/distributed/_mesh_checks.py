"""Calibration and evaluation on a 4-device mesh vs the 1-device mesh; run by test_mesh.py in a
subprocess (XLA must see ``--xla_force_host_platform_device_count=4`` before JAX starts).

Prints one JSON line: per recipe, how many quantized leaves differ from the 1-device run and the
largest absolute difference; the two perplexities; X^T X from the Calibrator on 4 devices
(``ordered`` and ``collective`` reductions) against a float64 numpy oracle. With
``--model-parallel=M``: also the quantized params on a ``data 4/M x model M`` mesh and the most
bytes of them any one device holds.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
# on a loaded 2-core machine a device thread can reach a collective late: wait longer than XLA's 40 s default
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 --xla_cpu_collective_call_terminate_timeout_seconds=600 "
                           "--xla_cpu_collective_timeout_seconds=600")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from eqjax.api import quantize  # noqa: E402
from eqjax.calibration.calibrate import Calibrator  # noqa: E402
from eqjax.calibration.statistics import xtx  # noqa: E402
from eqjax.core.analysis import activation_matrix  # noqa: E402
from eqjax.core.pytree import flatten_with_paths  # noqa: E402
from eqjax.distributed import device_bytes, make_mesh, use_mesh  # noqa: E402
from eqjax.evaluate import perplexity  # noqa: E402
from eqjax.models import LlamaConfig, Model  # noqa: E402
from eqjax.recipes.registry import get_recipe  # noqa: E402


def leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def compare(a: dict, b: dict) -> dict:
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    diff = [k for k in a if a[k].dtype != b[k].dtype or not np.array_equal(a[k], b[k])]
    worst = max((float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a), default=0.0)
    return {"leaves": len(a), "differ": len(diff), "max_abs": worst}


def main() -> None:
    recipes = sys.argv[1].split(",")
    cfg = LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=2, n_heads=4, n_kv_heads=2)
    model = Model(cfg)
    params = model.init_params(jax.random.key(0), std=0.1)
    rng = np.random.default_rng(0)
    cal = rng.integers(0, 64, (6, 16)).astype(np.int32)  # 6 batches on 4 devices: a padded last step
    ev = rng.integers(0, 64, (7, 16)).astype(np.int32)
    one, four = make_mesh(devices=jax.devices()[:1]), make_mesh()
    refs: dict = {}
    out: dict = {"devices": jax.device_count(), "mesh": dict(four.shape)}
    for rec in recipes:
        res = {}
        for name, mesh in (("one", one), ("four", four)):
            with use_mesh(mesh):
                res[name] = leaves(quantize(params, get_recipe(rec), model=model, calibration=cal))
        out[rec] = compare(res["one"], res["four"])
        refs[rec] = res["one"]
    mp = [int(a.split("=")[1]) for a in sys.argv if a.startswith("--model-parallel=")]
    if mp:  # weights split along their output channels over the model axis
        out["model_mesh"] = dict(make_mesh(model=mp[0]).shape)
        for rec in recipes:
            with use_mesh(make_mesh(model=mp[0])):
                q = quantize(params, get_recipe(rec), model=model, calibration=cal)
            ref = refs[rec]
            out[f"{rec}@model"] = compare(ref, leaves(q))
            per_dev = device_bytes(q)
            out[f"{rec}@model:bytes"] = {"total": int(sum(np.asarray(x).nbytes for x in ref.values())),
                                          "per_device_max": max(per_dev.values())}
    out["ppl_one"] = perplexity(model, params, ev, batch_size=1, mesh=one).ppl
    out["ppl_four"] = perplexity(model, params, ev, batch_size=1, mesh=four).ppl

    # X^T X of every block's inputs vs a float64 oracle built from the same captured activations
    fn = lambda p, t: model.apply(p, t)[0]  # noqa: E731
    batches = [(cal[i:i + 1],) for i in range(cal.shape[0])]
    oracle, got = {}, {}
    for how in ("ordered", "collective"):
        c = Calibrator.from_model(fn, params, batches, mesh=four, reduction=how)
        got[how] = {}

        def per_block(bc, p, how=how):
            st = bc.statistics({"xtx": xtx()})
            for u in bc.uses:
                got[how][u.path] = np.asarray(st[u.path]["xtx"], np.float64)
                if how == "ordered" and u.path not in oracle:
                    xs = []
                    for ins in bc.inputs():
                        xs.append(np.asarray(_capture(bc, u, ins), np.float64))
                    x = np.concatenate(xs)
                    oracle[u.path] = x.T @ x / x.shape[0]
            return p

        paths, flat, _ = flatten_with_paths(params)
        c.run_blocks(dict(zip(paths, flat)), per_block)
    rel = {}
    for how in got:
        rel[how] = max(float(np.max(np.abs(got[how][k] - oracle[k])) / max(1e-30, np.max(np.abs(oracle[k]))))
                       for k in oracle)
    out["xtx_paths"] = len(oracle)
    out["xtx_rel_err"] = rel
    print(json.dumps(out))


def _capture(bc, use, ins):
    """Activation matrix of ``use`` for one batch: the input of its dot, via a dot hook."""
    seen = []

    def hook(u, x, w, default):
        if u.node == use.node:
            seen.append(activation_matrix(x, u))
        return default(x, w)

    # on one device: eager ops on arrays spread over the 4 forced devices can stall XLA CPU's
    # collective rendezvous (seen under load); the oracle only needs the activations' values
    host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    bc.function(hook)(host(bc.cal._params_for(bc.block, bc.params)), host(ins))
    return seen[0]


if __name__ == "__main__":
    main()
