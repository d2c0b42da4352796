"""Every file in examples/ runs as a user runs it, on tiny sizes, and prints what it claims.

Each example is a subprocess of this interpreter with the repository root first on ``PYTHONPATH`` (so a
plain checkout runs the same as an installed eqjax). Outside pytest-xdist the selected examples start
together at the first of these tests, two at a time, longest first (much of each is single-threaded XLA
compilation); each test waits for its own run and checks its output.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 600


@dataclass(frozen=True)
class Case:
    example: str
    commands: Callable[[Path], list[list[str]]]  # argv lists (run side by side) given the case's work directory
    seconds: float  # about, on 2 CPU cores: the longest start first
    xla_flags: str = ""  # appended to the session's XLA_FLAGS


def _script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / name), *args]


def _tiny_hf_checkpoint(d: Path) -> Path:
    """A random 1-layer Llama as a Hugging Face directory with a byte-level tokenizer.json."""
    import jax
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from eqjax.io.hf import save_hf_checkpoint
    from eqjax.models import LlamaConfig, Model

    d.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    model = Model(LlamaConfig(vocab=256, hidden=64, intermediate=128, n_layers=1, n_heads=4, n_kv_heads=2,
                              tie_word_embeddings=True))
    save_hf_checkpoint(d, model, model.init_params(jax.random.key(0), std=0.05))
    return d


def _multihost(work: Path) -> list[list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [_script("multihost.py", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                    "--process-id", str(i), "--out", str(work / "q.npz")) for i in range(2)]


EXPORT_FAST = ("--calib-windows", "2", "--calib-len", "64", "--eval-windows", "2", "--eval-len", "128")

CASES = {
    "linen_model": Case("linen_model.py", lambda w: [_script("linen_model.py")], 12),
    "nnx_model": Case("nnx_model.py", lambda w: [_script("nnx_model.py", "--layers", "1", "--calib-batches", "2")], 16),
    "hf_flax_model": Case("hf_flax_model.py", lambda w: [_script("hf_flax_model.py", "--layers", "1",
                                                                 "--calib-batches", "2")], 30),
    "hf_checkpoint_export_tiny": Case("hf_checkpoint_export.py", lambda w: [_script(
        "hf_checkpoint_export.py", "--model", str(_tiny_hf_checkpoint(w / "tiny")), "--out", str(w / "out"),
        *EXPORT_FAST)], 25),
    "hf_checkpoint_export_smollm2": Case("hf_checkpoint_export.py", lambda w: [_script(
        "hf_checkpoint_export.py", "--recipe", "w4g128-rtn-sym+emb-int8", "--eval-windows", "1", "--eval-len", "256",
        "--out", str(w / "out"))], 55),
    "quantize_smollm2": Case("quantize_smollm2.py", lambda w: [_script(
        "quantize_smollm2.py", "--recipe", "w4g128-rtn", "--eval-windows", "1")], 85),
    "layout_models": Case("layout_models.py", lambda w: [_script("layout_models.py", "--layers", "1")], 20),
    "model_parallel": Case("model_parallel.py", lambda w: [_script(
        "model_parallel.py", "--recipes", "w8a8-smoothquant", "--layers", "1")], 13),
    "multihost": Case("multihost.py", _multihost, 8, xla_flags="--xla_force_host_platform_device_count=2"),
}


@dataclass
class Run:
    out: str  # stdout of every process, in order
    work: Path


def _start(case: Case, work: Path) -> Run:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {case.xla_flags}".strip()}
    procs = [subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in case.commands(work)]
    try:
        done = [(p, *p.communicate(timeout=TIMEOUT_S)) for p in procs]
    finally:
        for p in procs:
            p.kill()  # a no-op for those that exited
    for p, out, err in done:
        assert p.returncode == 0, f"{' '.join(p.args)} exited {p.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
    return Run("\n".join(out for _, out, _ in done), work)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """``runs(name)``: the finished run of a case. Outside pytest-xdist every selected case (whose
    ``test_<case>`` this pytest run selects) starts at once, two at a time; under xdist, where the other worker
    has the second core (and might hold some of these tests), each starts when its test asks for it."""
    futures: dict[str, Future[Run]] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:

        def submit(name: str) -> Future[Run]:
            if name not in futures:
                futures[name] = pool.submit(_start, CASES[name], tmp_path_factory.mktemp(name))
            return futures[name]

        if not hasattr(request.config, "workerinput"):
            selected = {it.name.removeprefix("test_") for it in request.session.items if it.path == request.path}
            for name in sorted(selected & CASES.keys(), key=lambda n: -CASES[n].seconds):
                submit(name)
        yield lambda name: submit(name).result()
        pool.shutdown(cancel_futures=True)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def rounding_bound(depth: int, *bits: int, crest: float = 4.0) -> float:
    """First-order bound on the relative error of a quantized network's output.

    A b-bit symmetric grid has ``2**(b-1) - 1`` steps over an operand's absmax (an asymmetric one, 2**b - 1
    over its range: no coarser); rounding leaves an error of RMS ``step / sqrt(12)``, i.e. relative to the
    operand's RMS ``crest / ((2**(b-1) - 1) * sqrt(12))`` with ``crest = absmax / RMS`` (<= 4 for the
    randomly initialised weights and the normed activations here). Each matmul adds its operands'
    relative errors (``bits``: weights, and activations where quantized), and those of the ``depth``
    matmuls in series add up, to first order.
    """
    return depth * sum(crest / ((2 ** (b - 1) - 1) * math.sqrt(12)) for b in bits)


def _check_flax_summary(s: dict, *, matmuls: int, depth: int, bits: tuple[int, ...]) -> None:
    assert s["quantized"] == matmuls  # every matmul weight, the embedding tables left float
    assert 0 < s["rel_err"] < rounding_bound(depth, *bits)
    assert s["top1_agreement"] > 0.5  # chance is 1/10 (classes) or 1/512 (vocabulary)
    # int8 / int4 codes take 1/4 / 1/8 of float32's bytes; scales and the float embeddings come on top
    assert s["quantized_bytes"] < s["float_bytes"] / 2


def test_every_example_is_run() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == {c.example for c in CASES.values()}
    tests = {n.removeprefix("test_") for n, f in globals().items() if n.startswith("test_") and callable(f)}
    assert CASES.keys() <= tests


def test_linen_model(runs) -> None:
    r = runs("linen_model")
    assert "rtn: int8 sym per-channel(1,) + A8" in r.out and "smoothquant:" in r.out  # the report
    # W8A8: 2 blocks of up/down, then the head
    _check_flax_summary(last_json(r.out), matmuls=5, depth=5, bits=(8, 8))


def test_nnx_model(runs) -> None:
    r = runs("nnx_model")
    assert "gptq: int4 asym group128" in r.out
    # one block (q, k, v, o, up, down) and the head; in series: q, o, up, down, head
    _check_flax_summary(last_json(r.out), matmuls=7, depth=5, bits=(4,))


@pytest.mark.slow
def test_hf_flax_model(runs) -> None:
    r = runs("hf_flax_model")
    assert "model/layers/0/self_attn/q_proj/kernel" in r.out
    # one decoder layer (q, k, v, o, gate, up, down) and lm_head; in series: q, o, gate, down, lm_head
    _check_flax_summary(last_json(r.out), matmuls=8, depth=5, bits=(4,))


def test_hf_checkpoint_export_tiny(runs) -> None:
    r = runs("hf_checkpoint_export_tiny")
    s = last_json(r.out)
    assert s["format"] == "onnx" and s["eval_tokens"] == 256
    assert s["ppl_reloaded"] == s["ppl_quantized"]  # the Orbax checkpoint holds the same params, bit for bit
    # onnxruntime sums the same float32 products in another order: each logit moves by about K * eps32
    # (K <= 128 terms, ~1.5e-5 relative), the mean NLL by as much, the perplexity by that relative to it
    assert s["export"]["ppl"] == pytest.approx(s["ppl_quantized"], rel=1e-4)
    assert (r.work / "out" / "orbax" / "eqjax.json").is_file() and (r.work / "out" / "model.onnx").is_file()


@pytest.mark.slow
def test_hf_checkpoint_export_smollm2(runs) -> None:
    r = runs("hf_checkpoint_export_smollm2")
    s = last_json(r.out)
    assert s["format"] == "gguf" and s["model"].endswith(".gguf")
    assert s["ppl_reloaded"] == s["ppl_quantized"]
    assert 1 < s["ppl_float"] < s["ppl_quantized"] < math.inf
    gguf = s["export"]
    assert gguf["tensor_types"]["Q4_0"] == 30 * 7  # every projection of the 30 layers
    assert gguf["max_abs_diff"]["Q4_0"] == 0 and gguf["max_abs_diff"]["F32"] == 0  # Q4_0 holds 4-bit sym exactly
    assert Path(gguf["path"]).stat().st_size == gguf["bytes"]


@pytest.mark.slow
def test_quantize_smollm2(runs) -> None:
    r = runs("quantize_smollm2")
    assert "w4g128-rtn: ppl " in r.out and "on 1024 tokens" in r.out
    assert "Orbax round trip: identical logits" in r.out
    assert "greedy: The capital of France is" in r.out


def test_layout_models(runs) -> None:
    r = runs("layout_models")
    assert "layers/0/attn/attn_vec_einsum/w      rtn: int4 asym group128@axes0-1" in r.out
    s = last_json(r.out)
    # the same quantized weights in another layout: the logits differ by float summation order only, as the
    # float models do (and at least by a few ulps of the largest logit)
    bound = 4 * max(s["float_max_abs"], np.finfo(np.float32).eps * s["logit_max_abs"])
    assert s["gemma_nnx_max_abs"] <= bound and s["einsum_linen_max_abs"] <= bound


def test_model_parallel(runs) -> None:
    s = last_json(runs("model_parallel").out)
    assert s["devices"] == 8 and s["mesh"] == {"data": 1, "model": 8}
    q = s["w8a8-smoothquant"]
    assert q["differ"] == 0  # the mesh run equals the one-device run bit for bit
    # weights split 8 ways along their output channels; the replicated norms are a few KiB: well under 2/8
    assert s["float_per_device_max"] < s["float_total"] / 4 and q["per_device_max"] < q["total"] / 4


def test_multihost(runs) -> None:
    r = runs("multihost")
    assert "process 0 of 2 wrote" in r.out
    got = np.load(r.work / "q.npz")
    rng = np.random.default_rng(0)  # the example's stand-in data, recomputed on one host in float64
    x = rng.standard_normal((32, 16, 64)).astype(np.float32).reshape(-1, 64).astype(np.float64)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    np.testing.assert_array_equal(got["absmax"], np.abs(x).max(0).astype(np.float32))
    # float32 sums of 512 products of O(1) terms: relative error <= 512 * eps32 ~ 6e-5 of sum |x_i x_j|
    bound = 2 * 512 * np.finfo(np.float32).eps * (np.abs(x).T @ np.abs(x)) / len(x)
    assert np.all(np.abs(got["hessian"] - 2 * x.T @ x / len(x)) <= bound)
    # int8 per output channel: within half a step of the weights
    assert np.all(np.abs(got["values"] * got["scale"] - w) <= got["scale"] / 2 * (1 + 1e-6))
