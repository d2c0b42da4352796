"""One peer configuration, run inside a peer virtual env (see bench/peers.py); never imports eqjax.

    python bench/peers_worker.py --data DIR --config JSON --out ROW.json

``DIR`` holds ``hf/`` (the FP checkpoint written by eqjax: config.json, model.safetensors,
tokenizer.json), ``eval.npy`` (int32 [32, 1024]) and ``calib.npy`` (int32 [128, 512]). The worker
quantizes with the peer, evaluates perplexity on exactly ``eval.npy`` in torch float32 (ppl =
exp(mean NLL of the windows' next-token predictions), no BOS) and writes one JSON row.

Quantized weights are always evaluated as float (dequantized / fake-quantized) tensors, so no int4
CPU kernel is involved; the row's ``quantized`` field is *measured* on the evaluated model: a linear
(or the embedding) counts as quantized when every group of ``group`` input columns holds at most
``2**bits`` distinct values.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time
import traceback

# the script's own folder (bench/, with kernels.py, onnx.py ...) must not shadow the peers' imports
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _threads() -> int:
    import torch

    n = int(os.environ.get("PEERS_THREADS", "1"))
    torch.set_num_threads(n)
    return torch.get_num_threads()


def load_fp(data: pathlib.Path):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(data / "hf"), torch_dtype=torch.float32)
    model.eval()
    return model


def tokenizer(data: pathlib.Path):
    from transformers import PreTrainedTokenizerFast

    # no pad token on purpose: peers must not mask any calibration id as padding
    return PreTrainedTokenizerFast(tokenizer_file=str(data / "hf" / "tokenizer.json"))


def perplexity(model, windows) -> tuple[float, float, int]:
    """(ppl, mean nll, predictions) over int [n, ctx] windows, one window at a time, float32."""
    import math

    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for row in windows:
            ids = torch.as_tensor(row, dtype=torch.long)[None]
            logits = model(input_ids=ids).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            total += float(nll)
            count += ids.shape[1] - 1
    mean = total / count
    return math.exp(mean), mean, count


def inspect_quantized(model, bits: int, group: int) -> dict:
    """Which weights hold at most 2**bits distinct values in every group of ``group`` input columns."""
    import torch

    levels = 2**bits
    linear_q, linear_f = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            (linear_q if _is_grouped(mod.weight.detach(), levels, group) else linear_f).append(name)
    emb = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    tied = head.data_ptr() == emb.data_ptr()
    return {
        "linear_quantized": len(linear_q),
        "linear_float": [n for n in linear_f],
        "lm_head_quantized": "lm_head" in linear_q,
        "embedding_quantized": _is_grouped(emb, levels, group),
        "tied_embedding": bool(tied),
    }


def _is_grouped(w, levels: int, group: int) -> bool:
    import torch

    w = w.float()
    rows, cols = w.shape
    for start in range(0, cols, group):  # a trailing partial group (576 = 4 x 128 + 64) is its own group
        g = w[:, start : start + group]
        s, _ = torch.sort(g, dim=1)
        distinct = 1 + (s[:, 1:] != s[:, :-1]).sum(dim=1)
        if int(distinct.max()) > levels:
            return False
    return True


# ------------------------------------------------------------------------------------------- peers
def rtn_torch(model, bits: int, group: int, sym: bool) -> None:
    """Plain round-to-nearest of every decoder linear (not lm_head / embedding), in place."""
    import torch

    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        w = mod.weight.data
        out = torch.empty_like(w)
        for start in range(0, w.shape[1], group):
            g = w[:, start : start + group]
            if sym:
                qmax = 2 ** (bits - 1) - 1
                scale = (g.abs().amax(dim=1, keepdim=True) / qmax).clamp(min=1e-10)
                q = torch.clamp(torch.round(g / scale), -qmax - 1, qmax)
                out[:, start : start + group] = q * scale
            else:
                qmax = 2**bits - 1
                lo = g.amin(dim=1, keepdim=True).clamp(max=0)
                hi = g.amax(dim=1, keepdim=True).clamp(min=0)
                scale = ((hi - lo) / qmax).clamp(min=1e-10)
                zp = torch.round(-lo / scale)
                q = torch.clamp(torch.round(g / scale) + zp, 0, qmax)
                out[:, start : start + group] = (q - zp) * scale
        mod.weight.data.copy_(out)


def autoround(model, tok, calib, cfg: dict, work: pathlib.Path):
    """AutoRound with the given scheme; saved in its 'fake' (float, dequantized) format and reloaded."""
    import torch
    from auto_round import AutoRound

    if cfg.get("probe_layers"):
        n = int(cfg["probe_layers"])
        model.model.layers = model.model.layers[:n]
        model.config.num_hidden_layers = n
    dataset = [torch.as_tensor(r, dtype=torch.long)[None] for r in calib]
    kwargs = dict(
        bits=cfg["bits"], group_size=cfg["group"], sym=cfg["sym"], iters=cfg["iters"],
        nsamples=len(dataset), seqlen=int(calib.shape[1]), dataset=dataset,
    )
    kwargs.update(cfg.get("extra", {}))
    ar = AutoRound(model, tok, **kwargs)
    qmodel, layer_cfg = ar.quantize()
    if cfg.get("probe_layers"):
        return None
    return dequantized_autoround(qmodel, cfg)


def dequantized_autoround(qmodel, cfg: dict):
    """fp32 model whose quantized linears hold round(w / s) * s, read from AutoRound's in-memory result.

    On CPU AutoRound tunes in bfloat16 by default (amp) where the CPU supports bfloat16, else in float32 (it
    logs "amp is set to FALSE"); the dtype of its quantized weights is recorded as ``tuned_dtype``. Its
    in-memory weights are the fake-quantized values w = (q - zp) * s with per-group scales s
    (``module.scale``). The integer code q - zp is recovered exactly as round(w / s) (checked:
    |w / s - round| < 0.25) and dequantized in float32 with the same s, which is what the packed checkpoint
    (int codes + scales) evaluates to; everything else comes from the original fp32 checkpoint (AutoRound
    leaves it unquantized).
    """
    import torch

    data = pathlib.Path(cfg["data"])
    fp = load_fp(data)
    group = cfg["group"]
    worst, count, dtypes = 0.0, 0, set()
    with torch.no_grad():
        for name, mod in qmodel.named_modules():
            s = getattr(mod, "scale", None)
            if not isinstance(mod, torch.nn.Linear) or not isinstance(s, torch.Tensor):
                continue
            dtypes.add(str(mod.weight.dtype).removeprefix("torch."))  # AutoRound's tuning dtype (amp)
            w = mod.weight.detach().float()
            S = s.detach().float().reshape(w.shape[0], -1).repeat_interleave(group, dim=1)[:, : w.shape[1]]
            r = w / S
            code = torch.round(r)
            worst = max(worst, float((r - code).abs().max()))
            lo, hi = (-(2 ** (cfg["bits"] - 1)), 2 ** (cfg["bits"] - 1) - 1) if cfg["sym"] else (-(2 ** cfg["bits"]), 2 ** cfg["bits"])
            if float(code.min()) < lo - 0.5 or float(code.max()) > hi + 0.5:
                raise RuntimeError(f"{name}: codes {float(code.min())}..{float(code.max())} outside {lo}..{hi}")
            fp.get_submodule(name).weight.copy_(code * S)
            count += 1
    if worst >= 0.25:
        raise RuntimeError(f"AutoRound weights are not integer multiples of their scales (max residual {worst:.3f})")
    fp.autoround_recovered = {"linears": count, "max_code_residual": worst, "tuned_dtype": ",".join(sorted(dtypes))}
    return fp


def llmcompressor_gptq(model, calib, cfg: dict, tok=None):
    """llm-compressor oneshot GPTQ; the in-memory model after oneshot (fake-quantized float weights), or with
    ``cfg["save_dir"]`` the checkpoint it saves there (``save_pretrained(save_compressed=True)``) as transformers
    loads it back. ``cfg["actorder"]``: GPTQ's activation ordering (``"group"``: a permuted ``weight_g_idx``);
    ``cfg["calib_windows"]``: the first windows of ``calib`` only; ``cfg["pipeline"]``: its calibration pipeline."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    calib = calib[: cfg.get("calib_windows") or len(calib)]
    ds = Dataset.from_dict({"input_ids": [list(map(int, r)) for r in calib],
                            "attention_mask": [[1] * calib.shape[1] for _ in calib]})
    if cfg["group"] == 128 and cfg["sym"] and not cfg.get("actorder"):
        recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    else:
        recipe = GPTQModifier(
            targets="Linear", ignore=["lm_head"],
            config_groups={"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": cfg["bits"], "type": "int", "symmetric": cfg["sym"], "strategy": "group",
                "group_size": cfg["group"], **({"actorder": cfg["actorder"]} if cfg.get("actorder") else {})}}},
        )
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=int(calib.shape[1]),
            num_calibration_samples=len(calib), **({"pipeline": cfg["pipeline"]} if cfg.get("pipeline") else {}))
    if not cfg.get("save_dir"):
        return model
    import torch
    from transformers import AutoModelForCausalLM

    model.save_pretrained(cfg["save_dir"], save_compressed=True)
    if tok is not None:
        tok.save_pretrained(cfg["save_dir"])
    loaded = AutoModelForCausalLM.from_pretrained(cfg["save_dir"], torch_dtype=torch.float32)
    loaded.eval()
    return loaded


