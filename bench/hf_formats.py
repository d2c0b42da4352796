"""compressed-tensors checkpoints (the HF quantized format): eqjax writes them and reads them, transformers reads
eqjax's, eqjax reads the compressed-tensors package's own; every perplexity on the same token ids.

Writes ``bench/results/hf_formats.{json,md}``. On SmolLM2-135M (eqjax's default model), for each recipe:

1. eqjax's perplexity of the quantized params in memory;
2. the compressed-tensors directory eqjax writes (as ``eqjax quantize --format compressed-tensors``: the tokenizer
   of the GGUF model, file dtype ``--dtypes``, default bfloat16 and float32), its bytes;
3. eqjax's perplexity after :func:`eqjax.io.compressed_tensors.load_compressed_tensors` of that directory;
4. transformers' perplexity of that directory (``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)``)
   on the same windows, scored as :func:`eqjax.evaluate.perplexity` scores (every window from position 0,
   ``ctx - 1`` predictions each, float32 per-window sums added in float64). Where transformers cannot load the
   directory (transformers 4.57 with compressed-tensors 0.20 refuses packed zero points, i.e. asymmetric group
   or channel pack-quantized weights: "size mismatch for weight_zero_point"), its error is recorded and the
   perplexity is measured through the format's own decompressor instead: a float ``LlamaForCausalLM`` built
   from the directory's config (without ``quantization_config``) holding the weights that the package's
   compressor (``BaseCompressor.load_from_registry(format).decompress``) returns, scales upcast to float32
   (as a float32 load holds them), the float tensors as stored. Each row names its loader.
5. the differences of (3) and (4) to (1), in percent.

Peer checkpoints: SmolLM2 written as an HF float directory (:func:`eqjax.io.hf.save_hf_checkpoint`, float32,
from the GGUF-loaded params), quantized by the compressed-tensors package itself (min/max round-to-nearest
scales from its ``calculate_qparams``, its ``ModelCompressor``; the helper of
``tests/io/test_compressed_tensors.py``): W4A16 symmetric with groups of 64 (SmolLM2's 576 inputs are not a
multiple of 128, which the package requires) and W8A8 (int8 per-channel weights, dynamic per-token int8
activations); transformers' and eqjax's perplexities of each. The float directory itself is scored by both too.

Usage: python bench/hf_formats.py [--eval-windows 4] [--eval-len 1024] [--calib-windows 16] [--calib-len 512]
       [--only r1,r2] [--dtypes bfloat16,float32] [--skip-peers] [--work DIR] [--out-name hf_formats]
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
# bench/ (the script's directory) holds an onnx.py that would shadow the onnx package eqjax.cli imports
sys.path[:] = [str(ROOT)] + [x for x in sys.path if pathlib.Path(x or ".").resolve() != ROOT / "bench"]

import eqjax  # noqa: E402
from eqjax.cli.formats import _tokenizer  # noqa: E402  (what `eqjax quantize --format compressed-tensors` writes)
from eqjax.core.pytree import tree_nbytes  # noqa: E402
from eqjax.evaluate import perplexity, rounding_band  # noqa: E402
from eqjax.io.atomic import write_json, write_text  # noqa: E402
from eqjax.io.compressed_tensors import load_compressed_tensors, save_compressed_tensors  # noqa: E402
from eqjax.io.hf import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from eqjax.protocol import prepare  # noqa: E402

sys.path.append(str(ROOT / "bench"))
from layouts import cpu_model, protocol_parser  # noqa: E402

RECIPES = ["w4g128-gptq", "w4g128-gptq-sym", "w4g128-awq", "w8a8-smoothquant"]
TRANSFORMERS = "transformers AutoModelForCausalLM"
DECOMPRESSOR = "compressed-tensors decompressor -> float LlamaForCausalLM"
PEERS = {
    "W4A16 sym g64 (package RTN)": ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                     "group_size": 64}, None),
    "W8A8 int8 channel / token (package RTN)": (
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
}
TARGET_PCT = 0.5
PEER_TARGET_PCT = 0.1


def dir_bytes(d: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def rel_pct(a: float, b: float) -> float:
    return 100.0 * (a / b - 1.0)


def torch_ppl(m, windows: np.ndarray) -> float:
    """Perplexity of a torch causal LM on ``windows``, scored as :func:`eqjax.evaluate.window_nll` and
    :func:`eqjax.evaluate.perplexity` do: each window from position 0 (no BOS), logits ``[:, :-1]`` against ids
    ``[:, 1:]`` in float32, per-window sums added in float64, ``n * (ctx - 1)`` predictions."""
    import torch

    sums = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor(w[None], dtype=torch.long)
            logp = torch.log_softmax(m(ids).logits[:, :-1].float(), dim=-1)
            nll = -torch.gather(logp, -1, ids[:, 1:, None])[..., 0]
            sums.append(float(nll.sum(-1)[0]))
    total = float(np.sum(np.asarray(sums, np.float64)))
    ppl = float(np.exp(total / (windows.shape[0] * (windows.shape[1] - 1))))
    if not np.isfinite(ppl):
        raise SystemExit(f"non-finite transformers perplexity {ppl}")
    return ppl


def decompressed_llama(d: pathlib.Path):
    """A float ``LlamaForCausalLM`` from ``d``'s config (without ``quantization_config``) holding the weights the
    compressed-tensors package's compressor decompresses (scales upcast to float32), float tensors as stored."""
    import torch
    import transformers
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    cfg.pop("torch_dtype", None), cfg.pop("dtype", None)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).float().eval()
    tensors = load_file(d / "model.safetensors")
    stems = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")})
    state = {k: v.float() for k, v in tensors.items() if k.rsplit(".", 1)[0] not in stems}
    for stem in stems:
        groups = [g for g in qc["config_groups"].values() if stem in g["targets"] or "Linear" in g["targets"]]
        group = groups[0]
        scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"})
        compressor = BaseCompressor.load_from_registry(group.get("format") or qc["format"])
        part = {k[len(stem) + 1:]: v for k, v in tensors.items() if k.startswith(stem + ".")}
        part["weight_scale"] = part["weight_scale"].float()
        state[stem + ".weight"] = compressor.decompress(part, scheme)["weight"].float()
    missing, unexpected = m.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"decompressed state of {d}: missing {missing}, unexpected {unexpected}")
    if "lm_head.weight" in missing:
        if not m.config.tie_word_embeddings:
            raise SystemExit(f"{d}: no lm_head.weight and untied embeddings")
        m.tie_weights()
    return m.to(torch.float32)


