"""Hugging Face's FlaxLlamaForCausalLM holding SmolLM2-135M's weights, quantized by eqjax through its own
``module.apply``: the same perplexity as eqjax's own model under the same recipe, windows and calibration
(bench/flax_models.py has the full table).

Weight-only: within 0.5 % (both programs compute the same float logits to ~1e-6 relative; the quantized
weights are the same). W8A8: inside the rounding band of eqjax's own model (``eqjax.evaluate.rounding_band``,
the model with its params moved by 1..8 float32 ulps): the two programs order their float work differently,
int8 activation codes flip where a value lies within an ulp of a rounding boundary, and the flips propagate,
so another correct implementation lands anywhere in that band (which differs between CPUs).

HF's Flax Llama hard-codes RoPE base 10000 (SmolLM2: 100000), so both sides run the weights with base
10000; its LM head is untied (a copy of the embedding), excluded by a user rule so that both quantize
the same weights (see bench/flax_models.py)."""

import dataclasses

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.reference]


@pytest.fixture(scope="module")
def setup():
    pytest.importorskip("transformers", minversion="4.57")
    from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
    from eqjax.io import load_model
    from eqjax.io.flax_hf import to_hf_flax
    from eqjax.models import Model

    model, params, tok = load_model()
    model = Model(dataclasses.replace(model.config, rope_theta=10000.0))
    hf_model, hf_params = to_hf_flax(model, params)
    cal_ids, ev_ids = wikipedia_tokens(tok)
    return model, params, hf_model, hf_params, token_windows(ev_ids, 512, 1), calibration_windows(cal_ids, 4, 256, 0)


@pytest.mark.parametrize("recipe", ["w8", "w8a8-smoothquant"])
def test_hf_flax_model_matches_eqjax_model(setup, recipe):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from flax_models import run_pair

    from eqjax.evaluate import rounding_band, within_band
    from eqjax.recipes.registry import get_recipe

    model, params, hf_model, hf_params, windows, calib = setup
    q = []
    row = run_pair("smollm2", model, params, hf_model, hf_params, get_recipe(recipe), windows, calib,
                   exclude_pattern="lm_head/kernel", qparams_out=q)
    if get_recipe(recipe).steps[-1].rules[-1].act_bits is None:
        assert abs(row["rel_diff_pct"]) < 0.5, row
    else:
        band = rounding_band(model, q[0], windows, bumps=tuple(range(1, 9)))
        assert within_band(row["ppl_hf_flax"], band, 0.0), (row, band)
