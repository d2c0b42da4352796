"""Where a quantized model's evaluation memory goes: the compiled forward's temporary buffers against the
decoder's float32 weights; writes bench/results/eval_memory.{json,md}.

A W4 g128 Llama of random weights (width 1024, MLP 4096, vocabulary 1024: 64 MiB of float32 weights per
block) is compiled for one 128-token window with 1, 2, 4 and 8 blocks, whole and block at a time;
``compiled.memory_analysis()`` gives each program's temporary bytes. No model is run and nothing depends on the weights' values: compilation
only, for the CPU this runs on.

Usage: python bench/eval_memory.py [--layers 1,2,4,8]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from eqjax.evaluate import by_block_scorer  # noqa: E402
from eqjax.io.atomic import write_report  # noqa: E402
from eqjax.models import LlamaConfig, Model  # noqa: E402
from eqjax.recipes.apply import quantize  # noqa: E402

MIB = 2**20


def measure(n_layers: int) -> dict:
    cfg = LlamaConfig(vocab=1024, hidden=1024, intermediate=4096, n_layers=n_layers, n_heads=8, n_kv_heads=8)
    model = Model(cfg)
    q = quantize(model.init_params(jax.random.key(0), std=0.02), "w4g128-rtn", model=model)
    compiled = jax.jit(lambda p, x: model.apply(p, x)[0]).lower(q, jnp.zeros((1, 128), jnp.int32)).compile()
    ma = compiled.memory_analysis()
    per_block = (4 * cfg.hidden**2 + 3 * cfg.hidden * cfg.intermediate) * 4
    score = by_block_scorer(model, q, (1, 128))
    by_block = max(c.memory_analysis().temp_size_in_bytes for c in score.programs)
    return {"blocks": n_layers, "temp_mib": ma.temp_size_in_bytes / MIB, "arguments_mib": ma.argument_size_in_bytes / MIB,
            "float32_block_weights_mib": n_layers * per_block / MIB, "by_block_temp_mib": by_block / MIB}


def markdown(rep: dict) -> str:
    lines = ["# Evaluation memory of a quantized model", "", rep["note"], "",
             "| blocks | temporary MiB | block at a time: largest program's temporary MiB | quantized arguments MiB "
             "| float32 decoder weights MiB |", "|---|---|---|---|---|"]
    lines += [f"| {r['blocks']} | {r['temp_mib']:.1f} | {r['by_block_temp_mib']:.1f} | {r['arguments_mib']:.1f} | "
              f"{r['float32_block_weights_mib']:.1f} |" for r in rep["rows"]]
    return "\n".join(lines) + f"\n\nMachine: {rep['machine']}; jax {rep['jax']}.\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,2,4,8")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "eval_memory"))
    args = ap.parse_args(argv)
    rows = [measure(int(n)) for n in args.layers.split(",")]
    rep = {"rows": rows, "jax": jax.__version__, "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} CPUs, backend {jax.default_backend()}",
           "note": "W4 g128 random-weight Llama blocks (width 1024, MLP 4096), one 128-token window, compiled only. "
                   "The temporary bytes track the float32 weights of every block: XLA schedules each weight's "
                   "dequantization (it depends on nothing else) at the start of the program, so the whole "
                   "decoder is held in float32 at once. Block at a time (`eqjax eval --by-block`, "
                   "`perplexity(..., by_block=True)`): the embedding, each block and the head are programs of their "
                   "own, run one after another; the largest one's temporary bytes are one block's float32 weights, "
                   "whatever the number of blocks."}
    print("[eval_memory] wrote %s and %s" % write_report(args.out, rep, markdown(rep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
