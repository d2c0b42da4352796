"""Initializers spilled to disk as a graph is built: the same model as one built in memory, nothing the graph
dropped in the package, large tensors at mappable offsets, no spill file left behind."""

import jax
import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from eqjax.export.package import build_decoder, export_package
from eqjax.export.tensors import DATA_FILE, TensorStore, external_info
from eqjax.io.tokenizer import Tokenizer, bytes_to_unicode
from eqjax.methods.rtn import RTN
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import weight_rule
from eqjax.recipes.types import Recipe

DTYPES = (np.float32, np.float16, np.int8, np.uint8, np.int64, ml_dtypes.bfloat16)


def _arrays(rng):
    out = {}
    for k, dt in enumerate(DTYPES):
        for shape in ((3,), (64, 33), (1 << 19, 3)):  # inline, spilled, spilled >= 1 MiB
            x = rng.standard_normal(shape) * 50
            out[f"t{k}_{len(out)}"] = x.astype(dt)
    out["empty"] = np.zeros((0, 4), np.float32)
    out["scalar"] = np.asarray(7, np.int64)  # stays a scalar (Range and friends take only scalars)
    return out


def _model(tensors):
    g = helper.make_graph([], "g", [], [], initializer=tensors)
    return helper.make_model(g)


@pytest.mark.parametrize("spill", [True, False])
def test_saved_initializers_are_the_arrays_made(tmp_path, spill):
    arrays = _arrays(np.random.default_rng(0))
    store = TensorStore(tmp_path / "x.spill" if spill else None)
    made = {n: store.tensor(n, a) for n, a in arrays.items()}
    for n, t in made.items():  # read back while building (what graph passes do)
        got = np.asarray(store.array(t))
        assert got.shape == arrays[n].shape
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), arrays[n].reshape(-1).view(np.uint8))
    keep = [n for k, n in enumerate(made) if k % 3 != 1]  # the graph drops some: they must not be written
    store.save(_model([made[n] for n in keep]), tmp_path / "model.onnx")
    assert not (tmp_path / "x.spill").exists()
    loaded = onnx.load(str(tmp_path / "model.onnx"))
    assert [t.name for t in loaded.graph.initializer] == keep
    for t in loaded.graph.initializer:
        got = numpy_helper.to_array(t)
        assert got.shape == arrays[t.name].shape and got.dtype == arrays[t.name].dtype, t.name
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), arrays[t.name].reshape(-1).view(np.uint8))
    kept_bytes = sum(arrays[n].nbytes for n in keep if arrays[n].nbytes >= 1024)
    size = (tmp_path / DATA_FILE).stat().st_size
    assert kept_bytes <= size < kept_bytes + 1 << 17  # at most the alignment gaps beside the kept bytes


def test_large_tensors_start_at_mappable_offsets(tmp_path):
    store = TensorStore(tmp_path / "x.spill")
    ts = [store.tensor(f"a{k}", np.ones((k * 1000 + 1,), np.float32)) for k in range(1, 400, 37)]
    store.save(_model(ts), tmp_path / "model.onnx")
    for t in onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.initializer:
        info = external_info(t)
        align = 1 << 16 if int(info["length"]) >= 1 << 20 else 64
        assert int(info["offset"]) % align == 0, (t.name, info)


def test_a_graph_built_through_the_spill_file_equals_one_built_in_memory(tmp_path):
    model = Model(LlamaConfig(vocab=256, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2))
    params = model.init_params(jax.random.key(3), std=0.1)
    qp = quantize(params, Recipe("w4g32", (RTN((weight_rule(4, symmetric=False, group=32),)),)), model=model)
    mem, info = build_decoder(model, qp, accuracy_level=0)
    assert info["packed_matmuls"] > 0  # the packing pass ran on spilled initializers
    tok = Tokenizer(list(bytes_to_unicode().values()), [], bos_id=0, eos_id=255)
    export_package(model, qp, tmp_path / "pkg", tokenizer=tok)
    disk = onnx.load(str(tmp_path / "pkg" / "model.onnx"))
    assert sorted(p.name for p in (tmp_path / "pkg").iterdir() if "spill" in p.name) == []
    assert [n.SerializeToString() for n in disk.graph.node] == [n.SerializeToString() for n in mem.graph.node]
    a = {t.name: numpy_helper.to_array(t) for t in mem.graph.initializer}
    b = {t.name: numpy_helper.to_array(t) for t in disk.graph.initializer}
    assert a.keys() == b.keys()
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)
