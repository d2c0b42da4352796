"""Perplexity bounds of the real-model tests (SmolLM2-135M, the default model), each derived from a stated
reference, and the float reference forward they compare against.

Every real-model perplexity check compares against the float model's perplexity on the same token ids,
computed in the same test, so that the bound is a ratio that the committed benchmark results pin down:

* ``W8_BAND`` (W8 per channel vs FP, in %): committed references +0.24 % (bench/results/quality.json,
  32 x 1024 tokens), +0.35 % (bench/results/main_job.md, 4 x 1024) and +0.10 % (bench/results/flax_models.json,
  4 x 1024, RoPE base 1e4). Those at 4,096 tokens differ by 0.25 points; on 1,024 tokens (a quarter) the
  sampling spread of a mean log-ratio doubles (sqrt 4): 0.5 points around references of at most 0.35 %,
  so |delta| <= 1.0 %. Weight-only models move by ~1e-6 between CPUs (README "Which CPU, and
  reproducibility"), so AVX2-only and AVX-512 machines need no further margin. A 2 % regression of the
  W8 perplexity (delta >= 2 %) fails.
* ``W4_RTN_BAND`` (w4g128-rtn vs FP, in %): references +32.58 % (quality.json), +32.39 % (main_job.md),
  +29.57 % (bench/results/quality_rotation.json, 8 x 1024), +27.20 % (flax_models.json): a span of 5.4
  points. One 1,024-token window is one of main_job.md's four; allowing 1.4 x that span on either side
  gives 20..40 %. A sanity band (W4 path broken, or no worse than W8), not a 2 % detector: the W4 tests
  pair it with exact sizes and with a float forward of the same dequantized weights (``FLOAT_REL``).
* ``W4_GPTQ_BAND`` (w4g128-gptq vs FP, in %) for reduced calibration: references +13.75 % (quality.json,
  16 x 512 calibration tokens), +18.16 % (main_job.md), +15.13 % (flax_models.json), +23.85 %
  (quality_rotation.json); GPTQ figures move by up to 1.2 % between CPUs (README). With 2 x 256
  calibration tokens (1/16 of theirs) GPTQ can do no better than those and, being a correction of
  round-to-nearest, no worse than RTN's references (at most +32.6 %) plus the RTN band's margin: 10..45 %.
* ``FLOAT_REL`` (eqjax's perplexity vs transformers' float32 forward of the same weights and ids):
  tests/io/test_gguf_parity.py holds every logit of this model to ``LOGIT_TOL`` = 1e-3 of transformers'
  (over 256 tokens; taken as the bound over the 1,024 here: float32 rounding grows with the attention
  sum's length only as its square root). A token's NLL is ``logsumexp(z) - z[target]``; logsumexp is
  1-Lipschitz in the max norm, so each NLL moves by at most 2 x 1e-3, and so does their mean (the log
  perplexity): relative perplexity difference <= exp(2e-3) - 1 < 2.1e-3. Both sides are float32 with float64 log-softmax, on any x86-64 CPU.
"""

from __future__ import annotations

import functools
import json
import pathlib
import warnings
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

W8_BAND = (-1.0, 1.0)
W4_RTN_BAND = (20.0, 40.0)
W4_GPTQ_BAND = (10.0, 45.0)
FLOAT_REL = 2.1e-3

REFERENCES = {
    # (file, fp ppl, quantized ppl) of the rows cited above; tests/cli/test_main_job.py checks them against the files
    "w8": [("quality.json", 18.549, 18.595), ("flax_models.json", 19.203, 19.222)],
    "w4g128-rtn": [("quality.json", 18.549, 24.594), ("quality_rotation.json", 19.916, 25.804),
                   ("flax_models.json", 19.203, 24.424)],
    "w4g128-gptq": [("quality.json", 18.549, 21.100), ("quality_rotation.json", 19.916, 24.665),
                    ("flax_models.json", 19.203, 22.107)],
}
MAIN_JOB_MD = {"fp": (16.900, 538.1), "w8": (16.960, 220.2), "w4g128-rtn": (22.374, 169.2), "w4g128-gptq": (19.969, 169.2)}
"""bench/results/main_job.md: recipe -> (ppl over 4 x 1024 tokens, size MB)."""


def delta_pct(ppl: float, fp: float) -> float:
    return 100.0 * (ppl / fp - 1.0)


def committed_ppl(file: str, recipe: str, model_prefix: str = "SmolLM2") -> float:
    """The committed perplexity of ``recipe`` in bench/results/``file`` (eqjax's own model's column)."""
    o = json.loads((ROOT / "bench" / "results" / file).read_text())
    for r in o["rows"]:
        if r.get("recipe") != recipe or not str(r.get("model", model_prefix)).startswith(model_prefix):
            continue
        if "ppl" in r:
            return float(r["ppl"])
        if "ppl_eqjax_model" in r and "order check" not in str(r.get("model")):
            return float(r["ppl_eqjax_model"])
    raise KeyError((file, recipe))


@functools.lru_cache(maxsize=1)
def transformers_smollm2() -> Any:
    """transformers' float32 torch Llama holding SmolLM2-135M, loaded by transformers' own GGUF reader
    (config, Q/K un-permutation, Q4_1 dequantization: independent of eqjax's loader)."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from eqjax.io.gguf import default_model_path

    path = default_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        with transformers.modeling_utils.no_init_weights():
            ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                                attn_implementation="eager").eval()
        sd = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    res = ref.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in sd.items()}, strict=False)
    assert res.missing_keys == ["lm_head.weight"] and not res.unexpected_keys
    ref.tie_weights()
    return ref


def torch_ppl(ref: Any, windows: np.ndarray) -> float:
    """Perplexity of a torch causal LM over int [n, T] windows (each on its own, no BOS), float64 log-softmax."""
    import torch

    nll, count = 0.0, 0
    with torch.no_grad():
        for w in np.asarray(windows, np.int64):
            logits = ref(torch.from_numpy(w[None])).logits[0, :-1].double()
            lp = torch.log_softmax(logits, -1)
            nll -= float(lp.gather(1, torch.from_numpy(w[1:, None])).sum())
            count += len(w) - 1
    return float(np.exp(nll / count))


def load_eqjax_kernels_into(ref: Any, params: Any) -> None:
    """Overwrite ``ref``'s linear weights with eqjax's (dequantized where quantized) kernels, transposed to
    torch's [out, in] (the layouts tests/io/test_gguf_parity.py checks); embeddings and norms stay."""
    import torch

    from eqjax.core.numerics import dequantize_leaf

    names = {("attn", "q_proj"): "self_attn.q_proj", ("attn", "k_proj"): "self_attn.k_proj",
             ("attn", "v_proj"): "self_attn.v_proj", ("attn", "o_proj"): "self_attn.o_proj",
             ("mlp", "gate_proj"): "mlp.gate_proj", ("mlp", "up_proj"): "mlp.up_proj", ("mlp", "down_proj"): "mlp.down_proj"}
    sd = {}
    i = 0
    while f"layers_{i}" in params:
        for (blk, lin), theirs in names.items():
            w = np.asarray(dequantize_leaf(params[f"layers_{i}"][blk][lin]["kernel"]), np.float32)
            sd[f"model.layers.{i}.{theirs}.weight"] = torch.from_numpy(np.ascontiguousarray(w.T))
        i += 1
    res = ref.load_state_dict(sd, strict=False)
    assert not res.unexpected_keys and i > 0
