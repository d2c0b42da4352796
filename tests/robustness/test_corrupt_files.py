"""Truncated and corrupted files (GGUF, safetensors, Orbax checkpoint, recipe TOML/JSON, text): every load
ends in an error of the eqjax family naming the file, or in a correct result; never another exception."""

from __future__ import annotations

import codecs
import json
import pathlib
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from robustness_cases import Fixtures

from eqjax.core.errors import InputError, RecipeError, classify
from eqjax.data import DataError, load_text_file
from eqjax.io import load_model
from eqjax.io.gguf import GGUFError, load_gguf
from eqjax.io.hf import CheckpointError
from eqjax.io.orbax import load_quantized
from eqjax.recipes.registry import load_recipe
from eqjax.recipes.types import Recipe

FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Fixtures:
    return Fixtures(tmp_path_factory.mktemp("corrupt")).build()


def _scratch(fx: Fixtures, name: str) -> pathlib.Path:
    d = fx.root / "scratch" / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def _is_family(e: BaseException) -> bool:
    return classify(e) in ("input", "runtime") and "\n" not in str(e)


@FAST
@given(frac=st.floats(0.0, 1.0))
def test_truncated_gguf(fx, frac):
    data = (fx.root / "tiny.gguf").read_bytes()
    p = _scratch(fx, "gguf") / "cut.gguf"
    cut = int(len(data) * frac)
    p.write_bytes(data[:cut])
    try:
        cfg, _, _ = load_gguf(p)
    except GGUFError as e:
        assert "cut.gguf" in str(e) and _is_family(e)
        return
    assert cut == len(data) and cfg.n_layers == 2


@FAST
@given(frac=st.floats(0.0, 1.0), flip=st.integers(0, 10**9))
def test_truncated_or_flipped_safetensors(fx, frac, flip):
    d = _scratch(fx, "hf") / "m"
    shutil.copytree(fx.root / "tiny", d)
    p = d / "model.safetensors"
    data = bytearray(p.read_bytes())
    if flip % 2:
        i = flip % len(data)
        data[i] ^= 0xFF
    else:
        data = data[: int(len(data) * frac)]
    p.write_bytes(bytes(data))
    try:
        model, params, _ = load_model(d)
    except InputError as e:  # CheckpointError, NonFiniteError (a flipped exponent byte can make a NaN/Inf)
        assert "model.safetensors" in str(e) or str(d) in str(e)
        assert _is_family(e)
        return
    assert model.config.hidden == 64


@FAST
@given(which=st.integers(0, 10**6), how=st.sampled_from(["truncate", "flip", "delete", "append"]))
def test_damaged_checkpoint(fx, which, how):
    d = _scratch(fx, "ck") / "ck"
    shutil.copytree(fx.root / "ck", d)
    files = sorted(p for p in (d / "arrays").rglob("*") if p.is_file())
    p = files[which % len(files)]
    data = p.read_bytes()
    if how == "truncate":
        p.write_bytes(data[: len(data) // 2])
    elif how == "flip" and data:
        p.write_bytes(bytes([data[0] ^ 0x01]) + data[1:])
    elif how == "delete":
        p.unlink()
    else:
        p.write_bytes(data + b"\0")
    if how == "flip" and not data:
        return
    with pytest.raises(CheckpointError) as e:
        load_quantized(d)
    assert str(d) in str(e.value) and _is_family(e.value)


@FAST
@given(frac=st.floats(0.0, 1.0))
def test_truncated_manifest(fx, frac):
    d = _scratch(fx, "man") / "ck"
    shutil.copytree(fx.root / "ck", d)
    m = d / "eqjax.json"
    data = m.read_bytes()
    cut = int(len(data) * frac)
    m.write_bytes(data[:cut])
    try:
        params, manifest = load_quantized(d)
    except CheckpointError as e:
        assert "eqjax.json" in str(e) or str(d) in str(e)
        return
    assert cut == len(data) and manifest["recipe"] == "w8"


RECIPE_TOML = ('name = "r"\ndescription = "d"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = ".*/kernel"\n'
               'bits = 4\nsymmetric = false\ngranularity = "group"\ngroup_size = 32\n[kv]\nkey_bits = 4\nvalue_bits = 4\n')


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, len(RECIPE_TOML)), suffix=st.sampled_from([".toml", ".json"]),
       junk=st.binary(max_size=4))
def test_truncated_recipe_files(tmp_path, cut, suffix, junk):
    import tomllib

    text = RECIPE_TOML if suffix == ".toml" else json.dumps(tomllib.loads(RECIPE_TOML))
    p = tmp_path / f"r{suffix}"
    p.write_bytes(text.encode()[: cut if suffix == ".toml" else int(cut * len(text) / len(RECIPE_TOML))] + junk)
    try:
        r = load_recipe(p)
    except RecipeError as e:
        assert str(p) in str(e) and _is_family(e)
        return
    assert isinstance(r, Recipe) and r.name == "r"


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=64))
def test_text_files_of_random_bytes(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("t") / "t.txt"
    p.write_bytes(data)
    try:
        text = load_text_file(p)
    except DataError as e:
        assert "t.txt" in str(e) and _is_family(e)
        return
    boms = [(codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
            (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")]
    declared = next((enc for bom, enc in boms if data.startswith(bom)), "utf-8")  # what the byte-order mark says
    assert text.strip() and data.decode(declared).replace("\r\n", "\n") == text
