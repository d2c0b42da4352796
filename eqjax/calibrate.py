"""Streaming, layer-by-layer calibration over a :class:`~eqjax.models.Model`.

The calibration windows are embedded once (in batches); then, for each block in order, the
method sees a :class:`LayerCalibration` (the block's input hidden states and helpers that run the
block while capturing the inputs of its linear layers), returns the (possibly transformed or
quantized) block params, and the hidden states advance through the returned block. Host memory
stays at about the model plus one layer's hidden states ``[n, T, D]`` plus the statistics.

Capturing linear inputs needs nothing from the models: every model calls
:func:`eqjax.linear.linear`; while the block is *traced* (only then) the ``linear`` the model modules
imported is swapped for a recorder that looks the layer's kernel up (by object identity in the traced
param tree) and returns its input as an extra output of the jitted function. Linears that read the
very same input array (q/k/v, gate/up) share one capture, so their statistics are computed once.

Statistics are named associative reductions (:class:`Statistic`: ``init``, ``update``, ``merge``
with ``merge`` in ``{"max", "min", "sum"}`` so distributed code can map them to pmax/pmin/psum, and
``finalize``). ``update`` takes per-token weights: the first ``sink_tokens`` positions of every window
(the attention-sink token carries activations ~1e5x the median in a few SmolLM2 layers and dominates
X^T X there) get ``sink_weight`` (0 excludes them; max/min ignore zero-weight tokens). The driver's
default keeps them (``sink_tokens=0``); each method picks its own default from measurements on
SmolLM2-135M: GPTQ keeps the first token (excluding it: ppl 28.30 vs 24.28 kept, RTN 25.28, FP 19.92),
AWQ keeps it too (23.40 kept vs 23.54 excluded; see :mod:`eqjax.methods.awq`).

Example::

    stats = collect_statistics(model, params, windows, {"absmax": absmax(), "xtx": xtx()})
    stats["layers_3"]["attn/q_proj"]["absmax"]        # [in] float32
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from typing import Any, Callable, Iterator, Literal, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import eqjax.linear  # noqa: F401 - the module (eqjax.linear the attribute may be the function)
from eqjax.pytree import Params, flatten, get_path, is_leaf
from eqjax.recipe import RecipeError

__all__ = [
    "CalibrationError",
    "Statistic",
    "MERGE_FNS",
    "merge",
    "absmax",
    "minimum",
    "maximum",
    "abs_sum",
    "abs_mean",
    "xtx",
    "count",
    "token_weights",
    "check_windows",
    "linear_paths",
    "capture_linear_inputs",
    "embed_windows",
    "LayerCalibration",
    "run_layerwise",
    "collect_statistics",
]


class CalibrationError(RecipeError):
    """Calibration cannot run: no windows, windows too short, no linear layers, ..."""


# --------------------------------------------------------------------------------------------
# Statistics: named associative reductions, pure functions of arrays.
# --------------------------------------------------------------------------------------------

MERGE_FNS: dict[str, Callable[[Any, Any], Any]] = {"max": jnp.maximum, "min": jnp.minimum, "sum": jnp.add}


class Statistic(NamedTuple):
    """An associative reduction over tokens of a ``[N, F]`` activation matrix.

    Attributes:
      name: what it is (for messages).
      init: ``n_features -> state`` (a pytree of float32 arrays; the identity of ``merge``).
      update: ``(state, x [N, F], w [N]) -> state``; ``w >= 0`` are per-token weights (0 = ignore).
      merge: ``"max"``, ``"min"`` or ``"sum"``, applied leaf-wise to two states
        (``update(s, concat(a, b)) == merge(update(s, a), update(init, b))``).
      finalize: ``state -> value``.
    """

    name: str
    init: Callable[[int], Any]
    update: Callable[[Any, jax.Array, jax.Array], Any]
    merge: Literal["max", "min", "sum"]
    finalize: Callable[[Any], Any] = lambda s: s


def merge(stat: Statistic, a: Any, b: Any) -> Any:
    """Merge two states of ``stat`` (leaf-wise max/min/sum)."""
    fn = MERGE_FNS[stat.merge]
    return jax.tree.map(fn, a, b)


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


@functools.cache
def absmax() -> Statistic:
    """Per-channel ``max |x|`` over tokens with weight > 0 (float32 ``[F]``)."""
    return Statistic(
        "absmax",
        lambda f: jnp.zeros((f,), jnp.float32),
        lambda s, x, w: jnp.maximum(s, jnp.max(jnp.where(w[:, None] > 0, jnp.abs(_f32(x)), 0.0), axis=0)),
        "max",
    )


@functools.cache
def maximum() -> Statistic:
    """Per-channel ``max x`` (``-inf`` before any token)."""
    return Statistic(
        "max",
        lambda f: jnp.full((f,), -jnp.inf, jnp.float32),
        lambda s, x, w: jnp.maximum(s, jnp.max(jnp.where(w[:, None] > 0, _f32(x), -jnp.inf), axis=0)),
        "max",
    )


@functools.cache
def minimum() -> Statistic:
    """Per-channel ``min x`` (``+inf`` before any token)."""
    return Statistic(
        "min",
        lambda f: jnp.full((f,), jnp.inf, jnp.float32),
        lambda s, x, w: jnp.minimum(s, jnp.min(jnp.where(w[:, None] > 0, _f32(x), jnp.inf), axis=0)),
        "min",
    )


@functools.cache
def abs_sum() -> Statistic:
    """Per-channel weighted ``(sum w|x|, sum w)``; finalizes to the weighted mean ``|x|`` (AWQ's x_max)."""
    return Statistic(
        "abs_mean",
        lambda f: (jnp.zeros((f,), jnp.float32), jnp.zeros((), jnp.float32)),
        lambda s, x, w: (s[0] + jnp.einsum("n,nf->f", w, jnp.abs(_f32(x)), precision="highest"), s[1] + jnp.sum(w)),
        "sum",
        lambda s: s[0] / jnp.maximum(s[1], 1e-30),
    )


abs_mean = abs_sum


@functools.cache
def xtx() -> Statistic:
    """Weighted second moment ``(sum w x x^T [F, F], sum w)`` in float32; finalizes to ``X^T W X / sum w``.

    GPTQ's Hessian is ``2 *`` this.
    """
    return Statistic(
        "xtx",
        lambda f: (jnp.zeros((f, f), jnp.float32), jnp.zeros((), jnp.float32)),
        lambda s, x, w: (
            s[0] + jnp.einsum("nf,ng->fg", _f32(x) * w[:, None], _f32(x), precision="highest"),
            s[1] + jnp.sum(w),
        ),
        "sum",
        lambda s: s[0] / jnp.maximum(s[1], 1e-30),
    )


@functools.cache
def count() -> Statistic:
    """Weighted token count ``sum w`` (float32 scalar)."""
    return Statistic("count", lambda f: jnp.zeros((), jnp.float32), lambda s, x, w: s + jnp.sum(w), "sum")


# --------------------------------------------------------------------------------------------
# Windows and weights.
# --------------------------------------------------------------------------------------------


def check_windows(windows: Any, *, sink_tokens: int = 0, sink_weight: float = 0.0, what: str = "calibration") -> np.ndarray:
    """int32 ``[n, T]`` windows, or a :class:`CalibrationError` saying what is wrong."""
    if windows is None:
        raise CalibrationError(f"{what}: no calibration windows given (need int32 token windows [n, T])")
    w = np.asarray(windows)
    if w.ndim != 2 or w.size == 0 or w.shape[0] == 0:
        raise CalibrationError(f"{what}: calibration windows must be a non-empty [n, T] token array, got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.integer):
        raise CalibrationError(f"{what}: calibration windows must hold integer token ids, got dtype {w.dtype}")
    if sink_tokens < 0:
        raise CalibrationError(f"{what}: sink_tokens must be >= 0, got {sink_tokens}")
    if sink_weight == 0.0 and w.shape[1] <= sink_tokens:
        raise CalibrationError(
            f"{what}: calibration windows of {w.shape[1]} tokens are too short: the first {sink_tokens} "
            f"position(s) of each window are excluded from statistics, so windows need > {sink_tokens} tokens"
        )
    return w.astype(np.int32)


def token_weights(length: int, sink_tokens: int = 0, sink_weight: float = 0.0) -> jax.Array:
    """Per-position weights ``[T]``: ``sink_weight`` for the first ``sink_tokens`` positions, else 1."""
    w = np.ones((length,), np.float32)
    w[: min(sink_tokens, length)] = sink_weight
    return jnp.asarray(w)


# --------------------------------------------------------------------------------------------
# Capturing linear inputs.
# --------------------------------------------------------------------------------------------


def linear_paths(layer_params: Params) -> tuple[str, ...]:
    """Paths (inside a block) of every linear layer, i.e. of every ``.../kernel``, without ``/kernel``."""
    return tuple(p[: -len("/kernel")] for p, _ in flatten(layer_params) if p.endswith("/kernel"))


def _real_linear() -> Callable:
    return sys.modules["eqjax.linear"].linear


def _model_modules_using_linear() -> list[Any]:
    real = _real_linear()
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None and name.startswith("eqjax.models") and getattr(m, "linear", None) is real
    ]


@contextlib.contextmanager
def _recording(table: Mapping[int, str], record: dict[str, jax.Array]) -> Iterator[None]:
    """While active, model modules' ``linear`` records ``x`` for kernels whose id is in ``table``."""
    real = _real_linear()
    modules = _model_modules_using_linear()

    def recording_linear(x: jax.Array, layer: Mapping[str, Any], **kw: Any) -> jax.Array:
        path = table.get(id(layer.get("kernel"))) if isinstance(layer, Mapping) else None
        if path is not None and path not in record:
            record[path] = x
        return real(x, layer, **kw)

    for m in modules:
        m.linear = recording_linear
    try:
        yield
    finally:
        for m in modules:
            m.linear = real


def capture_linear_inputs(
    model: Any, layer_params: Params, h: jax.Array, positions: jax.Array, *, layer_index: int
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Run one block and return ``(h_out, {linear path: its input [..., in]})``.

    Traceable (use it inside ``jax.jit``); linears never called (none in a standard block) are absent.
    """
    table = {id(get_path(layer_params, p + "/kernel")): p for p in linear_paths(layer_params)}
    record: dict[str, jax.Array] = {}
    with _recording(table, record):
        out, _ = model.block(layer_params, h, positions, layer_index=layer_index)
    return out, record  # a linear the block never called is absent; callers check what they need


def _shared_inputs(record: Mapping[str, jax.Array]) -> list[tuple[tuple[str, ...], jax.Array]]:
    """Group paths whose captured input is the very same array: ``[(paths, x)]``."""
    groups: dict[int, tuple[list[str], jax.Array]] = {}
    for p, x in record.items():
        groups.setdefault(id(x), ([], x))[0].append(p)
    return [(tuple(ps), x) for ps, x in groups.values()]


# --------------------------------------------------------------------------------------------
# The layer-wise driver.
# --------------------------------------------------------------------------------------------


def _batches(n: int, batch_size: int) -> Iterator[slice]:
    for s in range(0, n, batch_size):
        yield slice(s, min(s + batch_size, n))


def embed_windows(model: Any, params: Params, windows: np.ndarray, *, batch_size: int = 8) -> jax.Array:
    """Hidden states ``[n, T, D]`` entering the first block, embedded in batches."""
    n, T = windows.shape
    f = jax.jit(lambda p, t: model.embed(p, t, model.positions(*t.shape)))
    parts = [f(params, jnp.asarray(windows[sl])) for sl in _batches(n, batch_size)]
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


@dataclasses.dataclass
class LayerCalibration:
    """One block's calibration view: its input hidden states and helpers to run it.

    Attributes:
      model: the model facade.
      layer_name, layer_index: which block.
      inputs: the block's input hidden states ``[n, T, D]`` (from the already-processed blocks).
      batch_size: windows per jitted call.
      weights: per-position statistic weights ``[T]`` (see :func:`token_weights`).
    """

    model: Any
    layer_name: str
    layer_index: int
    inputs: jax.Array
    batch_size: int
    weights: jax.Array

    @property
    def n_windows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def window_length(self) -> int:
        return int(self.inputs.shape[1])

    def positions(self, batch: int) -> jax.Array:
        return self.model.positions(batch, self.window_length)

    def batches(self) -> Iterator[slice]:
        return _batches(self.n_windows, self.batch_size)

    def _padded(self, h: jax.Array, sl: slice) -> tuple[jax.Array, int]:
        """Windows ``sl`` of ``h`` zero-padded to ``batch_size`` (one compiled shape per block)."""
        part = h[sl]
        b = part.shape[0]
        if b < self.batch_size:
            part = jnp.concatenate([part, jnp.zeros((self.batch_size - b,) + part.shape[1:], part.dtype)], axis=0)
        return part, b

    def outputs(self, layer_params: Params, inputs: jax.Array | None = None) -> jax.Array:
        """The block's outputs ``[n, T, D]`` for ``layer_params`` (on ``inputs``, default the block inputs)."""
        h = self.inputs if inputs is None else inputs
        f = _block_jit(self.model, self.layer_index)
        pos = self.positions(self.batch_size)
        parts = []
        for sl in _batches(h.shape[0], self.batch_size):
            x, b = self._padded(h, sl)
            parts.append(f(layer_params, x, pos)[:b])
        return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]

    def linear_inputs(self, layer_params: Params, sl: slice) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``(block output, {linear path: input [b, T, in]})`` for the windows ``sl``."""
        f = _capture_jit(self.model, self.layer_index)
        x, b = self._padded(self.inputs, sl)
        out, rec = f(layer_params, x, self.positions(self.batch_size))
        return out[:b], {p: v[:b] for p, v in rec.items()}

    def statistics(
        self,
        stats: Mapping[str, Statistic],
        layer_params: Params,
        *,
        linears: tuple[str, ...] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Finalized statistics of every linear's input: ``{path: {stat name: value}}``.

        ``linears`` restricts the paths (default: every linear of the block). Linears reading the same
        input share one computation (and the same values). Tokens are weighted by ``weights``.
        """
        wanted = tuple(linears) if linears is not None else linear_paths(layer_params)
        items = tuple(stats.items())
        f = _stats_jit(self.model, self.layer_index, items, wanted)
        states = {}
        for p in wanted:
            k_in = get_path(layer_params, p + "/kernel").shape[0]
            states[p] = {n: st.init(k_in) for n, st in items}
        pos = self.positions(self.batch_size)
        for sl in self.batches():
            x, b = self._padded(self.inputs, sl)
            valid = (jnp.arange(self.batch_size) < b).astype(jnp.float32)
            w = valid[:, None] * self.weights[None, :]
            states = f(layer_params, x, pos, w, states)
        missing = [p for p in wanted if p not in states]
        if missing:
            raise CalibrationError(f"{self.layer_name}: the block never called linear(s) {missing}")
        return {p: {n: st.finalize(states[p][n]) for n, st in items} for p in wanted}


@functools.lru_cache(maxsize=64)
def _block_jit(model: Any, layer_index: int) -> Callable:
    return jax.jit(lambda lp, h, pos: model.block(lp, h, pos, layer_index=layer_index)[0])


@functools.lru_cache(maxsize=64)
def _capture_jit(model: Any, layer_index: int) -> Callable:
    return jax.jit(lambda lp, h, pos: capture_linear_inputs(model, lp, h, pos, layer_index=layer_index))


@functools.lru_cache(maxsize=64)
def _stats_jit(model: Any, layer_index: int, items: tuple, wanted: tuple[str, ...]) -> Callable:
    def fn(lp, h, pos, w, states):
        _, rec = capture_linear_inputs(model, lp, h, pos, layer_index=layer_index)
        rec = {p: x for p, x in rec.items() if p in wanted}
        out = {}
        for paths, x in _shared_inputs(rec):
            x2 = x.reshape(-1, x.shape[-1])
            wt = w.reshape(-1)
            st = states[paths[0]]
            new = {n: stat.update(st[n], x2, wt) for n, stat in items}
            for p in paths:
                out[p] = new
        return out

    return jax.jit(fn)


def run_layerwise(
    model: Any,
    params: Params,
    windows: Any,
    per_layer_fn: Callable[[str, Params, LayerCalibration], Params],
    *,
    batch_size: int = 8,
    progress: bool = False,
    sink_tokens: int = 0,
    sink_weight: float = 0.0,
    advance: Literal["new", "original"] = "new",
    desc: str = "calibrate",
) -> Params:
    """Apply ``per_layer_fn`` block by block, streaming the calibration windows through the model.

    Args:
      model: the :class:`~eqjax.models.Model` facade (``embed``, ``block``, ``layer_names``).
      params: the full param tree (blocks under ``model.layer_names``).
      windows: int32 token windows ``[n, T]``.
      per_layer_fn: ``(layer_name, layer_params, cal) -> new_layer_params``; ``cal`` is a
        :class:`LayerCalibration` whose ``inputs`` come from the already-processed blocks.
      batch_size: windows per jitted call.
      progress: tqdm bar over the blocks.
      sink_tokens, sink_weight: the first ``sink_tokens`` positions of every window get weight
        ``sink_weight`` in :meth:`LayerCalibration.statistics` (0 = excluded).
      advance: ``"new"``: the next block's inputs are this block's outputs with the returned params
        (GPTQ: quantized outputs feed the next layer); ``"original"``: with the params it had before
        (AWQ reference: the float model's activations).

    Returns the param tree with every block replaced by ``per_layer_fn``'s result.
    """
    w = check_windows(windows, sink_tokens=sink_tokens, sink_weight=sink_weight, what=desc)
    if batch_size < 1:
        raise CalibrationError(f"{desc}: batch_size must be >= 1, got {batch_size}")
    if advance not in ("new", "original"):
        raise CalibrationError(f"{desc}: advance must be 'new' or 'original', got {advance!r}")
    weights = token_weights(w.shape[1], sink_tokens, sink_weight)
    h = embed_windows(model, params, w, batch_size=batch_size)
    names = model.layer_names
    it: Any = enumerate(names)
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        it = tqdm(it, total=len(names), desc=desc, unit="layer")
    out = dict(params)
    for i, name in it:
        if name not in params:
            raise CalibrationError(f"{desc}: params have no block {name!r}")
        cal = LayerCalibration(model, name, i, h, batch_size, weights)
        old = params[name]
        new = per_layer_fn(name, old, cal)
        out[name] = new
        h = cal.outputs(new if advance == "new" else old)
        del cal
    return out


def collect_statistics(
    model: Any,
    params: Params,
    windows: Any,
    stats: Mapping[str, Statistic],
    *,
    linears: tuple[str, ...] | None = None,
    batch_size: int = 8,
    progress: bool = False,
    sink_tokens: int = 0,
    sink_weight: float = 0.0,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{layer name: {linear path: {stat name: value}}}`` over the calibration windows (params unchanged)."""
    result: dict[str, dict[str, dict[str, Any]]] = {}

    def per_layer(name: str, lp: Params, cal: LayerCalibration) -> Params:
        result[name] = cal.statistics(stats, lp, linears=linears)
        return lp

    run_layerwise(
        model, params, windows, per_layer, batch_size=batch_size, progress=progress,
        sink_tokens=sink_tokens, sink_weight=sink_weight, desc="statistics",
    )
    return result


def is_float_kernel(x: Any) -> bool:
    """True for a plain float kernel (not a QArray / ActQuantKernel)."""
    return not is_leaf(x) and jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