def hf_ppl(d: pathlib.Path, windows: np.ndarray) -> dict:
    """transformers' perplexity of the directory ``d``; the decompressor path where transformers refuses it."""
    import torch
    import transformers

    t0 = time.perf_counter()
    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        loader, error = TRANSFORMERS, None
    except Exception as e:  # noqa: BLE001  (recorded: the point is which loader reads what)
        error = f"{type(e).__name__}: " + " ".join(str(e).split())[:300]
        m, loader = decompressed_llama(d), DECOMPRESSOR
    ppl = torch_ppl(m, windows)
    del m
    return {"ppl": ppl, "loader": loader, "transformers_error": error, "seconds": time.perf_counter() - t0}


def eq_ppl(model, params, windows: np.ndarray) -> float:
    return perplexity(model, params, windows).ppl


def run_recipe(recipe: str, setup, dtypes: list[str], work: pathlib.Path, tok_files, tok_ids) -> dict:
    windows = setup.eval_windows
    t0 = time.perf_counter()
    q = eqjax.quantize(setup.params, recipe, model=setup.model, calibration=setup.calib_windows, seed=0)
    quantize_s = time.perf_counter() - t0
    row = {"recipe": recipe, "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_avg": os.getloadavg()[0],
           "quantize_s": quantize_s, "qparams_bytes": int(tree_nbytes(q)), "ppl_eqjax_memory": eq_ppl(setup.model, q, windows),
           "files": {}}
    print(json.dumps({k: v for k, v in row.items() if k != "files"}), flush=True)
    for dtype in dtypes:
        d = work / f"{recipe}-{dtype}"
        info = save_compressed_tensors(d, setup.model, q, dtype=dtype, files=tok_files, extra_config=tok_ids,
                                       overwrite=True)
        m2, p2 = load_compressed_tensors(d)
        ppl_loaded = eq_ppl(m2, p2, windows)
        del p2
        hf = hf_ppl(d, windows)
        base = row["ppl_eqjax_memory"]
        f = {"dir_bytes": dir_bytes(d), "safetensors_bytes": (d / "model.safetensors").stat().st_size,
             "formats": sorted({s["format"] for s in info["schemes"].values()}),
             "symmetric": sorted({s["weights"]["symmetric"] for s in info["schemes"].values()}),
             "group_sizes": sorted({s["weights"]["group_size"] or 0 for s in info["schemes"].values()}),
             "regrouped": len(info["regrouped"]), "ppl_eqjax_loaded": ppl_loaded, "ppl_hf": hf["ppl"],
             "hf_loader": hf["loader"], "transformers_error": hf["transformers_error"], "hf_seconds": hf["seconds"],
             "diff_loaded_pct": rel_pct(ppl_loaded, base), "diff_hf_pct": rel_pct(hf["ppl"], base)}
        row["files"][dtype] = f
        print(json.dumps({"recipe": recipe, "dtype": dtype, **f}), flush=True)
        shutil.rmtree(d, ignore_errors=True)
    return row


