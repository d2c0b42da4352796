"""eqjax's GGUF export run by llama.cpp itself: perplexity and KL divergence against the source model, and
eqjax's own perplexity of the same recipe on the same token ids with llama.cpp's scoring.

llama.cpp is not a pip dependency: build its ``llama-perplexity`` and ``llama-tokenize`` from source
(``cmake -B build -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DLLAMA_CURL=OFF && cmake --build build --target
llama-perplexity llama-tokenize``) and pass ``--llama-bin build/bin``.

For each recipe: ``eqjax export-gguf`` writes the file; ``llama-perplexity`` measures it on the first
``--tokens`` tokens of the Wikipedia evaluation half (decoded to text, which llama.cpp tokenizes again:
its ids are checked equal to eqjax's) in chunks of ``--ctx``, scoring the second half of each chunk (its
protocol), with ``--kl-divergence`` against the source GGUF's logits; eqjax evaluates its own quantized
model on the same chunks with the same scoring. The source GGUF (Q4_1, which eqjax dequantizes exactly)
is the float row.

Writes bench/results/gguf_llamacpp.{json,md}.

Usage: python bench/gguf_llamacpp.py --llama-bin /path/to/llama.cpp/build/bin [--recipes a,b] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _run(cmd: list[str], stdout_only: bool = False) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stderr or proc.stdout)[-2000:]}")
    return proc.stdout if stdout_only else proc.stdout + proc.stderr


def llama_ids(bin_dir: pathlib.Path, gguf: str, text: pathlib.Path) -> list[int]:
    out = _run([str(bin_dir / "llama-tokenize"), "-m", gguf, "-f", str(text), "--ids", "--log-disable",
                "--no-bos"], stdout_only=True)
    return [int(t) for t in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def llama_perplexity(bin_dir: pathlib.Path, gguf: str, text: pathlib.Path, ctx: int, chunks: int, kld: pathlib.Path,
                     base: bool, threads: int) -> dict:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", gguf, "-f", str(text), "-c", str(ctx), "-b", str(ctx),
           "-t", str(threads), "--chunks", str(chunks), "--kl-divergence-base", str(kld)]
    if not base:
        cmd.append("--kl-divergence")
    t0 = time.perf_counter()
    out = _run(cmd)
    row: dict = {"llama_seconds": time.perf_counter() - t0}
    if base:
        m = re.search(r"Final estimate: PPL = ([\d.]+)", out)
        row["ppl_llama"] = float(m.group(1))
    else:
        m = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", out)
        row["ppl_llama"] = float(m.group(1))
        for key, pat in (("kld_mean", r"Mean\s+KLD:\s*([-\d.]+)"), ("same_top_pct", r"Same top p:\s*([\d.]+)")):
            m = re.search(pat, out)
            row[key] = float(m.group(1)) if m else None
    return row


def eqjax_perplexity(model, params, ids, ctx: int, chunks: int) -> float:
    """llama.cpp's protocol: chunks of ``ctx`` tokens, no BOS (SmolLM2's add_bos_token is false), the
    predictions of positions ctx/2 .. ctx-2 (the next token of each), averaged over all chunks."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    first = ctx // 2
    win = np.asarray(ids[: chunks * ctx], np.int32).reshape(chunks, ctx)
    fwd = jax.jit(lambda p, t: jax.nn.log_softmax(model.apply(p, t)[0].astype(jnp.float32), -1))
    nll = []
    for w in win:
        lp = np.asarray(fwd(params, jnp.asarray(w[None])))[0]
        nll.append(-lp[np.arange(first, ctx - 1), w[first + 1:]])
    return float(np.exp(np.mean(np.concatenate(nll).astype(np.float64))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", required=True, help="llama.cpp build/bin holding llama-perplexity and llama-tokenize")
    ap.add_argument("--recipes", default="w4g128-rtn+emb-int8,w4g128-rtn-sym+emb-int8")
    ap.add_argument("--tokens", type=int, default=8192, help="evaluation tokens (whole chunks of --ctx)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "gguf_llamacpp.json"))
    args = ap.parse_args()
    bin_dir = pathlib.Path(args.llama_bin)
    for exe in ("llama-perplexity", "llama-tokenize"):
        if not (bin_dir / exe).is_file():
            print(f"error: {exe} not found in --llama-bin {bin_dir}", file=sys.stderr)
            return 2
    if args.tokens < args.ctx:
        print(f"error: --tokens {args.tokens} is less than one --ctx {args.ctx} chunk", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from eqjax.data import wikipedia_tokens
    from eqjax.io import load_model
    from eqjax.io.atomic import write_json, write_text
    from eqjax.io.gguf import default_model_path
    from eqjax.protocol import checked_quantize
    from eqjax.recipes.registry import get_recipe

    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes:
        get_recipe(r)  # an unknown recipe fails here, before any work
    chunks = args.tokens // args.ctx
    model, params, tok = load_model(None)
    src = str(default_model_path())
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        ids = [int(t) for t in wikipedia_tokens(tok)[1][: chunks * args.ctx]]
        text = d / "eval.txt"
        text.write_text(tok.decode(ids), encoding="utf-8")
        lids = llama_ids(bin_dir, src, text)
        same_ids = lids[: len(ids)] == ids
        if not same_ids:
            print("warning: llama.cpp tokenizes the text differently from eqjax; eqjax uses llama.cpp's ids")
        ids = lids
        kld = d / "base.kld"
        rows = [{"recipe": "source GGUF (Q4_1; eqjax's float model)", "file_mib": os.path.getsize(src) / 2**20,
                 **llama_perplexity(bin_dir, src, text, args.ctx, chunks, kld, True, args.threads),
                 "ppl_eqjax": eqjax_perplexity(model, params, ids, args.ctx, chunks)}]
        print(rows[-1], flush=True)
        for r in recipes:
            gguf = d / f"{r}.gguf"
            _run([sys.executable, "-m", "eqjax.cli", "export-gguf", "--recipe", r, "--out", str(gguf)])
            q = checked_quantize(params, get_recipe(r), model=model)
            rows.append({"recipe": r, "file_mib": gguf.stat().st_size / 2**20,
                         **llama_perplexity(bin_dir, str(gguf), text, args.ctx, chunks, kld, False, args.threads),
                         "ppl_eqjax": eqjax_perplexity(model, q, ids, args.ctx, chunks)})
            print(rows[-1], flush=True)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "tokens": chunks * args.ctx, "ctx": args.ctx,
            "predictions": chunks * (args.ctx - 1 - args.ctx // 2), "threads": args.threads,
            "same_ids_as_eqjax": same_ids, "load_start": load0, "load_end": os.getloadavg()[0],
            "llama_cpp": "; ".join(ln.strip() for ln in _run([str(bin_dir / "llama-perplexity"), "--version"]).splitlines()
                                   if ln.startswith(("version", "built")))}
    out = pathlib.Path(args.out)
    write_json(out, {"meta": meta, "rows": rows})
    lines = [f"# eqjax's GGUF in llama.cpp ({meta['llama_cpp']})", "",
             f"{meta['date']}, {meta['threads']} threads, load {load0:.1f} -> {meta['load_end']:.1f}. First "
             f"{meta['tokens']} tokens of the Wikipedia evaluation half in chunks of {args.ctx}, the second half of "
             f"each chunk scored ({meta['predictions']} predictions; llama.cpp's `llama-perplexity` protocol, and "
             f"eqjax's on the same ids: llama.cpp's tokenization {'equals' if same_ids else 'differs from'} eqjax's). "
             "KLD: llama.cpp's `--kl-divergence` against the source GGUF's logits.", "",
             "| recipe | file MiB | ppl llama.cpp | ppl eqjax (same chunks) | diff | mean KLD (llama.cpp) | same top token % |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = "—" if r.get("kld_mean") is None else f"{r['kld_mean']:.4f}"
        top = "—" if r.get("same_top_pct") is None else f"{r['same_top_pct']:.2f}"
        lines.append(f"| {r['recipe']} | {r['file_mib']:.1f} | {r['ppl_llama']:.3f} | {r['ppl_eqjax']:.3f} | "
                     f"{100 * (r['ppl_llama'] / r['ppl_eqjax'] - 1):+.2f} % | {kl} | {top} |")
    write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
