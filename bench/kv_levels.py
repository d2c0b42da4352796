"""Choose the 2-bit KV cache's non-uniform levels on the *calibration* text; writes bench/results/kv_levels.{json,md}.

The candidates are symmetric level sets ``(a, b, 1 - b, 1 - a)`` of each block's range (see
:mod:`eqjax.methods.kvquant`), plus the uniform grid ``(0, 1/3, 2/3, 1)``; every one is run with the
``kv2-outliers`` settings (keys per channel pre-RoPE in blocks of 32 tokens, values per token in groups of 32
channels, 1 % float16 outliers, the first token kept) on consecutive 1,024-token windows of the
calibration half of the Wikipedia text, never the evaluation half. The lowest perplexity is the level set
of the ``kv2-nuq`` recipe; bench/quality.py then measures that recipe on the evaluation tokens.
``--side keys|values`` varies one side's levels only, the other side at the recipe's levels
(``eqjax.recipes.registry.KV2_LEVELS``), and writes ``kv_levels_<side>.{json,md}``.

Usage: python bench/kv_levels.py [--windows 4] [--ctx 1024] [--side keys|values]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eqjax.data import token_windows, wikipedia_tokens  # noqa: E402
from eqjax.evaluate import perplexity  # noqa: E402
from eqjax.io import load_model  # noqa: E402
from eqjax.io.atomic import write_bytes  # noqa: E402
from eqjax.methods.kvquant import KVQuant  # noqa: E402

OUTER = (0.06, 0.08, 0.10, 0.12)
INNER = (0.33, 0.36, 0.39)


def candidates() -> list[tuple[float, ...]]:
    return [(0.0, 1 / 3, 2 / 3, 1.0)] + [(a, b, 1 - b, 1 - a) for a, b in itertools.product(OUTER, INNER)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--side", choices=("both", "keys", "values"), default="both")
    ap.add_argument("--out", default=None, help="output path without suffix (default bench/results/kv_levels[_side])")
    args = ap.parse_args()
    from eqjax.recipes.registry import KV2_LEVELS

    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / ("kv_levels" if args.side == "both" else f"kv_levels_{args.side}"))
    model, params, tok = load_model()
    calib, _ = wikipedia_tokens(tok)
    windows = token_windows(calib, args.ctx, args.windows)
    fp = perplexity(model, params, windows).ppl
    rows = []
    for lv in candidates():
        t0 = time.perf_counter()
        kl = KV2_LEVELS if args.side == "values" else lv
        vl = KV2_LEVELS if args.side == "keys" else lv
        kv = KVQuant(2, 2, 0.01, sink_tokens=1, key_group=32, value_group=32, key_levels=kl, value_levels=vl)
        ppl = perplexity(model, params, windows, kv_quant=kv).ppl
        rows.append({"levels": [round(v, 6) for v in lv], "ppl": ppl, "vs_fp": ppl / fp - 1, "seconds": time.perf_counter() - t0})
        print(f"{rows[-1]['levels']}: {ppl:.4f} ({100 * rows[-1]['vs_fp']:+.2f} %)", flush=True)
    best = min(rows, key=lambda r: r["ppl"])
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "text": "Wikipedia, calibration half",
            "windows": args.windows, "ctx": args.ctx, "fp_ppl": fp, "load_avg": os.getloadavg()[0],
            "side": args.side, "other_side_levels": None if args.side == "both" else list(KV2_LEVELS),
            "settings": "kv2-outliers: 2-bit keys (per channel pre-RoPE, blocks of 32) and values (per token, groups "
                        "of 32), 1 % float16 outliers, first token kept"}
    out = pathlib.Path(args.out)
    write_bytes(out.with_suffix(".json"), json.dumps({**meta, "rows": rows, "best": best}, indent=1).encode())
    varied = "both sides" if args.side == "both" else f"{args.side} only (the other side at {list(KV2_LEVELS)})"
    md = [f"{meta['date']}; {meta['text']}, {args.windows} x {args.ctx} tokens; FP {fp:.4f}; {meta['settings']}; "
          f"levels varied: {varied}.", "",
          "| levels (of each block's range) | ppl | vs FP |", "|---|---|---|"]
    md += [f"| {r['levels']}{' (uniform)' if r is rows[0] else ''}{' **best**' if r is best else ''} | {r['ppl']:.4f} | "
           f"{100 * r['vs_fp']:+.2f} % |" for r in rows]
    write_bytes(out.with_suffix(".md"), ("\n".join(md) + "\n").encode())
    print(f"best: {best['levels']} ({best['ppl']:.4f}); wrote {out}.json / .md")


if __name__ == "__main__":
    main()
