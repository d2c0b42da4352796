"""An ONNX graph under construction: unique names, shared constants, initializers, symbolic dimensions.

:class:`Graph` accumulates ``NodeProto`` s and initializers for the walker (:mod:`eqjax.export.walker`),
the quantized-op lowering (:mod:`eqjax.export.qlower`) and the fusions (:mod:`eqjax.export.fusions`).
Symbolic dimensions of a shape-polymorphic trace (``jax.export.symbolic_shape``: batch, sequence, cache
length) become int64 tensors computed from the graph inputs that carry them (:meth:`Graph.dim`):
``Shape -> Gather`` once per variable, then ``Add`` / ``Mul`` / ``Div`` for expressions such as ``t + 1``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from eqjax.core.errors import InputError
from eqjax.export.tensors import TensorStore

__all__ = ["ExportError", "Graph", "OPSET", "MS_DOMAIN", "onnx_dtype", "topo_sort"]

OPSET = 21
MS_DOMAIN = "com.microsoft"


class ExportError(InputError):
    """The model, or a layer's quantization, cannot be expressed in the ONNX graph (names what and why)."""


def onnx_dtype(dtype: Any) -> int:
    """The ``TensorProto`` element type of a numpy / JAX dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


class _Dim:
    """A symbolic dimension's value in the graph: an int64 tensor of shape [1] (arithmetic emits nodes)."""

    def __init__(self, g: "Graph", name: str) -> None:
        self.g, self.name = g, name

    def _bin(self, op: str, other: Any, swap: bool = False) -> "_Dim":
        o = other.name if isinstance(other, _Dim) else self.g.const([int(other)], np.int64)
        a, b = (o, self.name) if swap else (self.name, o)
        return _Dim(self.g, self.g.op(op, [a, b], hint="dim"))

    def __add__(self, o): return self._bin("Add", o)
    def __radd__(self, o): return self._bin("Add", o, True)
    def __mul__(self, o): return self._bin("Mul", o)
    def __rmul__(self, o): return self._bin("Mul", o, True)
    def __sub__(self, o): return self._bin("Sub", o)
    def __rsub__(self, o): return self._bin("Sub", o, True)
    def __floordiv__(self, o): return self._bin("Div", o)  # dims are non-negative: Div truncates = floors
    def __mod__(self, o): return self._bin("Mod", o)
    def __neg__(self): return self._bin("Mul", -1)


class Graph:
    """Nodes and initializers of one ONNX graph, with unique names.

    Attributes:
      nodes, inits: what :func:`finish` assembles; inputs / outputs: ``ValueInfoProto`` s.
      dim_sources: symbolic variable name -> (graph tensor, axis) that carries it.
      store: where initializers are written as they are made (default: inside the graph).
    """

    def __init__(self, dim_sources: Mapping[str, tuple[str, int]] | None = None, *,
                 store: TensorStore | None = None) -> None:
        self.store = store if store is not None else TensorStore()
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.dim_sources = dict(dim_sources or {})
        self._n = 0
        self._consts: dict[tuple, str] = {}
        self._dims: dict[Any, str] = {}
        self._cache: dict[Any, Any] = {}
        self.used_ms = False

    # -------------------------------------------------------------------------------- names, constants
    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def init(self, hint: str, array: np.ndarray, *, exact_name: bool = False) -> str:
        name = hint if exact_name else self.name(hint)
        self.inits.append(self.store.tensor(name, array))
        return name

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        """A shared constant initializer (scalars, shape vectors, small tables)."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init("const", arr)
        return self._consts[key]

    def memo(self, key: Any, make: Any) -> Any:
        """``make()`` once per ``key`` (shared initializers, e.g. a tied table used twice)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def op(self, op_type: str, inputs: Sequence[str], *, n_out: int = 1, domain: str | None = None,
           hint: str | None = None, outputs: Sequence[str] | None = None, **attrs: Any) -> Any:
        outs = list(outputs) if outputs is not None else [self.name(hint or op_type.lower()) for _ in range(n_out)]
        if domain == MS_DOMAIN:
            self.used_ms = True
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name("n_" + op_type),
                                           domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    # -------------------------------------------------------------------------------- dimensions
    def dim(self, d: Any) -> str:
        """int64 tensor [1] holding dimension ``d`` (an int or a ``jax.export`` symbolic expression)."""
        if isinstance(d, (int, np.integer)):
            return self.const([int(d)], np.int64)
        key = str(d)
        if key not in self._dims:
            env = {}
            for var in d._get_vars():
                if var not in self.dim_sources:
                    raise ExportError(f"symbolic dimension {var!r} is carried by no graph input")
                env[var] = _Dim(self, self._var(var))
            val = d._evaluate(env)
            self._dims[key] = val.name if isinstance(val, _Dim) else self.const([int(val)], np.int64)
        return self._dims[key]

    def _var(self, var: str) -> str:
        key = ("var", var)
        if key not in self._dims:
            src, axis = self.dim_sources[var]
            self._dims[key] = self.op("Slice", [self.op("Shape", [src]), self.const([axis], np.int64),
                                                self.const([axis + 1], np.int64)], hint=f"dim_{var}")
        return self._dims[key]

    def shape(self, dims: Sequence[Any]) -> str:
        """int64 shape vector for ``dims`` (ints and symbolic expressions)."""
        dims = tuple(dims)
        if all(isinstance(d, (int, np.integer)) for d in dims):
            return self.const([int(d) for d in dims], np.int64)
        key = ("shape", tuple(str(d) for d in dims))
        if key not in self._dims:
            self._dims[key] = self.op("Concat", [self.dim(d) for d in dims], axis=0, hint="shape")
        return self._dims[key]

    def scalar_dim(self, d: Any, dtype: Any = np.int64) -> str:
        """Dimension ``d`` as a scalar tensor of ``dtype``."""
        s = self.op("Squeeze", [self.dim(d), self.const([0], np.int64)])
        return s if np.dtype(dtype) == np.int64 else self.op("Cast", [s], to=onnx_dtype(dtype))

    # -------------------------------------------------------------------------------- model
    def finish(self, name: str, *, ir_version: int = 10) -> onnx.ModelProto:
        graph = helper.make_graph(topo_sort(self.nodes, [i.name for i in self.inputs] + [t.name for t in self.inits]),
                                  name, self.inputs, self.outputs, initializer=self.inits)
        opsets = [helper.make_opsetid("", OPSET)]
        if self.used_ms:
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        m = helper.make_model(graph, opset_imports=opsets, producer_name="eqjax")
        m.ir_version = ir_version
        return m


def topo_sort(nodes: Sequence[onnx.NodeProto], available: Sequence[str]) -> list[onnx.NodeProto]:
    """``nodes`` in an order where every input is produced before it is read (stable otherwise)."""
    have = set(available) | {""}
    out, pending = [], list(nodes)
    while pending:
        rest = []
        for n in pending:
            if all(i in have for i in n.input):
                out.append(n)
                have.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            missing = sorted({i for n in rest for i in n.input if i not in have})[:5]
            raise ExportError(f"internal: the ONNX graph reads undefined tensors {missing}")
        pending = rest
    return out


def value_info(name: str, dtype: Any, dims: Sequence[Any]) -> onnx.ValueInfoProto:
    """A graph input/output description (symbolic dims by name)."""
    shape = [d if isinstance(d, str) else (str(d) if not isinstance(d, (int, np.integer)) else int(d)) for d in dims]
    return helper.make_tensor_value_info(name, onnx_dtype(dtype) if not isinstance(dtype, int) else dtype, shape)


TensorProto = TensorProto
