"""Edge packages of SmolLM2-135M in onnxruntime (CPU): eqjax's exports beside onnxruntime-genai's own builder.

Usage::

    nice python bench/onnx.py                  # every row, one run (~20-40 min on 2 shared cores)
    python bench/onnx.py --only eqjax-fp32,ort-dynamic

Rows (all in one run, the same onnxruntime / onnxruntime-genai, the same token ids):

  eqjax-int4-gptq (level 4 / level 0)  GPTQ W4 asymmetric group 128 (act-order, 16 x 256 calibration
                  windows) + embedding / tied LM head int4 groups of 32 (RTN, asymmetric), exported with
                  ``export_package`` at MatMulNBits accuracy level 4 (``--target cpu-int8``) and 0
                  (``--target cpu``, the default)
  eqjax-int4-rot (level 4 / level 0)  ``w4g128-rot-gptq`` (the QuaRot rotation: residual folded, down_proj's
                  input rotated online, a Mul + two small MatMuls in the graph; GPTQ W4 as above) + the LM head
                  (untied by the rotation) and the embedding int4 groups of 32 (RTN)
  eqjax-w8a8      ``w8a8-smoothquant`` (W8 per channel + A8 per token, MatMulIntegerToFloat u8 x u8: exact on
                  every x86 CPU), LM head float (Gemm)
  eqjax-w7a8      ``w7a8-smoothquant+emb-int8``: SmoothQuant alpha 0.6, W7 per channel (MSE-clipped) (int8 storage within
                  +-63: the fast u8 x s8 ``MatMulIntegerToFloat``, exact on every x86 CPU) + A8 per token; the
                  embedding / tied LM head int8 per row, the head as MatMulNBits at accuracy level 4
                  (``--target cpu-int8``). Its perplexity is held against eqjax's own W8A8 (the row above)
  eqjax-w7a8-a8head  ``w7a8-smoothquant+emb-w7a8``: the same layers, the tied head W7A8 as well (int8 per-token
                  activations: one u8 x s8 product, the table stored once; faster, costs perplexity)
  eqjax-fp32      no quantization
  genai-int4 / genai-int4-kquant   ``python -m onnxruntime_genai.models.builder -p int4 -e cpu`` (defaults /
                  ``--extra_options int4_algo_config=k_quant``) on the *same* weights, written as an HF
                  directory by ``eqjax.io.hf.save_hf_checkpoint`` with eqjax's tokenizer.json. The builder
                  needs transformers >= 5 and onnx-ir: it runs in its own virtual env (``--genai-venv``,
                  made once with ``--system-site-packages`` + transformers==5.17.0 onnx-ir==1.1.0)
  ort-dynamic     ``onnxruntime.quantization.quantize_dynamic`` (QInt8 weights, MatMul) of eqjax-fp32; it
                  quantizes the LM head too (per-tensor weights and activations, u8 x s8)

Per row: file MiB (model.onnx + external data), perplexity on ``--eval-windows`` x ``--eval-len`` tokens of
the Wikipedia evaluation half (eqjax's own perplexity of the same params beside ours), prefill ms
(``--prefill`` tokens, batch 1, median of ``--reps``), decode tokens/s through the same plain loop
(:class:`eqjax.export.runtime.Runner`, cache fed back at its length, ``--decode-tokens`` steps after the
prefill) and through onnxruntime-genai's ``Generator`` (greedy, same prompt and count). Every package is
built first and kept; the timings then run in ``--rounds`` rounds interleaved over the rows (so a load
change on the shared machine hits every row alike) and the table shows each figure's median.
Writes ``bench/results/onnx.json`` and ``onnx.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this file is named onnx.py: keep its own directory off sys.path so `import onnx` finds the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

GENAI_VENV = Path("~/.cache/eqjax-genai").expanduser()
W7A8 = "w7a8-smoothquant+emb-int8"
W7A8_A8HEAD = "w7a8-smoothquant+emb-w7a8"
ROT_INT4 = "w4g128-rot-gptq+head-int4+emb-int4"
GENAI_REQS = ["transformers==5.17.0", "onnx-ir==1.1.0"]


def package_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.name.startswith("model.onnx"))


def ensure_genai_venv(root: Path) -> Path:
    py = root / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *GENAI_REQS], check=True)
    return py


def run_builder(py: Path, hf: Path, out: Path, extra: list[str]) -> float:
    t0 = time.perf_counter()
    cmd = [str(py), "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", "int4", "-e", "cpu",
           "-c", str(out.parent / "hf_cache"), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"genai builder failed: {r.stderr[-2000:]}")
    return time.perf_counter() - t0


def generator_tok_s(d: Path, prompt: np.ndarray, new: int) -> float | None:
    import onnxruntime_genai as og

    model = og.Model(str(d))
    ids = [int(i) for i in prompt]
    best = None
    for _ in range(2):  # warm-up + measured
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new, min_length=len(ids) + new, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        gen.generate_next_token()
        t0 = time.perf_counter()
        n = 0
        while not gen.is_done():
            gen.generate_next_token()
            n += 1
        best = n / (time.perf_counter() - t0) if n else None
        del gen
    return best


def quality(d: Path, windows: np.ndarray, threads: int) -> dict:
    from eqjax.export.runtime import Runner, make_session, perplexity

    r = Runner(make_session(d, threads=threads), head_dim=64)
    return {"file_mib": package_bytes(d) / 2**20, "ppl_onnxruntime": perplexity(r, windows)}


def timing(d: Path, prompt: np.ndarray, args) -> dict:
    """One round: prefill ms (median of ``--reps``), plain-loop and Generator decode tokens/s."""
    from eqjax.export.runtime import Runner, make_session

    r = Runner(make_session(d, threads=args.threads), head_dim=64)
    r.greedy(prompt[:, :32], 3)  # warm-up
    ts = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        r.logits(prompt)
        ts.append(time.perf_counter() - t0)
    _, info = r.greedy(prompt, args.decode_tokens + 1)
    del r
    return {"prefill_ms": 1e3 * statistics.median(ts), "decode_tok_s_plain": info["decode_tokens_per_s"],
            "decode_tok_s_generator": generator_tok_s(d, prompt[0], args.decode_tokens)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, interleaved over the rows (median)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--genai-venv", default=str(GENAI_VENV))
    ap.add_argument("--only", default=None, help="comma-separated subset of rows")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "onnx"))
    args = ap.parse_args(argv)

    import jax
    import onnx
    import onnxruntime as ort
    import onnxruntime_genai as og
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from eqjax.core.pytree import flatten
    from eqjax.core.qarray import ActQuantKernel
    from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
    from eqjax.evaluate import perplexity as eqjax_ppl
    from eqjax.evaluate import rounding_band
    from eqjax.export.package import export_package
    from eqjax.io.gguf import default_model_path, load_gguf, read_metadata
    from eqjax.io.hf import save_hf_checkpoint
    from eqjax.methods.gptq import GPTQ
    from eqjax.models import Model
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.registry import embedding_step, get_recipe
    from eqjax.recipes.types import Recipe

    cfg, params, tok = load_gguf()
    model = Model(cfg)
    template = read_metadata(default_model_path()).get("tokenizer.chat_template")
    cal_ids, eval_ids = wikipedia_tokens(tok)
    windows = token_windows(eval_ids, args.eval_len, args.eval_windows)
    cal = calibration_windows(cal_ids, args.calib_windows, 256, 0)
    prompt = token_windows(eval_ids, args.prefill, 1)
    only = set(args.only.split(",")) if args.only else None
    tmp = Path(tempfile.mkdtemp(prefix="eqjax_onnx_bench_"))
    load_before = os.getloadavg()
    rows: list[dict] = []

    def want(name: str) -> bool:
        return only is None or name in only

    dirs: dict[str, Path] = {}

    def log(row: dict, d: Path) -> None:
        row.update(quality(d, windows, args.threads))
        if row.get("ppl_eqjax") is not None:
            row["ppl_rel_diff"] = row["ppl_onnxruntime"] / row["ppl_eqjax"] - 1
        rows.append(row)
        dirs[row["variant"]] = d
        print(f"[onnx] {json.dumps(row)}", flush=True)

    def ours(name: str, desc: str, qp, levels) -> None:
        band = None
        if any(isinstance(v, ActQuantKernel) for _, v in flatten(qp)):
            # int8 activations: eqjax's own spread under 1..3-ulp copies of the params (rounding_band)
            band = rounding_band(model, qp, windows, batch_size=1)
        jx = band[0] if band else eqjax_ppl(model, qp, windows, batch_size=1).ppl
        for level, suffix in levels:
            d = tmp / f"{name}{suffix}"
            t0 = time.perf_counter()
            man = export_package(model, qp, d, tokenizer=tok, chat_template=template, accuracy_level=level,
                                 context_length=2048, recipe=name, check=level == 0)
            log({"variant": name + suffix, "description": desc, "accuracy_level": level,
                 "export_s": time.perf_counter() - t0, "fused": man["fused"],
                 "packed_attention": man.get("packed_attention"), "ppl_eqjax": jx,
                 "ppl_eqjax_band": None if band is None else [min(band), max(band)]}, d)

    if want("eqjax-int4-gptq"):
        t0 = time.perf_counter()
        recipe = Recipe("w4g128-gptq+emb-int4", (GPTQ(bits=4), embedding_step("int4")))
        qp = quantize(params, recipe, model=model, calibration=cal, seed=0)
        print(f"[onnx] GPTQ + embedding in {time.perf_counter() - t0:.0f}s", flush=True)
        ours("eqjax-int4-gptq", "GPTQ W4 asym g128 act-order + embedding/tied head int4 g32 asym (RTN)", qp,
             [(4, " (level 4)"), (0, " (level 0)")])
        del qp
    if want("eqjax-int4-rot"):
        from eqjax.methods.rtn import RTN
        from eqjax.recipes.rules import rule_from_dict

        # the rotation unties the head; the built-in rotated recipes keep it float: int4 g32 here, as the table
        head = RTN((rule_from_dict({"pattern": "lm_head/kernel", "bits": 4, "symmetric": False, "granularity": "group",
                                    "axis": 0, "group_size": 32, "scale_dtype": "float16"}),), name="head-int4")
        recipe = Recipe(ROT_INT4, (*get_recipe("w4g128-rot-gptq").steps, head, embedding_step("int4")))
        qp = quantize(params, recipe, model=model, calibration=cal, seed=0)
        ours("eqjax-int4-rot", f"{ROT_INT4}: QuaRot rotation (down_proj's input rotated online in the graph) + GPTQ W4 "
             "asym g128 + embedding and the untied head int4 g32", qp, [(4, " (level 4)"), (0, " (level 0)")])
        del qp
    if want("eqjax-w8a8"):
        qp = quantize(params, get_recipe("w8a8-smoothquant"), model=model, calibration=cal, seed=0)
        ours("eqjax-w8a8", "SmoothQuant alpha 0.85, W8 per channel + A8 per token (MatMulIntegerToFloat u8 x u8)", qp, [(0, "")])
        del qp
    if want("eqjax-w7a8"):
        qp = quantize(params, get_recipe(W7A8), model=model, calibration=cal, seed=0)
        ours("eqjax-w7a8", f"{W7A8}: W7 per channel + A8 per token (MatMulIntegerToFloat u8 x s8), embedding / tied "
             "head int8 per row (MatMulNBits level 4)", qp, [(4, "")])
        del qp
    if want("eqjax-w7a8-a8head"):
        qp = quantize(params, get_recipe(W7A8_A8HEAD), model=model, calibration=cal, seed=0)
        ours("eqjax-w7a8-a8head", f"{W7A8_A8HEAD}: as eqjax-w7a8, the tied head W7A8 too (u8 x s8, the table stored "
             "once)", qp, [(0, "")])
        del qp
    if want("eqjax-fp32") or want("ort-dynamic"):
        ours("eqjax-fp32", "float32", params, [(0, "")])
    if want("ort-dynamic"):
        d = tmp / "ort-dynamic"
        shutil.copytree(tmp / "eqjax-fp32", d, ignore=shutil.ignore_patterns("model.onnx*"))
        quantize_dynamic(str(tmp / "eqjax-fp32" / "model.onnx"), str(d / "model.onnx"), weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul"], use_external_data_format=True,
                         # the fused com.microsoft ops (GroupQueryAttention, ...) defeat its shape inference
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        log({"variant": "ort-dynamic", "description": "onnxruntime quantize_dynamic(QInt8 weights, MatMul) of eqjax-fp32: per-tensor int8 weights and activations, the Gemm LM head included (u8 x s8)"}, d)
    if want("genai-int4") or want("genai-int4-kquant"):
        py = ensure_genai_venv(Path(args.genai_venv))
        hf = tmp / "hf"
        save_hf_checkpoint(hf, model, params, extra_config={"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id})
        from eqjax.export.package import tokenizer_files

        for name, text in tokenizer_files(tok, chat_template=template, context_length=2048).items():
            (hf / name).write_text(text)
        # `algo_config` (0.18's name; the deprecated `int4_algo_config` alias was silently not applied here)
        for name, extra in (("genai-int4", []), ("genai-int4-kquant", ["--extra_options", "algo_config=k_quant"])):
            if not want(name):
                continue
            d = tmp / name
            secs = run_builder(py, hf, d, extra)
            log({"variant": name, "description": f"onnxruntime-genai builder -p int4 -e cpu {' '.join(extra)}".strip(),
                 "export_s": secs}, d)
    # timings: every package kept on disk, rounds interleaved over the rows (load drifts hit all rows alike)
    runs: dict[str, list[dict]] = {r["variant"]: [] for r in rows}
    for k in range(args.rounds):
        for row in rows:
            runs[row["variant"]].append(timing(dirs[row["variant"]], prompt, args))
            print(f"[onnx] round {k} {row['variant']}: {json.dumps(runs[row['variant']][-1])}", flush=True)
    for row in rows:
        rs = runs[row["variant"]]
        for key in rs[0]:
            vals = [r[key] for r in rs if r[key] is not None]
            row[key] = statistics.median(vals) if vals else None
            row[key + "_rounds"] = vals
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu": _cpu(), "cpus": os.cpu_count(), "threads": args.threads,
                    "load_before": load_before, "load_after": os.getloadavg(), "onnxruntime": ort.__version__,
                    "onnxruntime_genai": og.__version__, "jax": jax.__version__},
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to float32)",
        "eval": {"windows": args.eval_windows, "ctx": args.eval_len},
        "latency": {"prefill_tokens": args.prefill, "reps": args.reps, "decode_tokens": args.decode_tokens,
                    "rounds": args.rounds},
        "results": rows,
    }
    from eqjax.io.atomic import write_report

    print("[onnx] wrote %s and %s" % write_report(args.out, report, _markdown(report)))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def _band(b) -> str:
    return "-" if not b else f"{b[0]:.3f}..{b[1]:.3f}"


def _markdown(r) -> str:
    m = r["machine"]
    lines = [
        "# Edge packages: SmolLM2-135M in onnxruntime (CPU)", "",
        f"{r['date']}, {m['cpu']}, {m['threads']} threads, load average before / after the run "
        f"{m['load_before'][0]:.1f} / {m.get('load_after', [float('nan')])[0]:.1f} "
        f"(shared machine), onnxruntime {m['onnxruntime']}, onnxruntime-genai {m['onnxruntime_genai']}. "
        f"Perplexity on {r['eval']['windows']} x {r['eval']['ctx']} tokens of the Wikipedia evaluation half; prefill "
        f"{r['latency']['prefill_tokens']} tokens (median of {r['latency']['reps']}); decode: "
        f"{r['latency']['decode_tokens']} greedy tokens after that prefill; timings are medians of "
        f"{r['latency'].get('rounds', 1)} rounds interleaved over the rows.", "",
        "| variant | file MiB | ppl (onnxruntime) | ppl (eqjax) | diff | eqjax 1-3 ulp band | prefill ms | "
        "decode tok/s (plain loop) | decode tok/s (genai Generator) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["results"]:
        rd = "-" if x.get("ppl_eqjax") is None else f"{100 * x['ppl_rel_diff']:+.2f} %"
        lines.append(f"| {x['variant']} | {x['file_mib']:.1f} | {x['ppl_onnxruntime']:.3f} | {_f(x.get('ppl_eqjax'), '.3f')} | "
                     f"{rd} | {_band(x.get('ppl_eqjax_band'))} | {x['prefill_ms']:.0f} | {_f(x.get('decode_tok_s_plain'), '.1f')} | "
                     f"{_f(x.get('decode_tok_s_generator'), '.1f')} |")
    lines += ["", "Rows: see the docstring of bench/onnx.py. Timings on a shared 2-core machine are noisy; all rows "
              "come from the same run. The band (rows with int8 activations): eqjax's own perplexity of the same params "
              "and of copies scaled by 1 + k * 2**-23 (k = 1..3): a last-bit difference flips activation codes, so "
              "another correct implementation lands anywhere near it (eqjax.evaluate.rounding_band).", ""]
    acc = acceptance(r["results"])
    if acc:
        lines += ["| target | measured | met |", "|---|---|---|"]
        lines += [f"| {what} | {measured} | {'yes' if ok else '**no**'} |" for what, measured, ok in acc] + [""]
    return "\n".join(lines)


def acceptance(rows: list[dict]) -> list[tuple[str, str, bool]]:
    """The issue's acceptance rows that this run's rows can decide: (target, measured, met)."""
    from eqjax.evaluate import within_band

    by = {x["variant"]: x for x in rows}
    out = []
    q4, g4, gk = by.get("eqjax-int4-gptq (level 4)"), by.get("genai-int4"), by.get("genai-int4-kquant")
    if q4 and g4:
        out.append(("int4 package file <= genai int4's", f"{q4['file_mib']:.1f} vs {g4['file_mib']:.1f} MiB",
                    q4["file_mib"] <= g4["file_mib"]))
        for key, what in (("decode_tok_s_plain", "plain loop"), ("decode_tok_s_generator", "genai Generator")):
            if q4.get(key) and g4.get(key):
                out.append((f"int4 decode tok/s >= genai int4's ({what})", f"{q4[key]:.1f} vs {g4[key]:.1f}",
                            q4[key] >= g4[key]))
    if q4 and gk:
        out.append(("int4 package ppl < genai int4 k_quant's", f"{q4['ppl_onnxruntime']:.3f} vs {gk['ppl_onnxruntime']:.3f}",
                    q4["ppl_onnxruntime"] < gk["ppl_onnxruntime"]))
    w7, w8, dyn = by.get("eqjax-w7a8"), by.get("eqjax-w8a8"), by.get("ort-dynamic")
    if w7 and w8 and w8.get("ppl_eqjax"):
        d = w7["ppl_onnxruntime"] / w8["ppl_eqjax"] - 1
        out.append(("W8A8 package ppl within 1 % of eqjax's own W8A8", f"{w7['ppl_onnxruntime']:.3f} vs "
                    f"{w8['ppl_eqjax']:.3f} ({100 * d:+.2f} %)", abs(d) <= 0.01))
    if w8 and w8.get("ppl_eqjax_band"):
        lo, hi = w8["ppl_eqjax_band"]
        out.append(("W8A8 package ppl inside eqjax's rounding band (widened by its width and 0.5 %)",
                    f"{w8['ppl_onnxruntime']:.3f} vs {lo:.3f}..{hi:.3f}", within_band(w8["ppl_onnxruntime"], [lo, hi], 0.005)))
    if w7 and dyn:
        out.append(("W8A8 package prefill <= quantize_dynamic's", f"{w7['prefill_ms']:.0f} vs {dyn['prefill_ms']:.0f} ms",
                    w7["prefill_ms"] <= dyn["prefill_ms"]))
    return out


if __name__ == "__main__":
    sys.exit(main())
