"""Orbax save/restore of quantized params: identical logits after a reload, clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.errors import CompatibilityError, InputError, NonFiniteError, OutputError
from eqjax.io.hf import CheckpointError
from eqjax.io.orbax import is_partial_checkpoint, load_quantized, model_fingerprint, recipe_kv, save_quantized
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import get_recipe


@pytest.mark.parametrize("name", ["w4g128-rtn", "w8a8-naive", "w3g128-rtn", "w8-absmax"])
def test_reload_gives_identical_logits(tmp_path, name):
    model = Model(LlamaConfig(vocab=64, hidden=64, intermediate=96, n_layers=1, n_heads=2, n_kv_heads=1))
    params = model.init_params(jax.random.PRNGKey(1))
    q = quantize(params, get_recipe(name), model=model)
    save_quantized(tmp_path / "ck", q, recipe=name)
    q2, manifest = load_quantized(tmp_path / "ck")
    assert manifest["recipe"] == name
    assert jax.tree_util.tree_structure(q) == jax.tree_util.tree_structure(q2)
    toks = jnp.arange(12, dtype=jnp.int32).reshape(1, 12) % 64
    a, _ = model.apply(q, toks)
    b, _ = model.apply(q2, toks)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_full_range_activation_grid_round_trip(tmp_path):
    """An ActQuantKernel on the compressed-tensors grid (as read from such a checkpoint) keeps it through
    Orbax; a manifest without the key (eqjax's own grid) reads as before."""
    from eqjax.core.qarray import ActQuantKernel

    model = Model(LlamaConfig(vocab=64, hidden=64, intermediate=96, n_layers=1, n_heads=2, n_kv_heads=1))
    q = quantize(model.init_params(jax.random.PRNGKey(1)), get_recipe("w8a8-naive"), model=model)
    up = q["layers_0"]["mlp"]["up_proj"]
    up["kernel"] = ActQuantKernel(up["kernel"].weight, act_full_range=True)
    save_quantized(tmp_path / "ck", q, recipe="w8a8-naive")
    m = json.loads((tmp_path / "ck" / "eqjax.json").read_text())
    assert m["leaves"]["layers_0/mlp/up_proj/kernel"]["act_full_range"] is True
    assert "act_full_range" not in m["leaves"]["layers_0/mlp/down_proj/kernel"]
    q2, _ = load_quantized(tmp_path / "ck")
    assert q2["layers_0"]["mlp"]["up_proj"]["kernel"].act_full_range
    assert not q2["layers_0"]["mlp"]["down_proj"]["kernel"].act_full_range
    toks = jnp.arange(12, dtype=jnp.int32).reshape(1, 12) % 64
    np.testing.assert_array_equal(np.asarray(model.apply(q, toks)[0]), np.asarray(model.apply(q2, toks)[0]))


@pytest.mark.parametrize("tied", [False, True])
def test_rotated_model_round_trip(tmp_path, tied):
    """A QuaRot model: online-rotated down_proj (RotatedKernel: seed and axis in the manifest) and the
    untied LM head a tied model gains; reloaded into the same model, the logits are identical."""
    from eqjax.core.qarray import RotatedKernel

    model = Model(LlamaConfig(vocab=64, hidden=64, intermediate=96, n_layers=1, n_heads=2, n_kv_heads=1,
                              tie_word_embeddings=tied))
    params = model.init_params(jax.random.PRNGKey(1))
    assert ("lm_head" in params) is not tied
    cal = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)
    recipe = get_recipe("w4a8-rot-gptq")
    q = quantize(params, recipe, model=model, calibration=cal)
    save_quantized(tmp_path / "ck", q, recipe=recipe, model=model)
    m = json.loads((tmp_path / "ck" / "eqjax.json").read_text())
    down = m["leaves"]["layers_0/mlp/down_proj/kernel"]
    assert down["kind"] == "rotated" and down["inner"]["kind"] == "act_quant" and down["shape"] == [96, 64]
    assert m["leaves"]["lm_head/kernel"]["shape"] == [64, 64]
    q2, _ = load_quantized(tmp_path / "ck", model=model)
    k, k2 = q["layers_0"]["mlp"]["down_proj"]["kernel"], q2["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(k2, RotatedKernel) and (k2.seed, k2.axis) == (k.seed, k.axis)
    assert jax.tree_util.tree_structure(q) == jax.tree_util.tree_structure(q2)
    toks = jnp.arange(12, dtype=jnp.int32).reshape(1, 12) % 64
    np.testing.assert_array_equal(np.asarray(model.apply(q, toks)[0]), np.asarray(model.apply(q2, toks)[0]))
    down["axis"] = 5  # a damaged manifest is named, not a traceback
    (tmp_path / "ck" / "eqjax.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"down_proj/kernel\): rotation axis 5"):
        load_quantized(tmp_path / "ck", verify=False)


def test_permuted_kernel_round_trip(tmp_path):
    """An input-permuted kernel (activation-ordered GPTQ groups): its order beside the inner QArray's arrays;
    reloaded, the logits are identical; a damaged entry is named, not a traceback."""
    from eqjax.core.qarray import PermutedKernel

    model = Model(LlamaConfig(vocab=64, hidden=64, intermediate=96, n_layers=1, n_heads=2, n_kv_heads=1))
    q = quantize(model.init_params(jax.random.PRNGKey(1)), get_recipe("w4g128-rtn"), model=model)
    up = q["layers_0"]["mlp"]["up_proj"]
    perm = jnp.asarray(np.random.default_rng(0).permutation(64), jnp.int32)
    up["kernel"] = PermutedKernel(up["kernel"], perm)
    save_quantized(tmp_path / "ck", q, recipe="w4g128-rtn")
    m = json.loads((tmp_path / "ck" / "eqjax.json").read_text())
    entry = m["leaves"]["layers_0/mlp/up_proj/kernel"]
    assert entry["kind"] == "permuted" and entry["inner"]["kind"] == "qarray"
    q2, _ = load_quantized(tmp_path / "ck")
    k2 = q2["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert isinstance(k2, PermutedKernel) and np.array_equal(np.asarray(k2.perm), np.asarray(perm))
    toks = jnp.arange(12, dtype=jnp.int32).reshape(1, 12) % 64
    np.testing.assert_array_equal(np.asarray(model.apply(q, toks)[0]), np.asarray(model.apply(q2, toks)[0]))
    entry["axis"] = 5
    (tmp_path / "ck" / "eqjax.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"corrupt checkpoint entry .*up_proj/kernel\)"):
        load_quantized(tmp_path / "ck", verify=False)


def test_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not an eqjax checkpoint"):
        load_quantized(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        load_quantized(tmp_path / "nope")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(OutputError, match="not empty"):
        save_quantized(tmp_path / "x", {"a": jnp.ones(2)})
    assert (tmp_path / "x" / "f").read_text() == ""
    (tmp_path / "file").write_text("keep")
    with pytest.raises(OutputError, match="directory, found a file"):
        save_quantized(tmp_path / "file", {"a": jnp.ones(2)})
    with pytest.raises(NonFiniteError, match=r"a\b.*index \(1,\)"):
        save_quantized(tmp_path / "nan", {"a": jnp.asarray([1.0, jnp.nan])})
    assert not (tmp_path / "nan").exists()


def _tiny():
    model = Model(LlamaConfig(vocab=64, hidden=64, intermediate=96, n_layers=1, n_heads=2, n_kv_heads=1))
    return model, model.init_params(jax.random.PRNGKey(1))


def test_manifest_records_recipe_model_and_files(tmp_path):
    model, params = _tiny()
    recipe = get_recipe("kv4")
    save_quantized(tmp_path / "ck", params, recipe=recipe, model=model)
    m = json.loads((tmp_path / "ck" / "eqjax.json").read_text())
    assert m["recipe"] == "kv4" and m["kv"]["key_bits"] == 4 and "KVQuant" in m["recipe_repr"]
    assert m["model_fingerprint"] == model_fingerprint(model) and m["model_config"]["hidden_size"] == 64
    assert m["leaves"]["embed/embedding"]["shape"] == [64, 64]
    assert m["files"] and all(v["bytes"] > 0 and len(v["sha256"]) == 64 for v in m["files"].values())
    _, m2 = load_quantized(tmp_path / "ck", model=model)
    assert recipe_kv(m2) == recipe.kv


def test_refuses_another_model(tmp_path):
    model, params = _tiny()
    save_quantized(tmp_path / "ck", quantize(params, get_recipe("w8"), model=model), recipe="w8", model=model)
    other = Model(LlamaConfig(vocab=64, hidden=32, intermediate=96, n_layers=1, n_heads=2, n_kv_heads=1))
    with pytest.raises(CompatibilityError, match="another model.*config key"):
        load_quantized(tmp_path / "ck", model=other)
    # no recorded config (an API save): the shapes still decide
    save_quantized(tmp_path / "bare", quantize(params, get_recipe("w8"), model=model), recipe="w8")
    with pytest.raises(CompatibilityError, match=r"embed/embedding\): expected shape \(64, 32\), found \(64, 64\)"):
        load_quantized(tmp_path / "bare", model=other)


def test_damaged_files_are_named(tmp_path):
    model, params = _tiny()
    save_quantized(tmp_path / "ck", params, recipe="fp", model=model)
    data = max((p for p in (tmp_path / "ck" / "arrays").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    blob = data.read_bytes()
    data.write_bytes(blob[:-10])
    with pytest.raises(CheckpointError, match=rf"truncated \(.*{data.name}\): expected {len(blob)} bytes, found {len(blob) - 10}"):
        load_quantized(tmp_path / "ck")
    data.write_bytes(bytes([blob[0] ^ 1]) + blob[1:])
    with pytest.raises(CheckpointError, match="corrupt.*SHA-256"):
        load_quantized(tmp_path / "ck")


def test_overwrite_is_atomic(tmp_path):
    model, params = _tiny()
    save_quantized(tmp_path / "ck", params, recipe="fp", model=model)
    save_quantized(tmp_path / "ck", quantize(params, get_recipe("w8"), model=model), recipe="w8", model=model, overwrite=True)
    q, m = load_quantized(tmp_path / "ck", model=model)
    assert m["recipe"] == "w8" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_partial_checkpoint_is_refused(tmp_path):
    model, params = _tiny()
    save_quantized(tmp_path / "ck", params, recipe="fp", model=model)
    partial = tmp_path / ".ck.tmp-999999-dead"
    (tmp_path / "ck").rename(partial)
    (partial / "eqjax.json").unlink()
    assert is_partial_checkpoint(partial)
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        load_quantized(partial)


def test_half_floats_round_trip(tmp_path):
    """``+f16`` leaves stay 16-bit on disk (kind "half" in the manifest) and reload as HalfFloats."""
    from eqjax.core.qarray import HalfFloat

    model = Model(LlamaConfig(vocab=64, hidden=64, intermediate=96, n_layers=1, n_heads=2, n_kv_heads=1))
    params = model.init_params(jax.random.PRNGKey(1))
    q = quantize(params, get_recipe("w4g128-rtn+emb-int8+f16"), model=model)
    save_quantized(tmp_path / "ck", q, recipe="w4g128-rtn+emb-int8+f16", model=model)
    manifest = json.loads((tmp_path / "ck" / "eqjax.json").read_text())
    assert manifest["leaves"]["final_norm/scale"] == {"kind": "half", "shape": [64], "dtype": "float32"}
    q2, _ = load_quantized(tmp_path / "ck", model=model)
    h = q2["final_norm"]["scale"]
    assert isinstance(h, HalfFloat) and h.values.dtype == jnp.float16
    toks = jnp.arange(12, dtype=jnp.int32).reshape(1, 12) % 64
    np.testing.assert_array_equal(np.asarray(model.apply(q, toks)[0]), np.asarray(model.apply(q2, toks)[0]))
    manifest["leaves"]["final_norm/scale"]["dtype"] = "int8"  # a damaged manifest is named, not a traceback
    (tmp_path / "ck" / "eqjax.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"final_norm/scale.*wider than float16"):
        load_quantized(tmp_path / "ck", verify=False)


def test_a_manifest_without_its_file_table_is_refused(tmp_path):
    """Stripping the file table (or one file's entry) cannot turn verification off."""
    model, params = _tiny()
    save_quantized(tmp_path / "ck", params, recipe="fp", model=model)
    mpath = tmp_path / "ck" / "eqjax.json"
    m = json.loads(mpath.read_text())
    one = next(iter(m["files"]))
    mpath.write_text(json.dumps({**m, "files": {k: v for k, v in m["files"].items() if k != one}}))
    with pytest.raises(CheckpointError, match=r"not in its manifest"):
        load_quantized(tmp_path / "ck")
    mpath.write_text(json.dumps({k: v for k, v in m.items() if k != "files"}))
    with pytest.raises(CheckpointError, match=r"without a file table \(.*eqjax\.json: files\)"):
        load_quantized(tmp_path / "ck")
    load_quantized(tmp_path / "ck", verify=False)  # asked for explicitly


def test_save_refuses_what_is_not_params(tmp_path):
    class Holder:  # what quantize_model returns for an NNX module: a model with .params
        params = {"a": jnp.ones(2)}

    with pytest.raises(InputError, match=r"save_quantized: params\): expected a nested dict.*Holder.*\.params"):
        save_quantized(tmp_path / "ck", Holder())
    with pytest.raises(InputError, match=r"params a/b\): expected an array, found str"):
        save_quantized(tmp_path / "ck", {"a": {"b": "x"}})
    assert not (tmp_path / "ck").exists()


def test_save_marks_the_checkpoint_and_never_replaces_a_user_directory(tmp_path):
    from eqjax.io.atomic import artifact_kind

    model, params = _tiny()
    save_quantized(tmp_path / "ck", params, recipe="fp", model=model)
    assert artifact_kind(tmp_path / "ck") == "checkpoint"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(OutputError, match=r"cannot replace.*'notes\.txt'"):
        save_quantized(tmp_path / "mine", params, overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_full_disk_is_one_line_and_keeps_the_old_checkpoint(tmp_path):
    """A file-size limit (SIGXFSZ ignored, so writes fail with EFBIG) mid-save: one RuntimeFailure, no traceback
    on stderr from Orbax's threads, and the previous checkpoint loads."""
    import resource
    import signal
    import subprocess
    import sys

    model, params = _tiny()
    save_quantized(tmp_path / "ck", params, recipe="fp", model=model)
    code = ("import sys, jax.numpy as jnp, numpy as np\nfrom eqjax.io.orbax import save_quantized\n"
            "try:\n    save_quantized(sys.argv[1], {'a': jnp.asarray(np.random.rand(300, 1000), jnp.float32)}, overwrite=True)\n"
            "except Exception as e:\n    print(f'{type(e).__name__}: {e}', file=sys.stderr)\n")

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))

    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], capture_output=True, text=True,
                       preexec_fn=limit, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert "Traceback" not in r.stderr and "ERROR:absl" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "RuntimeFailure" in r.stderr
    assert "File too large" in r.stderr
    _, m = load_quantized(tmp_path / "ck", model=model)
    assert m["recipe"] == "fp" and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