def gptqmodel_gptq(data: pathlib.Path, calib, cfg: dict, work: pathlib.Path):
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    qc = QuantizeConfig(bits=cfg["bits"], group_size=cfg["group"], sym=cfg["sym"])
    m = GPTQModel.load(str(data / "hf"), qc, device="cpu")
    m.quantize([{"input_ids": torch.as_tensor(r)[None], "attention_mask": torch.ones(1, len(r), dtype=torch.long)}
                for r in calib])
    m.save(str(work / "gptqmodel"))
    raise RuntimeError("gptqmodel saved a packed int4 checkpoint; dequantized evaluation is not wired")


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "auto-round", "llmcompressor", "compressed-tensors", "gptqmodel"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import numpy as np

    cfg = json.loads(args.config)
    data = pathlib.Path(args.data)
    cfg["data"] = str(data)
    row: dict = {"config": {k: v for k, v in cfg.items() if k != "data"}, "threads": _threads(), "versions": versions(), "loadavg_start": os.getloadavg()}
    t0 = time.perf_counter()
    try:
        ev = np.load(data / "eval.npy")
        calib = np.load(data / "calib.npy")
        model = load_fp(data)
        peer = cfg["peer"]
        tq = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=os.environ.get("PEERS_TMP")) as d:
            work = pathlib.Path(d)
            if peer == "fp":
                q = model
            elif peer == "rtn-torch":
                rtn_torch(model, cfg["bits"], cfg["group"], cfg["sym"])
                q = model
            elif peer == "auto-round":
                q = autoround(model, tokenizer(data), calib, cfg, work)
            elif peer == "llmcompressor":
                q = llmcompressor_gptq(model, calib, cfg, tokenizer(data))
            elif peer == "gptqmodel":
                q = gptqmodel_gptq(data, calib, cfg, work)
            else:
                raise ValueError(f"unknown peer {peer!r}")
            row["quantize_seconds"] = time.perf_counter() - tq
            if q is None:  # timing probe
                row["wall_seconds"] = time.perf_counter() - t0
                pathlib.Path(args.out).write_text(json.dumps(row, indent=1))
                return 0
            if peer != "fp" and not cfg.get("save_dir"):  # a saved checkpoint loads compressed: nothing to inspect
                row["quantized"] = inspect_quantized(q, cfg["bits"], cfg["group"])
            if hasattr(q, "autoround_recovered"):
                row["autoround_recovered"] = q.autoround_recovered
            te = time.perf_counter()
            ppl, nll, n = perplexity(q, ev)
            row.update(ppl=ppl, nll=nll, predictions=n, eval_seconds=time.perf_counter() - te)
    except BaseException as e:  # noqa: BLE001 - the failure text is the result
        msg = f"{type(e).__name__}: {e}"
        row["error"] = msg if len(msg) <= 1500 else msg[:1100] + " [...] " + msg[-300:]
        row["traceback"] = traceback.format_exc()[-4000:]
    row["wall_seconds"] = time.perf_counter() - t0
    row["loadavg_end"] = os.getloadavg()
    pathlib.Path(args.out).write_text(json.dumps(row, indent=1))
    return 0 if "error" not in row else 1


if __name__ == "__main__":
    sys.exit(main())
