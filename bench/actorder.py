"""A peer's activation-ordered GPTQ checkpoint read by eqjax; writes bench/results/hf_actorder.{json,md}.

llm-compressor 0.6.0 (the last release whose compressed-tensors, 0.10, still writes a group index; in an env of its
own with the transformers of its release, 4.52.4, bench/peers.py's ``llmcompressor-0.6``) runs GPTQ
with ``actorder: group`` on SmolLM2-135M (the peers' protocol of bench/peers.py: the same float checkpoint and
token ids), 4-bit groups of 64 (SmolLM2's 576 inputs are not a multiple of 128), and saves the compressed
directory (``save_pretrained(save_compressed=True)``: pack-quantized weights with a permuted
``weight_g_idx``). Its perplexity is measured twice on the same 32 x 1024 evaluation ids: by transformers on
the directory loaded back in the peer's own env (the peer's torch forward), and by eqjax on the directory read
by :func:`eqjax.io.compressed_tensors.load_compressed_tensors` (its activation-ordered weights as
``PermutedKernel`` s). Target: within 0.1 %.

Usage: python bench/actorder.py [--calib-windows 32] [--asym] [--group 64] [--timeout 7200] [--work DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [x for x in sys.path if pathlib.Path(x or ".").resolve() != ROOT / "bench"]
sys.path.append(str(ROOT / "bench"))

from peers import CACHE, ensure_venv, machine, prepare, run_peer, venv_versions  # noqa: E402

import eqjax  # noqa: E402
from eqjax.core.pytree import flatten, tree_nbytes  # noqa: E402
from eqjax.core.qarray import PermutedKernel, is_quantized  # noqa: E402
from eqjax.evaluate import perplexity  # noqa: E402
from eqjax.io.atomic import write_json, write_text  # noqa: E402
from eqjax.io.compressed_tensors import load_compressed_tensors  # noqa: E402

OUT = ROOT / "bench" / "results" / "hf_actorder"
VENV = "llmcompressor-0.6"
TARGET_PCT = 0.1


def markdown(d: dict) -> str:
    r = d["row"]
    lines = ["# A peer's activation-ordered GPTQ checkpoint read by eqjax", "",
             f"Protocol: {d['protocol']}. Target: |diff| <= {TARGET_PCT} %.", "",
             "| peer checkpoint | weights | g_idx permuted | ppl peer (transformers) | ppl eqjax | diff | quantize s |",
             "|---|---|--:|--:|--:|--:|--:|"]
    if "error" in r:
        lines.append(f"| {r['name']} | - | - | - | - | - | - |")
        lines += ["", f"Failed: `{r['error']}`"]
    else:
        lines.append(f"| {r['name']} | {r['weights']} | {r['permuted_weights']} of {r['quantized_weights']} | "
                     f"{r['ppl_peer']:.3f} | {r['ppl_eqjax']:.3f} | {r['diff_pct']:+.3f} % | {r['quantize_seconds']:.0f} |")
    mach = d["machine"]
    lines += ["", f"Run {d['when']} on {mach['cpu']}, {mach['cores']} CPUs (the peer with 1 thread); peer env: {', '.join(f'{k} {v}' for k, v in d['peer_versions'].items())}; "
              f"eqjax with jax {d['jax']}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib-windows", type=int, default=32, help="calibration windows of 512 tokens for GPTQ")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--asym", action="store_true", help="asymmetric weights (default symmetric)")
    ap.add_argument("--timeout", type=float, default=7200.0)
    ap.add_argument("--work", default=None, help="where the checkpoint is saved (default a temporary directory)")
    args = ap.parse_args()

    import jax

    cache = CACHE / "data"
    meta = prepare(cache)
    py, why = ensure_venv(CACHE, VENV)
    sym = not args.asym
    name = f"llmc06-gptq-w4g{args.group}-{'sym' if sym else 'asym'}-actorder-group"
    work = pathlib.Path(args.work) if args.work else pathlib.Path(tempfile.mkdtemp(prefix="eqjax-actorder-"))
    save_dir = work / name
    cfg = {"peer": "llmcompressor", "venv": VENV, "bits": 4, "group": args.group, "sym": sym, "iters": 0,
           "actorder": "group", "calib_windows": args.calib_windows, "calib": f"{args.calib_windows} x 512",
           "save_dir": str(save_dir)}
    row: dict = {"name": name, "config": cfg}
    if py is None:
        row["error"] = why
    else:
        print(f"{name} ...", flush=True)
        peer = run_peer(name, cfg, py, cache, args.timeout, 1)
        if "error" in peer:
            row["error"] = peer["error"]
        else:
            model, params = load_compressed_tensors(save_dir)
            kinds = [leaf for _, leaf in flatten(params) if is_quantized(leaf)]
            windows = np.load(cache / "eval.npy")
            t0 = time.perf_counter()
            ppl = perplexity(model, params, windows).ppl
            row.update(weights=f"int4 {'sym' if sym else 'asym'} g{args.group}", ppl_peer=peer["ppl"], ppl_eqjax=ppl,
                       diff_pct=100.0 * (ppl / peer["ppl"] - 1.0), quantize_seconds=peer.get("quantize_seconds"),
                       eval_seconds_eqjax=time.perf_counter() - t0, eqjax_params_bytes=tree_nbytes(params),
                       quantized_weights=len(kinds),
                       permuted_weights=sum(isinstance(k, PermutedKernel) for k in kinds),
                       peer_row={k: v for k, v in peer.items() if k not in ("traceback",)})
    d = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "jax": jax.__version__,
         "eqjax": getattr(eqjax, "__version__", "?"), "peer_versions": venv_versions(py) if py else {},
         "protocol": meta.get("protocol", "bench/peers.py's") + f"; GPTQ on the first {args.calib_windows} calibration windows",
         "ids_sha256": meta.get("ids_sha256"), "target_pct": TARGET_PCT, "row": row}
    write_json(OUT.with_suffix(".json"), d)
    write_text(OUT.with_suffix(".md"), markdown(d))
    print(json.dumps(row, indent=1, default=str))
    return 0 if "error" not in row else 1


if __name__ == "__main__":
    sys.exit(main())
