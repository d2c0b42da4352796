"""Device meshes for calibration and evaluation: which axis carries what, and where arrays live.

One mesh shape serves one device, many devices and many hosts: ``(data, model)`` with
``data * model`` = the number of devices (``jax.devices()``: every process's devices once
``jax.distributed`` is up). The single-device run is the ``(1, 1)`` mesh; nothing else changes.

* **Batch slots** (calibration batches, evaluation windows): every device of the mesh is one slot,
  slot ``s`` = ``mesh.devices.flat[s]`` (row-major over ``data``, ``model``). Global batch ``i`` goes to
  slot ``i % S`` at step ``i // S`` (``S = mesh.size``); a step's arrays are stacked ``[S, ...]``
  with sharding ``P(("data", "model"))``, so each device holds exactly its own batch, and each
  process builds only the slots of its own devices (:func:`stack_step`). A short last step is
  padded with copies of the last real batch, marked invalid.
* **Params at rest**: replicated along ``data``; along ``model`` each array is split on its
  output-channel axis when that divides (:func:`param_sharding`), so a device holds about
  ``1 / model`` of the weights. Jitted steps read a block's params replicated (XLA gathers them:
  one block at a time, transiently).

:func:`use_mesh` sets the mesh that :class:`eqjax.calibration.calibrate.Calibrator` and
:func:`eqjax.evaluate.perplexity` use when given none; the default is every device along ``data``.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "DATA", "MODEL", "put", "make_mesh", "default_mesh", "use_mesh", "set_default_mesh", "slot_axes", "replicated", "slot_sharding",
    "param_sharding", "place", "stack_step", "n_steps", "device_bytes", "describe_mesh",
]

DATA, MODEL = "data", "model"

_CURRENT: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("eqjax_mesh", default=None)


def make_mesh(model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``(data, model)`` mesh over ``devices`` (default: all), ``data = len(devices) // model``.

    Axes are ``Auto`` (XLA propagates shardings through eager ops and jit), so methods written for
    one device run unchanged on the mesh.
    """
    devs = list(jax.devices() if devices is None else devices)
    if model < 1 or len(devs) % model:
        raise ValueError(f"model axis {model} does not divide the {len(devs)} devices")
    arr = np.array(devs, dtype=object).reshape(len(devs) // model, model)
    return Mesh(arr, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


_DEFAULT: dict[tuple, Mesh] = {}


def default_mesh() -> Mesh:
    """The mesh set by :func:`use_mesh`, else every device along ``data`` (cached per device set)."""
    m = _CURRENT.get()
    if m is not None:
        return m
    key = tuple(d.id for d in jax.devices())
    if key not in _DEFAULT:
        _DEFAULT[key] = make_mesh(1)
    return _DEFAULT[key]


def set_default_mesh(mesh: Mesh | None) -> None:
    """Make ``mesh`` the default for the rest of this process (None: back to every device along ``data``)."""
    if mesh is not None and tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(f"eqjax meshes have axes ('data', 'model'), got {mesh.axis_names}; use make_mesh()")
    _CURRENT.set(mesh)


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Calibrate and evaluate on ``mesh`` inside the ``with`` block (e.g. ``make_mesh(model=8)``)."""
    if tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(f"eqjax meshes have axes ('data', 'model'), got {mesh.axis_names}; use make_mesh()")
    tok = _CURRENT.set(mesh)
    try:
        yield mesh
    finally:
        _CURRENT.reset(tok)


def slot_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes batch slots run over (all of them, in mesh order)."""
    return tuple(mesh.axis_names)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def slot_sharding(mesh: Mesh) -> NamedSharding:
    """Leading axis = batch slot, one per device."""
    return NamedSharding(mesh, P(slot_axes(mesh)))


def param_sharding(shape: Sequence[int], mesh: Mesh, axes: Sequence[int] = ()) -> NamedSharding:
    """At-rest sharding of an array of ``shape``: split along ``model`` on the first of ``axes``
    (e.g. a weight's output-channel axes) whose length the model axis divides; replicated otherwise
    (and always when ``model == 1``)."""
    m = mesh.shape[MODEL]
    if m > 1:
        for a in axes:
            if 0 <= a < len(shape) and shape[a] % m == 0 and shape[a] >= m:
                spec = [None] * len(shape)
                spec[a] = MODEL
                return NamedSharding(mesh, P(*spec))
    return replicated(mesh)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` (a host value, a local jax.Array or a global one) as a global array with ``sharding``.

    Every process must pass the same value for a local ``x``. In a multi-process job,
    ``jax.device_put`` of a local jax.Array onto devices of other processes either fails (committed
    arrays) or builds an array whose shards cannot be read (uncommitted ones, jax 0.10 CPU); such
    values go through the host (:func:`jax.make_array_from_callback`: each process fills its devices).
    """
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        if not x.is_fully_addressable:
            return jax.device_put(x, sharding)  # global -> global: a reshard XLA does
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree: Any, sharding_of: Callable[[tuple[int, ...]], NamedSharding]) -> Any:
    """Every array leaf of ``tree`` (QArray children included) on the mesh with ``sharding_of(shape)``.

    A leaf already there is returned as is; host or single-device leaves are copied (every process
    must hold the same value: :func:`put` takes each process's own copy for its devices).
    """

    def one(x: Any) -> Any:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        return put(x, sharding_of(tuple(x.shape)))

    return jax.tree.map(one, tree)


def n_steps(n_batches: int, mesh: Mesh) -> int:
    """Steps needed to deal ``n_batches`` to the mesh's slots."""
    return -(-n_batches // mesh.size)


def stack_step(batches: Sequence[Sequence[Any]], step: int, mesh: Mesh) -> tuple[list[jax.Array], jax.Array]:
    """Step ``step``'s arrays ``[S, ...]`` (one per batch argument, slot-sharded) and the valid mask ``[S]``.

    Only the slots of this process's devices are read from ``batches`` (each process feeds its
    share); slots past the last batch repeat it and are invalid.
    """
    S = mesh.size
    sh = slot_sharding(mesh)
    n = len(batches)
    first = step * S

    def src(s: int) -> int:
        return min(first + s, n - 1)

    def slots_of(index: tuple) -> range:
        return range(*index[0].indices(S))

    out = []
    for k, proto in enumerate(batches[0]):
        shape = (S,) + tuple(np.shape(proto))

        def cb(index: tuple, k: int = k) -> np.ndarray:
            rows = [np.asarray(batches[src(s)][k])[index[1:]] for s in slots_of(index)]
            return np.stack(rows)

        out.append(jax.make_array_from_callback(shape, sh, cb))
    valid = jax.make_array_from_callback(
        (S,), sh, lambda index: np.array([first + s < n for s in slots_of(index)], bool))
    return out, valid


def device_bytes(tree: Any) -> dict[str, int]:
    """Bytes of ``tree``'s arrays held by each of this process's devices (shards counted where they live)."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for sh in leaf.addressable_shards:
                out[str(sh.device)] = out.get(str(sh.device), 0) + int(sh.data.nbytes)
    return out


def describe_mesh(mesh: Mesh) -> str:
    """``data 2 x model 4 (8 devices: cpu:0..7, 2 processes)``."""
    procs = len({d.process_index for d in mesh.devices.flat})
    return (f"data {mesh.shape[DATA]} x model {mesh.shape[MODEL]} ({mesh.size} devices, "
            f"{procs} process{'es' if procs > 1 else ''})")