def run_peers(setup, work: pathlib.Path) -> tuple[dict, list[dict]]:
    sys.path.insert(0, str(ROOT / "tests" / "io"))
    from test_compressed_tensors import _peer_checkpoint  # the tests' helper: the package's own min/max RTN

    windows = setup.eval_windows
    fp = work / "fp-float32"
    save_hf_checkpoint(fp, setup.model, setup.params, dtype="float32")
    fm, fparams = load_hf_checkpoint(fp)
    hf = hf_ppl(fp, windows)
    fp_row = {"ppl_eqjax_memory": eq_ppl(setup.model, setup.params, windows), "ppl_eqjax_hf_dir": eq_ppl(fm, fparams, windows),
              "ppl_hf": hf["ppl"], "hf_loader": hf["loader"], "dir_bytes": dir_bytes(fp)}
    del fparams
    print(json.dumps({"fp": fp_row}), flush=True)
    rows = []
    for name, (weights, acts) in PEERS.items():
        d = work / ("peer-" + name.split()[0].lower())
        t0 = time.perf_counter()
        _peer_checkpoint(fp, d, weights, acts)
        make_s = time.perf_counter() - t0
        m2, p2 = load_compressed_tensors(d)
        ppl_e = eq_ppl(m2, p2, windows)
        # int8 activations: eqjax's own spread under 1..3-ulp copies of the params, the noise any other correct
        # implementation of the same model shows against eqjax on these windows
        band = rounding_band(m2, p2, windows)[1:] if acts else None
        del p2
        hf = hf_ppl(d, windows)
        qc = json.loads((d / "config.json").read_text())["quantization_config"]
        rows.append({"peer": name, "weights": weights, "input_activations": acts, "format": qc.get("format"),
                     "make_s": make_s, "dir_bytes": dir_bytes(d), "ppl_hf": hf["ppl"], "hf_loader": hf["loader"],
                     "transformers_error": hf["transformers_error"], "ppl_eqjax": ppl_e,
                     "diff_eqjax_vs_hf_pct": rel_pct(ppl_e, hf["ppl"]), "ulp_band_ppl": band,
                     "ulp_band_pct": None if band is None else max(abs(rel_pct(b, ppl_e)) for b in band),
                     "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(d, ignore_errors=True)
    return fp_row, rows


def markdown(d: dict) -> str:
    m = d["meta"]
    lines = ["# compressed-tensors checkpoints: eqjax vs transformers", "",
             f"Protocol: {m['protocol']}. Targets: |diff| <= {TARGET_PCT} % (eqjax-written), <= {PEER_TARGET_PCT} % "
             "(peer-made).", "",
             "| recipe | file dtype | ppl eqjax (memory) | ppl eqjax (loaded dir) | diff | ppl HF side | diff | HF loader "
             "| dir MB | eqjax params MB | quantize s |", "|---|---|--:|--:|--:|--:|--:|---|--:|--:|--:|"]
    for r in d["rows"]:
        for dt, f in r["files"].items():
            lines.append(f"| {r['recipe']} | {dt} | {r['ppl_eqjax_memory']:.3f} | {f['ppl_eqjax_loaded']:.3f} | "
                         f"{f['diff_loaded_pct']:+.3f} % | {f['ppl_hf']:.3f} | {f['diff_hf_pct']:+.3f} % | {f['hf_loader']} | "
                         f"{f['dir_bytes'] / 1e6:.1f} | {r['qparams_bytes'] / 1e6:.1f} | {r['quantize_s']:.0f} |")
    errors = {f["transformers_error"] for r in d["rows"] for f in r["files"].values() if f["transformers_error"]}
    for e in sorted(errors):
        lines += ["", f"transformers' error where it could not load: `{e}`"]
    if d.get("fp"):
        f = d["fp"]
        lines += ["", f"Float SmolLM2 (HF float32 directory from the GGUF params): eqjax in memory {f['ppl_eqjax_memory']:.3f}, "
                  f"eqjax from the directory {f['ppl_eqjax_hf_dir']:.3f}, transformers {f['ppl_hf']:.3f}."]
    if d.get("peers"):
        lines += ["", "| peer checkpoint (compressed-tensors package) | format | ppl transformers | ppl eqjax | diff | "
                  "eqjax 1-3 ulp band | dir MB |", "|---|---|--:|--:|--:|--:|--:|"]
        lines += [f"| {p['peer']} | {p['format']} | {p['ppl_hf']:.3f} | {p['ppl_eqjax']:.3f} | "
                  f"{p['diff_eqjax_vs_hf_pct']:+.3f} % | "
                  + ("-" if p.get("ulp_band_pct") is None else f"+-{p['ulp_band_pct']:.3f} %")
                  + f" | {p['dir_bytes'] / 1e6:.1f} |" for p in d["peers"]]
    lines += ["", f"Run {m['when']}, {m['cpu']}, {m['cpus']} CPUs, load average {m['load_avg_start']:.1f} -> "
              f"{m['load_avg_end']:.1f}; jax {m['versions']['jax']}, transformers {m['versions']['transformers']}, "
              f"compressed-tensors {m['versions']['compressed_tensors']}, torch {m['versions']['torch']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = protocol_parser(__doc__)
    ap.add_argument("--only", default=None, help="comma-separated recipes (default: all four)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="file dtypes written (default bfloat16,float32)")
    ap.add_argument("--skip-peers", action="store_true", help="no peer-made checkpoints")
    ap.add_argument("--peers-only", action="store_true", help="the peer-made checkpoints only (no eqjax recipe)")
    ap.add_argument("--work", default=None, help="directory for the checkpoints (default a temporary one, removed)")
    ap.add_argument("--out-name", default="hf_formats", help="bench/results/<name>.{json,md}")
    args = ap.parse_args()

    import compressed_tensors
    import jax
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    load0 = os.getloadavg()[0]
    setup = prepare(None, None, ctx=args.ctx, eval_tokens=args.eval_windows * args.ctx,
                    calib_windows=args.calib_windows, calib_ctx=args.calib_ctx, seed=0)
    tok_files, copy_from, tok_ids = _tokenizer(None, setup.tokenizer, setup.model.config)
    assert copy_from is None
    work = pathlib.Path(args.work) if args.work else pathlib.Path(tempfile.mkdtemp(prefix="eqjax-hf-formats-"))
    work.mkdir(parents=True, exist_ok=True)
    dtypes = args.dtypes.split(",")
    rows: list[dict] = []
    fp_row, peers = None, []

    def save() -> None:  # after every measurement: a run cut short keeps what it measured
        p = setup.protocol
        meta = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "date": datetime.date.today().isoformat(),
                "machine": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count(),
                "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
                "versions": {"jax": jax.__version__, "transformers": transformers.__version__,
                             "compressed_tensors": compressed_tensors.__version__, "torch": torch.__version__,
                             "eqjax": getattr(eqjax, "__version__", "?")},
                "protocol": f"SmolLM2-135M-Instruct (GGUF, dequantized to float32), {p['eval_windows']} x {p['ctx']} "
                            f"evaluation tokens (Wikipedia evaluation split, no BOS, {p['predictions']} predictions), "
                            f"{p['calib_windows']} x {p['calib_ctx']} calibration tokens (seed {p['seed']})",
                "protocol_fields": p, "target_pct": TARGET_PCT, "peer_target_pct": PEER_TARGET_PCT,
                "hf_side": {TRANSFORMERS: "AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)",
                            DECOMPRESSOR: "transformers could not load the directory: float LlamaForCausalLM from its "
                                          "config (no quantization_config) + the compressed-tensors package's "
                                          "compressor decompress() of each quantized linear (scales upcast to float32)"},
                "command": "python bench/hf_formats.py" + "".join(f" {a}" for a in sys.argv[1:])}
        out = ROOT / "bench" / "results"
        d = {"meta": meta, "rows": rows, "fp": fp_row, "peers": peers}
        write_json(out / f"{args.out_name}.json", d)
        write_text(out / f"{args.out_name}.md", markdown(d))

    try:
        if not args.skip_peers:
            fp_row, peers = run_peers(setup, work)
            save()
        for r in [] if args.peers_only else args.only.split(",") if args.only else RECIPES:
            rows.append(run_recipe(r, setup, dtypes, work, tok_files, tok_ids))
            save()
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
