"""``eqjax recipes``: every built-in recipe listed with its bits per weight (checked against first principles and
against what quantizing a SmolLM2-shaped block stores), activation / KV tags and the formats whose checks
accept it."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from eqjax.cli.main import build_parser, main
from eqjax.cli.recipes import REFERENCE_SHAPES, bits_per_weight, recipe_rows
from eqjax.core.errors import InputError
from eqjax.core.numerics import QuantSpec, quantize
from eqjax.core.qarray import QArray, per_channel, per_group
from eqjax.export.package import check_recipe
from eqjax.io.compressed_tensors import check_recipe as check_ct_recipe
from eqjax.io.gguf_write import check_gguf_recipe
from eqjax.io.gptq import check_recipe as check_gptq_recipe
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize as quantize_params
from eqjax.recipes.registry import RECIPES, SUFFIXES, get_recipe

N = sum(i * o for i, o in REFERENCE_SHAPES.values())


def _json(capsys, argv: list[str]) -> list[dict]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_every_recipe_is_listed_in_registry_order_with_the_suffixes(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    table, _, footer = out.partition("\n\n")
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["recipe", "bits/w"]
    assert [ln.split()[0] for ln in lines[1:]] == list(RECIPES)
    assert all("+" + s in footer for s in SUFFIXES)
    row = next(ln for ln in lines if ln.startswith("w4g128-rtn "))
    assert "4.203" in row and "orbax,onnx,gguf" in row and get_recipe("w4g128-rtn").description in row


def test_w4g128_asymmetric_bits_from_first_principles():
    """4-bit codes two per byte, per group of 128 inputs (576 = 4 x 128 + 64: a short fifth group) one
    float16 scale and one uint8 zero point per output; the dtypes are those eqjax's quantize stores."""
    spec = QuantSpec(4, False, per_group(0, 128), scale_dtype="float16")
    q = quantize(jax.random.normal(jax.random.PRNGKey(0), (576, 64)), spec)
    assert (q.values.dtype, q.scale.dtype, q.zero_point.dtype) == (np.uint8, np.float16, np.uint8)
    assert q.values.shape == (288, 64) and q.scale.shape == (5, 64)
    bits = sum(i * o * 4 + math.ceil(i / 128) * o * (16 + 8) for i, o in REFERENCE_SHAPES.values())
    assert bits_per_weight(get_recipe("w4g128-rtn")) == pytest.approx(bits / N, rel=1e-12)
    assert bits / N == pytest.approx(4 + 24 / 128, abs=0.02)
    for name in ("w4g128-gptq", "w4g128-awq", "w4g128-signround", "w4g128-rot-gptq"):  # the same stored layout
        assert bits_per_weight(get_recipe(name)) == bits_per_weight(get_recipe("w4g128-rtn"))


def test_int8_per_channel_is_8_bits_plus_one_float32_scale_per_output():
    q = quantize(jax.random.normal(jax.random.PRNGKey(0), (64, 32)), QuantSpec(8, True, per_channel(1)))
    assert (q.values.dtype, q.scale.dtype, q.zero_point) == (np.int8, np.float32, None)
    bits = sum(i * o * 8 + o * 32 for i, o in REFERENCE_SHAPES.values())
    bpw = bits_per_weight(get_recipe("w8"))
    assert bpw == pytest.approx(bits / N, rel=1e-12) and 8 < bpw < 8.1
    assert bits_per_weight(get_recipe("fp")) == 32


@pytest.mark.parametrize("name", ["w4g128-rtn", "w4g128-rtn-sym", "w3g128-rtn", "w8", "w8-absmax", "w8-zeropoint"])
def test_bits_per_weight_is_what_quantizing_a_reference_block_stores(name):
    cfg = LlamaConfig(vocab=256, hidden=576, intermediate=1536, n_layers=1, n_heads=9, n_kv_heads=3,
                      tie_word_embeddings=True)
    model = Model(cfg)
    q = quantize_params(model.init_params(jax.random.PRNGKey(0)), get_recipe(name), model=model)
    kernels = {f"layers_0/{g}/{k}/kernel": q["layers_0"][g][k]["kernel"] for g in ("attn", "mlp") for k in q["layers_0"][g]}
    assert set(kernels) == set(REFERENCE_SHAPES) and all(isinstance(k, QArray) for k in kernels.values())
    assert {p: k.shape for p, k in kernels.items()} == REFERENCE_SHAPES
    stored = sum(k.nbytes for k in kernels.values()) * 8
    assert bits_per_weight(get_recipe(name)) == pytest.approx(stored / N, rel=1e-12)


def _accepts(check, name: str) -> bool:
    try:
        check(get_recipe(name))
    except InputError:
        return False
    return True


def test_json_lists_the_formats_whose_checks_accept_each_recipe(capsys):
    rows = _json(capsys, ["recipes", "--json"])
    assert [r["name"] for r in rows] == list(RECIPES)
    for r in rows:
        checks = (("onnx", check_recipe), ("gguf", check_gguf_recipe), ("compressed-tensors", check_ct_recipe),
                  ("gptq", check_gptq_recipe))
        want = ["orbax"] + [f for f, c in checks if _accepts(c, r["name"])]
        assert r["formats"] == want, r["name"]
    by = {r["name"]: r for r in rows}
    assert by["kv8"]["kv"] == {"key_bits": 8, "value_bits": 8} and by["kv8"]["weights"] == "float"
    assert by["w8a8-smoothquant"]["act_bits"] == 8 and by["w4a8-rot-gptq"]["act_bits"] == 8
    assert by["w4g128-gptq"]["act_bits"] is None and by["w4g128-gptq"]["calibrated"]
    assert by["w3g128-rtn"]["formats"] == ["orbax"]


def test_filter_and_debug(capsys):
    rows = _json(capsys, ["recipes", "gptq", "--json", "--debug"])
    assert rows and all("gptq" in r["name"] for r in rows)
    assert [r["name"] for r in rows] == [r["name"] for r in recipe_rows("gptq")]
    assert main(["recipes", "no-such-recipe"]) == 0
    assert "no built-in recipe name contains 'no-such-recipe'" in capsys.readouterr().out
    assert "recipes" in build_parser().format_help()


def test_a_closed_pipe_ends_the_listing_quietly():
    """``eqjax recipes | head -1``: the reader leaves after one line; eqjax exits 0 with nothing on stderr."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "eqjax.cli", "recipes"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 0 and first.startswith(b"recipe") and err == b""
