"""ONNX export: the public entry points, and ``eqjax export-onnx``.

There is no hand-written model graph here: every export traces the JAX function eqjax runs
(:func:`eqjax.core.program.trace`) and lowers its program with :mod:`eqjax.export.walker`:

* :func:`eqjax.export.package.export_package`: the edge package for onnxruntime-genai (an eqjax
  :class:`~eqjax.models.Model`'s KV-cache decode step, fused attention / RoPE / norms, tokenizer files);
* :func:`build_model`: the same decoder graph as a ``ModelProto`` (tests, benchmarks);
* :func:`export_function`: any ``fn(params, *args)`` (a user's Flax ``module.apply``, an NNX module called
  functionally, a plain JAX function) with its quantized params, as a bare graph whose inputs are the
  array arguments; dimensions given as ``jax.export.symbolic_shape`` stay dynamic in the graph;
* :func:`linear_graph`: one linear layer (``eqjax.core.linear.linear``), for per-layer checks.

Modules: ``graph`` (builder, symbolic dims), ``walker`` (primitive lowerings), ``qlower`` (quantized
ops: MatMulNBits / MatMulInteger / DequantizeLinear / GatherBlockQuantized), ``fusions``
(GroupQueryAttention, RotaryEmbedding, SkipSimplifiedLayerNormalization), ``pack`` (sibling
MatMulNBits), ``package`` (directory writer), ``runtime`` (sessions, plain loop, self-check).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from eqjax.core.analysis import analyze
from eqjax.core.linear import linear
from eqjax.core.program import trace
from eqjax.export.fusions import find_fusions
from eqjax.export.graph import OPSET, ExportError, Graph, value_info
from eqjax.export.package import build_decoder
from eqjax.export.qlower import W8A8_ZERO_POINT, export_params, w8a8_weight_codes
from eqjax.export.runtime import Runner, make_session, perplexity
from eqjax.export.walker import Walker
from eqjax.io.atomic import atomic_directory

__all__ = ["ExportError", "OPSET", "W8A8_ZERO_POINT", "w8a8_weight_codes", "make_session", "build_model",
           "export_function", "function_graph", "linear_graph", "onnx_logits", "onnx_perplexity"]


def build_model(model: Any, params: Mapping[str, Any], *, accuracy_level: int | None = 0, fuse: bool = True,
                context_length: int | None = None) -> onnx.ModelProto:
    """The decoder graph of ``model`` with ``params`` (see :mod:`eqjax.export.package` for its I/O).

    ``accuracy_level`` 0 (default here): MatMulNBits computes with float activations, i.e. exactly what
    eqjax computes. The graph always has the KV cache.
    """

    return build_decoder(model, params, accuracy_level=accuracy_level, context_length=context_length, fuse=fuse)[0]


def function_graph(fn: Any, params: Any, args: Sequence[Any], *, input_names: Sequence[str] | None = None,
                   output_names: Sequence[str] | None = None, accuracy_level: int | None = 0,
                   fuse: bool = True) -> onnx.ModelProto:
    """A bare graph of ``fn(params, *args)``: one graph input per array argument (arrays or
    ``jax.ShapeDtypeStruct`` s, whose ``jax.export.symbolic_shape`` dimensions stay dynamic), one output
    per output leaf; quantized params lowered as in the package."""
    import jax


    traced, by_path = export_params(params)
    prog = trace(fn, traced, tuple(args), what="function")
    an = analyze(prog)
    names = list(input_names or [f"input_{i}" for i in range(len(prog.args))])
    if len(names) != len(prog.args):
        raise ExportError(f"{len(names)} input names for {len(prog.args)} array arguments")
    sources: dict[str, tuple[str, int]] = {}
    g = Graph()
    inputs = {}
    for vid, nm in zip(prog.args, names):
        aval = prog.avals[vid]
        dims = []
        for ax, d in enumerate(aval.shape):
            if isinstance(d, (int, np.integer)):
                dims.append(int(d))
            else:
                for var in d._get_vars():
                    sources.setdefault(var, (nm, ax)) if str(d) == var else None
                dims.append(str(d))
        g.inputs.append(value_info(nm, aval.dtype, dims))
        inputs[vid] = nm
    g.dim_sources = sources
    w = Walker(prog, an, by_path, g, accuracy_level=accuracy_level,
               fused=find_fusions(prog, None, norms=fuse))
    outs = w.run(inputs)
    onames = list(output_names or (["y"] if len(outs) == 1 else [f"output_{i}" for i in range(len(outs))]))
    for ref, val, nm in zip(prog.outputs, outs, onames):
        g.op("Identity", [w.name(val)], outputs=[nm])
        aval = jax.typeof(ref.value) if not isinstance(ref, int) else prog.avals[ref]
        g.outputs.append(value_info(nm, aval.dtype, [d if isinstance(d, (int, np.integer)) else str(d)
                                                     for d in aval.shape]))
    return g.finish("eqjax_function")


def export_function(fn: Any, params: Any, args: Sequence[Any], path: str | os.PathLike[str], *,
                    overwrite: bool = True, **kw: Any) -> pathlib.Path:
    """:func:`function_graph` checked and written atomically to ``path`` (weights as external data)."""

    m = function_graph(fn, params, args, **kw)
    onnx.checker.check_model(m)
    path = pathlib.Path(path)
    with atomic_directory(path, overwrite=overwrite) as tmp:
        onnx.save_model(m, str(pathlib.Path(tmp) / "model.onnx"), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    return path / "model.onnx"


def linear_graph(layer: Mapping[str, Any], *, path: str = "linear", accuracy_level: int | None = 0,
                 batch: int | None = None) -> onnx.ModelProto:
    """One ``eqjax.core.linear.linear`` layer as a graph ``x [M, K] -> y [M, N]`` (M dynamic)."""
    import jax
    from jax import export as jexport


    K = int(layer["kernel"].shape[0])
    (m,) = jexport.symbolic_shape("m") if batch is None else (batch,)
    params = {path: dict(layer)}
    return function_graph(lambda p, x: linear(x, p[path]), params, (jax.ShapeDtypeStruct((m, K), np.float32),),
                          input_names=["x"], accuracy_level=accuracy_level)


def onnx_logits(session: Any, tokens: np.ndarray) -> np.ndarray:
    """Prefill logits ``[B, T, V]`` of a decoder graph (empty cache)."""
    return Runner(session).logits(np.asarray(tokens), cache="buffer")  # genai's shared buffer: fused and fallback graphs


def onnx_perplexity(session: Any, windows: np.ndarray) -> float:
    """Perplexity of a decoder graph over token windows ``[n, T]``."""
    return perplexity(Runner(session), windows)


