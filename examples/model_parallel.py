"""Model-parallel calibration on 8 forced CPU devices: each device holds an eighth of the weights.

Run::

    python examples/model_parallel.py                      # GPTQ W4 g128 and SmoothQuant W8A8
    python examples/model_parallel.py --recipes w4g128-awq --model 4

It starts JAX with 8 host devices (``--xla_force_host_platform_device_count=8``), builds a random
Llama of real shape ratios (GQA, SwiGLU, tied embeddings), and quantizes it twice with the same
calibration windows: on one device, and on a ``data 8/M x model M`` mesh
(:func:`eqjax.distributed.make_mesh`) inside :func:`eqjax.distributed.use_mesh`. On the mesh, every
weight lives split along its output channels over the ``model`` axis between calibration steps
(:meth:`eqjax.calibration.calibrate.Calibrator.place_params`); a block's step reads its own weights whole (XLA
gathers them for that step), GPTQ solves its output columns on the devices that hold them. It
prints the shardings, the bytes each device holds (float params at rest and the quantized result)
and whether the quantized params equal the one-device run bit for bit; the last line is JSON.

The same code runs on a GPU/TPU pod: ``make_mesh(model=M)`` over ``jax.devices()`` of every host
(``eqjax quantize --model-parallel M`` on each host, with ``--coordinator/--num-processes/--process-id``).
"""

from __future__ import annotations

import argparse
import json
import os

DEVICES = 8


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default="w4g128-gptq,w8a8-smoothquant", help="comma-separated recipe names")
    ap.add_argument("--model", type=int, default=DEVICES, help="size of the mesh's model axis (divides 8)")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={DEVICES} "
                               "--xla_cpu_collective_timeout_seconds=600 "
                               "--xla_cpu_collective_call_terminate_timeout_seconds=600")

    import jax
    import numpy as np

    from eqjax import quantize
    from eqjax.calibration.calibrate import Calibrator
    from eqjax.core.pytree import flatten_with_paths
    from eqjax.distributed import describe_mesh, device_bytes, make_mesh, use_mesh
    from eqjax.models import LlamaConfig, Model
    from eqjax.recipes.registry import get_recipe

    if jax.device_count() != DEVICES:
        raise SystemExit(f"model_parallel.py: JAX started before XLA_FLAGS was set ({jax.device_count()} devices)")
    cfg = LlamaConfig(vocab=512, hidden=256, intermediate=768, n_layers=args.layers, n_heads=8, n_kv_heads=2,
                      tie_word_embeddings=True)
    model = Model(cfg)
    params = model.init_params(jax.random.key(0), std=0.05)
    cal = np.random.default_rng(0).integers(0, cfg.vocab, (8, 64)).astype(np.int32)
    one = make_mesh(devices=jax.devices()[:1])
    mesh = make_mesh(model=args.model)
    print(f"mesh: {describe_mesh(mesh)}")

    paths, flat, _ = flatten_with_paths(params)
    total = int(sum(np.asarray(x).nbytes for x in flat))
    cal_obj = Calibrator.from_model(lambda p, t: model.apply(p, t)[0], params, [(cal[:1],)], mesh=mesh)
    at_rest = cal_obj.place_params(dict(zip(paths, flat)))
    shown = [q for q in paths if "layers_0" not in q][:2] + [q for q in paths if "layers_0" in q][:5]
    for p in shown:
        print(f"  {p:32s} {str(at_rest[p].shape):14s} {at_rest[p].sharding.spec}")
    float_bytes = device_bytes(at_rest)
    print(f"float params: {total / 2**20:.2f} MiB in all, at most {max(float_bytes.values()) / 2**20:.2f} MiB "
          f"on one device ({max(float_bytes.values()) / total:.3f} of the whole)")

    def leaves(tree) -> dict:
        return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}

    out: dict = {"devices": jax.device_count(), "mesh": dict(mesh.shape), "float_total": total,
                 "float_per_device_max": max(float_bytes.values())}
    for rec in args.recipes.split(","):
        with use_mesh(one):
            ref = leaves(quantize(params, get_recipe(rec), model=model, calibration=cal))
        with use_mesh(mesh):
            q = quantize(params, get_recipe(rec), model=model, calibration=cal)
        got = leaves(q)
        differ = [k for k in ref if ref[k].dtype != got[k].dtype or not np.array_equal(ref[k], got[k])]
        qb = device_bytes(q)
        qtotal = int(sum(x.nbytes for x in ref.values()))
        print(f"{rec}: quantized {qtotal / 2**20:.2f} MiB in all, at most {max(qb.values()) / 2**20:.2f} MiB on one "
              f"device ({max(qb.values()) / qtotal:.3f}); leaves differing from 1 device: {len(differ)} of {len(ref)}")
        out[rec] = {"leaves": len(ref), "differ": len(differ), "total": qtotal, "per_device_max": max(qb.values())}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
