"""Third-party Flax models quantized by eqjax vs eqjax's own model: the same recipe, the same windows.

Writes ``bench/results/flax_models.{json,md}``. For each recipe, eqjax quantizes (a) Hugging Face's
``FlaxLlamaForCausalLM`` holding SmolLM2-135M's weights, through ``eqjax.quantize_model`` and the
model's own ``module.apply``, and (b) eqjax's own Llama with the same weights, through
``eqjax.quantize``; both are evaluated on the same windows with the same calibration windows.

Two facts shape the protocol, both stated in the table:

* HF's Flax Llama hard-codes RoPE base 10000 (``create_sinusoidal_positions``); SmolLM2 was trained
  with 100000. Both sides therefore run SmolLM2's weights with base 10000 (their float logits agree to
  ~1e-4; the FP perplexity is higher than the real model's).
* HF's Flax Llama has no tied LM head: the embedding is copied into ``lm_head``. eqjax's tied head
  is an embedding table (kept float by every built-in recipe), so on the HF side the recipes exclude
  ``lm_head`` by name (a user rule), keeping the two quantized models the same.

GPT-2 rows: no GPT-2 checkpoint can be had offline; ``FlaxGPT2LMHeadModel`` and eqjax's GPT-2 share
one random initialization (so the perplexity is near the vocabulary size: only the agreement means
something).

Usage: python bench/flax_models.py [--eval-windows 4] [--eval-len 1024] [--calib-windows 16] [--only a,b]
       [--skip-smollm2] [--skip-gpt2] [--merge] [--order-check gptq-recipe,...]

``--order-check R`` quantizes eqjax's own model with recipe ``R`` twice, the second time with the same
calibration windows in reverse order (the same tokens, so the statistics differ only by float summation
order), and reports both perplexities: the spread a float-level difference alone causes in that method.

``--merge`` keeps the rows already in ``flax_models.json`` that this run does not measure (rows are
keyed by model and recipe); every row records when it was measured and the load average at its start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES = ["fp", "w8", "w8a8-smoothquant", "w4g128-rtn", "w4g128-gptq", "w4g128-awq"]


def exclude(recipe, pattern: str):
    """The recipe with params matching ``pattern`` kept in float by every step."""
    from eqjax.methods.rtn import RTN
    from eqjax.recipes.rules import Rule
    from eqjax.recipes.types import Recipe

    steps = []
    for s in recipe.steps:
        if isinstance(s, RTN):
            s = dataclasses.replace(s, rules=(Rule(pattern, None),) + s.rules)
        elif hasattr(s, "pattern"):
            s = dataclasses.replace(s, pattern=f"(?!{pattern}$).*")
        steps.append(s)
    return Recipe(recipe.name, tuple(steps), recipe.description, recipe.kv)


def nll_ppl(logits_fn, windows: np.ndarray, batch: int = 1) -> float:
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        w = jnp.asarray(windows[i:i + batch])
        lg = logits_fn(w).astype(jnp.float32)
        lp = jax.nn.log_softmax(lg[:, :-1], -1)
        tok = jnp.take_along_axis(lp, w[:, 1:, None], -1)[..., 0]
        total += float(-jnp.sum(tok))
        n += int(tok.size)
    ppl = float(np.exp(total / n))
    if not np.isfinite(ppl):
        raise SystemExit(f"non-finite perplexity {ppl}")
    return ppl


def run_pair(name, model, params, hf_model, hf_params, recipe, windows, calib, *, exclude_pattern=None, qparams_out=None):
    import eqjax

    when, load = time.strftime("%Y-%m-%dT%H:%M:%S"), os.getloadavg()[0]
    hf_args = lambda w: (w, jnp.ones_like(w), jnp.broadcast_to(jnp.arange(w.shape[1]), w.shape))  # noqa: E731
    t0 = time.perf_counter()
    q = params if not recipe.steps else eqjax.quantize(params, recipe, model=model, calibration=calib)
    t_e = time.perf_counter() - t0
    if qparams_out is not None:
        qparams_out.append(q)  # eqjax's own quantized params, for a caller's further checks
    f_e = jax.jit(lambda p, w: model.apply(p, w)[0])
    ppl_e = nll_ppl(lambda w: f_e(q, w), windows)
    t0 = time.perf_counter()
    hf_recipe = recipe if exclude_pattern is None else exclude(recipe, exclude_pattern)
    if recipe.steps:
        qm, hq = eqjax.quantize_model(hf_model, hf_recipe, params=hf_params,
                                      calibration=[hf_args(jnp.asarray(calib[i:i + 8])) for i in range(0, len(calib), 8)])
        t_h = time.perf_counter() - t0
        run = lambda w: qm.apply({"params": hq}, *hf_args(w)).logits  # noqa: E731
    else:
        t_h = 0.0
        run = jax.jit(lambda w: hf_model.module.apply({"params": hf_params}, *hf_args(w)).logits)
    ppl_h = nll_ppl(run, windows)
    return {"when": when, "load_avg": load, "model": name, "recipe": recipe.name, "ppl_eqjax_model": ppl_e, "ppl_hf_flax": ppl_h,
            "rel_diff_pct": 100.0 * (ppl_h - ppl_e) / ppl_e, "quantize_s_eqjax": t_e, "quantize_s_hf": t_h}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--eval-len", "--ctx", dest="ctx", type=int, default=1024)
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--calib-len", "--calib-ctx", dest="calib_ctx", type=int, default=512)
    ap.add_argument("--only", default=None)
    ap.add_argument("--skip-gpt2", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--order-check", default=None)
    args = ap.parse_args()
    from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
    from eqjax.io import load_model
    from eqjax.io.flax_hf import to_hf_flax
    from eqjax.models import GPT2Config, Model
    from eqjax.recipes.registry import get_recipe

    recipes = args.only.split(",") if args.only else RECIPES
    model, params, tok = load_model()
    model = Model(dataclasses.replace(model.config, rope_theta=10000.0))  # what HF's Flax Llama computes
    hf_model, hf_params = to_hf_flax(model, params)
    cal_ids, ev_ids = wikipedia_tokens(tok)
    windows = token_windows(ev_ids, args.ctx, args.eval_windows)
    calib = calibration_windows(cal_ids, args.calib_windows, args.calib_ctx, 0)
    rows = []
    load0 = os.getloadavg()[0]
    for r in ([] if args.skip_smollm2 else recipes):
        row = run_pair("SmolLM2-135M (RoPE base 1e4)", model, params, hf_model, hf_params, get_recipe(r), windows,
                       calib, exclude_pattern="lm_head/kernel")
        rows.append(row)
        print(json.dumps(row), flush=True)
    for r in (args.order_check.split(",") if args.order_check else []):
        import eqjax

        when, load = time.strftime("%Y-%m-%dT%H:%M:%S"), os.getloadavg()[0]
        f_e = jax.jit(lambda p, w: model.apply(p, w)[0])
        ppl = []
        for c in (calib, calib[::-1]):
            q = eqjax.quantize(params, get_recipe(r), model=model, calibration=c)
            ppl.append(nll_ppl(lambda w: f_e(q, w), windows))  # noqa: B023 - used at once
        row = {"when": when, "load_avg": load, "model": "SmolLM2-135M (RoPE base 1e4), order check", "recipe": r,
               "ppl_eqjax_model": ppl[0], "ppl_reversed_calibration": ppl[1],
               "rel_diff_pct": 100.0 * (ppl[1] - ppl[0]) / ppl[0]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.skip_gpt2:
        g = Model(GPT2Config(vocab=model.config.vocab, hidden=256, n_layers=4, n_heads=4, n_positions=args.ctx))
        gp = g.init_params(jax.random.key(0), std=0.02)
        ghf, ghp = to_hf_flax(g, gp)
        for r in recipes:
            row = run_pair("GPT-2 4x256 (random init)", g, gp, ghf, ghp, get_recipe(r), windows, calib)
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.platform(), "cpus": os.cpu_count(),
        "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
        "protocol": f"{args.eval_windows} x {args.ctx} evaluation tokens (Wikipedia evaluation split, no BOS), "
                    f"{args.calib_windows} x {args.calib_ctx} calibration tokens (seed 0)",
    }
    out = ROOT / "bench" / "results"
    from eqjax.io.atomic import write_json, write_text

    if args.merge and (out / "flax_models.json").exists():
        mine = {(r["model"], r["recipe"]) for r in rows}
        order = [(m, r) for m in ("SmolLM2", "GPT-2") for r in RECIPES]
        key = lambda r: next((i for i, (m, n) in enumerate(order) if r["model"].startswith(m) and r["recipe"] == n), 99)  # noqa: E731
        kept = [r for r in json.loads((out / "flax_models.json").read_text())["rows"] if (r["model"], r["recipe"]) not in mine]
        rows = sorted(kept + rows, key=key)

    write_json(out / "flax_models.json", {"meta": meta, "rows": rows})
    lines = ["| model | recipe | ppl, eqjax's model | ppl, HF Flax model via quantize_model | diff | quantize s (eqjax / HF) "
             "| measured (load avg) |", "|---|---|---|---|---|---|---|"]
    for r in [r for r in rows if "ppl_hf_flax" in r]:
        lines.append(f"| {r['model']} | {r['recipe']} | {r['ppl_eqjax_model']:.3f} | {r['ppl_hf_flax']:.3f} | "
                     f"{r['rel_diff_pct']:+.3f} % | {r['quantize_s_eqjax']:.0f} / {r['quantize_s_hf']:.0f} | "
                     f"{r.get('when') or '?'} ({'?' if r.get('load_avg') is None else format(r['load_avg'], '.1f')}) |")
    checks = [r for r in rows if "ppl_reversed_calibration" in r]
    if checks:
        lines += ["", "Spread from float summation order alone (eqjax's own model, the same calibration windows in "
                  "reverse order):", "", "| recipe | ppl | ppl, reversed calibration order | diff | measured (load avg) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['recipe']} | {r['ppl_eqjax_model']:.3f} | {r['ppl_reversed_calibration']:.3f} | "
                  f"{r['rel_diff_pct']:+.3f} % | {r['when']} ({r['load_avg']:.1f}) |" for r in checks]
    lines.append("")
    lines.append(f"Last run {meta['when']}, {meta['machine']}, {meta['cpus']} CPUs, load average {load0:.1f} -> "
                 f"{meta['load_avg_end']:.1f}. Timings are comparable only between rows measured at a similar load. Protocol: {meta['protocol']}. See the module docstring for the "
                 "RoPE base and the LM head.")
    write_text(out / "flax_models.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
