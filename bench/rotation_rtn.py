"""Why plain RTN W4 loses with the residual rotation: an ablation; writes bench/results/rotation_rtn.{json,md}.

The rotation (QuaRot-style, :mod:`eqjax.methods.rotation`) must first fold each RMSNorm scale ``g`` into
the weights that read the normalized stream (``W -> diag(g) W``: q/k/v, gate/up), then rotate. This
script separates the two on SmolLM2, plain RTN W4 g128 asymmetric, perplexity on the first
``--eval-windows`` windows of 1024 tokens of the Wikipedia evaluation half:

* ``original``: the float model as loaded;
* ``norms folded``: the same float function with the norm scales folded into q/k/v and gate/up and set to
  1 (no rotation), so RTN quantizes ``diag(g) W``;
* ``weights + 5 % noise``: Gaussian noise of 5 % of each decoder kernel's standard deviation added (seed
  7), which moves the weights off the 4-bit Q4_1 grid the checkpoint was stored on.

Each base then runs float, ``w4g128-rtn`` and ``w4g128-rot-rtn`` (fold + rotation + RTN). With
``--search``, the activation-weighted grid search (``w4g128-rtn-search``) runs too, with and without the
rotation (``--calib-windows`` windows of 512 tokens, seed 0).

Usage: python bench/rotation_rtn.py [--eval-windows 6] [--search] [--calib-windows 16]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NOISE = 0.05


def fold_norm_scales(params: dict, n_layers: int) -> dict:
    """``params`` (eqjax's Llama tree) with each layer's attn / mlp norm scale folded into the kernels that
    read it and set to 1: the same float function."""
    import jax.numpy as jnp

    out = {k: v for k, v in params.items()}
    for i in range(n_layers):
        layer = {k: dict(v) for k, v in params[f"layers_{i}"].items()}
        for norm, part, names in (("attn_norm", "attn", ("q_proj", "k_proj", "v_proj")),
                                  ("mlp_norm", "mlp", ("gate_proj", "up_proj"))):
            g = layer[norm]["scale"]
            for n in names:
                layer[part][n] = dict(layer[part][n], kernel=layer[part][n]["kernel"] * g[:, None])
            layer[norm] = dict(layer[norm], scale=jnp.ones_like(g))
        out[f"layers_{i}"] = layer
    return out


def add_noise(params: dict, rel: float, seed: int = 7) -> dict:
    """Decoder kernels plus Gaussian noise of ``rel`` times each kernel's standard deviation."""
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(jax.random.key(seed), 4096))

    def f(path, x):
        p = jax.tree_util.keystr(path)
        if "layers_" in p and "kernel" in p:
            return x + rel * jnp.std(x) * jax.random.normal(next(keys), x.shape, x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(f, params)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-windows", type=int, default=6, help="evaluation windows of 1024 tokens")
    ap.add_argument("--search", action="store_true", help="also the activation-weighted grid search rows")
    ap.add_argument("--calib-windows", type=int, default=16, help="calibration windows of 512 tokens (--search)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rotation_rtn"))
    args = ap.parse_args(argv)
    if args.eval_windows < 1 or args.calib_windows < 1:
        ap.error("--eval-windows and --calib-windows must be >= 1")

    from eqjax.data import calibration_windows, wikipedia_tokens
    from eqjax.evaluate import perplexity
    from eqjax.io.atomic import write_report
    from eqjax.io.gguf import load_gguf
    from eqjax.methods.rotation import Rotation
    from eqjax.models import Model
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.registry import get_recipe
    from eqjax.recipes.types import Recipe

    cfg, params, tok = load_gguf()
    model = Model(cfg)
    cal_ids, ev = wikipedia_tokens(tok)
    n = args.eval_windows * 1024
    if len(ev) < n:
        ap.error(f"--eval-windows: the evaluation half holds {len(ev) // 1024} windows of 1024 tokens")
    windows = ev[:n].reshape(args.eval_windows, 1024).astype("int32")
    cal = calibration_windows(cal_ids, args.calib_windows, 512, 0) if args.search else None
    recipes = {"float": None, "w4g128-rtn": get_recipe("w4g128-rtn"), "w4g128-rot-rtn": get_recipe("w4g128-rot-rtn")}
    if args.search:
        search = get_recipe("w4g128-rtn-search")
        recipes["w4g128-rtn-search"] = search
        recipes["rotation + w4g128-rtn-search"] = Recipe("rot-rtn-search", (Rotation(then=search.steps),),
                                                          "Rotation + W4 g128 RTN on searched grids")
    bases = {"original": params, "norms folded": fold_norm_scales(params, cfg.n_layers),
             f"weights + {NOISE:.0%} noise": add_noise(params, NOISE)}
    rows, load0, t0 = [], os.getloadavg(), time.perf_counter()
    for base, p in bases.items():
        for name, recipe in recipes.items():
            if base != "original" and "search" in name:
                continue
            qp = p if recipe is None else quantize(p, recipe, model=model, calibration=cal, seed=0)
            ppl = float(perplexity(model, qp, windows).ppl)
            rows.append({"base": base, "recipe": name, "ppl": ppl})
            print(f"[rotation_rtn] {base:>22s}  {name:30s} {ppl:8.3f}", flush=True)
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "eval_tokens": n, "noise": NOISE,
              "calib_windows": args.calib_windows if args.search else 0, "seconds": time.perf_counter() - t0,
              "load_before": load0, "load_after": os.getloadavg(), "rows": rows}
    print("[rotation_rtn] wrote %s and %s" % write_report(args.out, report, markdown(report)))
    return 0


def markdown(r: dict) -> str:
    names = list(dict.fromkeys(x["recipe"] for x in r["rows"]))
    bases = list(dict.fromkeys(x["base"] for x in r["rows"]))
    ppl = {(x["base"], x["recipe"]): x["ppl"] for x in r["rows"]}
    lines = ["# Plain RTN W4 and the rotation: the norm-scale fold alone (SmolLM2)", "",
             f"{r['date']}, perplexity on {r['eval_tokens']} tokens (windows of 1024, the Wikipedia evaluation half), "
             f"load average before / after {r['load_before'][0]:.1f} / {r['load_after'][0]:.1f}"
             + (f"; grid search calibrated on {r['calib_windows']} x 512 tokens" if r["calib_windows"] else "") + ".",
             "", "| base | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for b in bases:
        lines.append(f"| {b} | " + " | ".join(f"{ppl[b, n]:.3f}" if (b, n) in ppl else "-" for n in names) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
