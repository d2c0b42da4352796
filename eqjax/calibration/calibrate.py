"""Block-by-block calibration of any traced model: statistics of weight inputs, sequential updates.

A :class:`Calibrator` holds a model's program (:mod:`eqjax.core.program`), its analysis and the
calibration batches (positional-argument tuples of the model's call, all of one shape). It cuts the
program into **blocks**: the model's repeated submodules, found from the param paths of its weight
uses (``layers_3/...``, ``model/layers/3/...``, ``blocks/3/...``: the path prefix up to the first
numbered component of the family with the most members), the iterations of a scanned stack of
weights (``nn.scan``: ``layers[0]``, ``layers[1]``, ...), or named by a regex; without repeated
submodules, each group of weights reading one input is a block. Block ``b``'s *segment* is the run
of program nodes from the end of block ``b-1`` to its last weight use.

:meth:`Calibrator.run_blocks` walks the blocks in order. For each it hands the method a
:class:`BlockCalibration` over every batch's values entering the segment; the method asks for
statistics of its weights' inputs (:mod:`eqjax.calibration.statistics`, computed inside the jitted segment: one
pass over the batches, inputs read by several weights reduced once), for the segment's outputs, or
for a differentiable segment function, and returns updated params; then the batches advance through
the segment with the new params (``advance="new"``: quantized outputs of block ``b`` feed block ``b+1``,
as GPTQ does) or the old ones (``"original"``: the float model's activations, as AWQ / SmoothQuant /
LKD do). Memory: the values live across one block boundary per batch (about one residual stream
``[n, T, D]`` in all) plus the statistics.

Devices and hosts (:mod:`eqjax.distributed`): the calibrator runs on a ``(data, model)`` mesh
(default: every device, :func:`eqjax.distributed.default_mesh`; one device is the ``1 x 1`` mesh).
The batches are dealt to the mesh's devices, one batch per device per *step* (batch ``i`` on device
``i % S`` at step ``i // S``); each process feeds only its devices' batches; every jitted segment
runs once per step under ``shard_map``, each device on its own batch with exactly the shapes of a
one-device run. Statistics are merged across the step's batches inside that jitted step in global
batch order (``reduction="ordered"``), so every statistic, float sums such as GPTQ's ``X^T X``
included, is bitwise identical on every mesh (see :mod:`eqjax.distributed.merge`, which also
offers ``"collective"``: one ``psum`` / ``pmax`` per step, for very large meshes). Params live on the
mesh replicated along ``data`` and split along ``model`` (:func:`eqjax.distributed.param_sharding`);
a step reads its block's params whole (XLA gathers them), so a device holds ``1 / model`` of the
weights plus one block.

Row weights: the first ``sink_tokens`` positions along each input's sequence axis (the last
non-contracted activation axis) get ``sink_weight`` in the statistics (0 excludes them). The
attention-sink token of some models (SmolLM2: activations ~1e5x the median at the first position)
otherwise dominates sums such as ``X^T X``; each method chooses its default from measurements.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from eqjax.calibration.blockfit import shared_jit
from eqjax.calibration.statistics import Statistic
from eqjax.core.analysis import Analysis, WeightUse, activation_matrix, analyze, group_uses_by_input, token_axis
from eqjax.core.errors import InputError
from eqjax.core.folds import Fold, find_fold
from eqjax.core.interpret import DotHook, run
from eqjax.core.program import Program, trace
from eqjax.distributed.consistency import check_same_job, fingerprint
from eqjax.distributed.merge import Reduction, merge_slots
from eqjax.distributed.mesh import MODEL, default_mesh, n_steps, param_sharding, place, replicated, slot_axes, stack_step

__all__ = [
    "CalibrationError", "Block", "find_blocks", "block_mse", "BlockCalibration", "Calibrator", "row_weights", "as_batches",
]


class CalibrationError(InputError):
    """Calibration cannot run: no batches, batches of different shapes, no weights, ..."""


@dataclasses.dataclass(frozen=True, eq=False)
class Block:
    """A run of weight uses calibrated together; its segment is program nodes ``[start, stop)``."""

    name: str
    uses: tuple[WeightUse, ...]
    start: int
    stop: int

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(u.path for u in self.uses))


def _numbered_prefix(path: str) -> tuple[str, str] | None:
    """(block key, family stem) from the first numbered path component, e.g. ('model/layers/3', 'model/layers/#')."""
    parts = path.split("/")
    for j, c in enumerate(parts[:-1]):
        m = re.fullmatch(r"(.*?)(\d+)", c)
        if m and (c.isdigit() or m.group(1).endswith("_")):
            return "/".join(parts[: j + 1]), "/".join(parts[:j] + [m.group(1) + "#"])
    return None


def find_blocks(an: Analysis, pattern: str | None = None, uses: Sequence[WeightUse] | None = None) -> list[Block]:
    """The program's blocks in node order (see the module docs); ``pattern``: a regex whose match at
    the start of a weight's path names its block (e.g. ``r"encoder/layer_\\d+"``)."""
    uses = sorted(an.uses if uses is None else uses, key=lambda u: u.node)
    if not uses:
        return []
    keys: dict[int, str | None] = {}
    if pattern is not None:
        rx = re.compile(pattern)
        for u in uses:
            m = rx.match(u.path)
            keys[u.node] = m.group(0) if m else None
    else:
        fam: dict[str, set[str]] = {}
        for u in uses:
            kp = _numbered_prefix(u.path)
            if kp:
                fam.setdefault(kp[1], set()).add(kp[0])
        stem = max(fam, key=lambda s: len(fam[s]), default=None)
        for u in uses:
            kp = _numbered_prefix(u.path)
            keys[u.node] = kp[0] if kp and stem is not None and kp[1] == stem else None
            if keys[u.node] is None and u.index:  # a scanned stack (nn.scan): one block per iteration
                keys[u.node] = f"{u.path.rsplit('/', 2)[0]}[{u.index[0][1]}]"
    group_of = {u.node: gi for gi, g in enumerate(group_uses_by_input(uses)) for u in g}
    runs: list[tuple[str, list[WeightUse]]] = []
    for u in uses:
        key = keys[u.node] or f"{u.path}#{group_of[u.node]}"
        if runs and runs[-1][0] == key:
            runs[-1][1].append(u)
        else:
            runs.append((key, [u]))
    # merge runs that interleave (a block's last use after the next block's first)
    merged: list[tuple[str, list[WeightUse]]] = []
    for key, us in runs:
        if merged and (merged[-1][0] == key or max(x.node for x in merged[-1][1]) > min(x.node for x in us)):
            merged[-1] = (merged[-1][0], merged[-1][1] + us)
        else:
            merged.append((key, us))
    blocks, start = [], 0
    for key, us in merged:
        stop = max(u.node for u in us) + 1
        name = key.split("#")[0] if "#" in key else key
        blocks.append(Block(name, tuple(us), start, stop))
        start = stop
    return blocks


def row_weights(use: WeightUse, x_shape: tuple[int, ...], sink_tokens: int, sink_weight: float) -> np.ndarray:
    """float32 ``[M]`` weights of :func:`activation_matrix` rows: ``sink_weight`` for rows at positions
    ``< sink_tokens`` of the sequence axis, else 1."""
    others = [a for a in range(len(x_shape)) if a not in use.x_contracting]
    m = int(np.prod([x_shape[a] for a in others], dtype=np.int64))
    w = np.ones((m,), np.float32)
    t = token_axis(use, len(x_shape))
    if sink_tokens > 0 and t is not None:
        pos = np.indices([x_shape[a] for a in others])[others.index(t)].reshape(-1)
        w[pos < sink_tokens] = sink_weight
    return w


def as_batches(batches: Iterable[Any], what: str = "calibration") -> list[tuple[Any, ...]]:
    """A list of positional-argument tuples, all with the same array shapes and dtypes."""
    if batches is None:
        raise CalibrationError(f"{what}: no calibration batches given")
    out = [b if isinstance(b, tuple) else (b,) for b in batches]
    if not out:
        raise CalibrationError(f"{what}: the calibration iterable is empty")
    sig0 = [(np.shape(x), np.result_type(x)) for x in jax.tree_util.tree_leaves(out[0])]
    for i, b in enumerate(out[1:], 1):
        sig = [(np.shape(x), np.result_type(x)) for x in jax.tree_util.tree_leaves(b)]
        if sig != sig0:
            raise CalibrationError(f"{what}: batch {i} has shapes {sig} but batch 0 has {sig0}; give batches of "
                                   "one shape (pad or drop the last one)")
    return out


class BlockCalibration:
    """One block's view: its uses, the values entering its segment (per step), statistics and outputs."""

    def __init__(self, cal: "Calibrator", block: Block, envs: list[dict[int, Any]], params: Mapping[str, Any],
                 valids: list[Any] | None = None):
        self.cal, self.block, self.envs, self.params = cal, block, envs, params
        self.valids = valids if valids is not None else cal._valids
        self._folds: dict[tuple, tuple[Fold | None, str]] = {}

    @property
    def name(self) -> str:
        return self.block.name

    @property
    def uses(self) -> tuple[WeightUse, ...]:
        return self.block.uses

    @property
    def groups(self) -> list[tuple[WeightUse, ...]]:
        """The block's uses grouped by the activation they read, in node order."""
        return group_uses_by_input(self.block.uses)

    @property
    def n_batches(self) -> int:
        return len(self.cal.batches)

    @property
    def mesh(self) -> Mesh:
        return self.cal.mesh

    def fold(self, group: Sequence[WeightUse]) -> tuple[Fold | None, str]:
        """:func:`eqjax.core.folds.find_fold` of a group (cached)."""
        key = tuple(u.node for u in group)
        if key not in self._folds:
            self._folds[key] = find_fold(self.cal.analysis, group)
        return self._folds[key]

    def statistics(self, stats: Mapping[str, Statistic], uses: Sequence[WeightUse] | None = None,
                   params: Mapping[str, Any] | None = None, *, sink_tokens: int = 0,
                   sink_weight: float = 0.0) -> dict[str, dict[str, Any]]:
        """``{path: {stat name: finalized value}}`` of the inputs of ``uses`` (default: the block's)
        over every batch, with ``params`` (default: the current ones). Values are replicated on the
        mesh (``np.asarray`` works on every process) and identical for every mesh."""
        uses = tuple(self.block.uses if uses is None else uses)
        params = self.params if params is None else params
        groups = group_uses_by_input(uses)
        items = tuple(stats.items())
        fn = self.cal._step(self.block, groups_key(groups), items, sink_tokens, float(sink_weight), outputs=False)
        rep = replicated(self.cal.mesh)
        states = place([{n: st.init(g[0].k) for n, st in items} for g in groups], lambda shape: rep)
        sub = self.cal._params_for(self.block, params)
        for env, valid in zip(self.envs, self.valids):
            _, states = fn(sub, self.cal._ins(self.block, env), states, valid)
        out: dict[str, dict[str, Any]] = {}
        for g, s in zip(groups, states):
            fin = {n: st.finalize(s[n]) for n, st in items}
            for u in g:
                out.setdefault(u.path, fin)
        return out

    def outputs(self, params: Mapping[str, Any] | None = None, dot_hook: DotHook | None = None) -> list[list[Any]]:
        """Per batch, the segment's live outputs (the values later nodes read) with ``params``."""
        params = self.params if params is None else params
        fn = self.cal._step(self.block, None, (), 0, 0.0, dot_hook)
        sub = self.cal._params_for(self.block, params)
        steps = [fn(sub, self.cal._ins(self.block, env), None, valid)[0] for env, valid in zip(self.envs, self.valids)]
        return self.cal._unstack(steps)

    def inputs(self) -> list[list[Any]]:
        """Per batch, the values entering the segment (in :meth:`function`'s argument order)."""
        return self.cal._unstack([self.cal._ins(self.block, env) for env in self.envs])

    def function(self, dot_hook: DotHook | None = None) -> Callable[[Mapping[str, Any], list[Any]], list[Any]]:
        """A pure, differentiable ``(params by path, inputs of one batch) -> live outputs`` of the segment."""
        seg = self.cal._batch_fn(self.block, None, (), 0, 0.0, dot_hook)
        return lambda params, ins: seg(params, ins)[0]

    def param_paths(self) -> tuple[str, ...]:
        """Every param the segment reads (weights, norms, biases)."""
        return tuple(self.cal._param_paths(self.block))


def _host_scalar(x: Any) -> float:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return float(np.asarray(x.addressable_data(0)))
    return float(x)


@jax.jit
def _sq_err(x: Any, y: Any) -> jax.Array:
    return jnp.sum(jnp.square(x.astype(jnp.float32) - y.astype(jnp.float32)))


def block_mse(outs: Sequence[Sequence[Any]], ref: Sequence[Sequence[Any]]) -> float:
    """Mean squared error over the float outputs of every batch (each element weighted equally)."""
    num, den = 0.0, 0
    for a, b in zip(outs, ref):
        for x, y in zip(a, b):
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
                num += _host_scalar(_sq_err(x, y))
                den += int(np.prod(x.shape))
    return num / max(den, 1)


def groups_key(groups: Sequence[Sequence[WeightUse]]) -> tuple:
    return tuple(tuple(u.node for u in g) for g in groups)


class Calibrator:
    """Block-by-block calibration of a program over fixed batches, on a mesh (see the module docs).

    Args:
      program: the traced model; batches: positional-argument tuples, all of one shape (every
        process passes the same list; each reads only its own devices' batches).
      mesh: a ``(data, model)`` mesh (:func:`eqjax.distributed.make_mesh`); default
        :func:`eqjax.distributed.default_mesh`.
      reduction: how statistics are merged across devices: ``"ordered"`` (bitwise identical on
        every mesh) or ``"collective"`` (see :mod:`eqjax.distributed.merge`).
    """

    def __init__(self, program: Program, batches: Sequence[Sequence[Any]], *, analysis: Analysis | None = None,
                 blocks: str | None = None, mesh: Mesh | None = None, reduction: Reduction = "ordered"):
        self.program = program
        self.analysis = analysis or analyze(program)
        self.batches = [list(jax.tree_util.tree_leaves(b)) for b in batches]
        if not self.batches:
            raise CalibrationError("no calibration batches given")
        for i, b in enumerate(self.batches):
            if len(b) != len(program.args):
                raise CalibrationError(f"calibration batch {i} has {len(b)} arrays; the model takes {len(program.args)}")
        if reduction not in ("ordered", "collective"):
            raise CalibrationError(f"reduction must be 'ordered' or 'collective', got {reduction!r}")
        self.blocks = find_blocks(self.analysis, blocks)
        if not self.blocks:
            raise CalibrationError("the model has no matmul weights to calibrate")
        self.mesh = mesh if mesh is not None else default_mesh()
        self.reduction = reduction
        self._cache: dict[tuple, Callable] = {}
        self._valids: list[Any] = []
        self._checked = False
        last: dict[int, int] = {}
        for i, n in enumerate(program.nodes):
            for r in n.ins:
                if isinstance(r, int):
                    last[r] = i
        for r in program.output_ids:
            last[r] = len(program.nodes)
        self._last = last
        self._out_axes: dict[str, tuple[int, ...]] = {}
        for u in self.analysis.uses:
            self._out_axes.setdefault(u.path, tuple(u.free))
        for e in getattr(self.analysis, "embeddings", ()):
            self._out_axes.setdefault(e.path, (e.axis,))

    @classmethod
    def from_model(cls, fn: Callable, params: Any, batches: Iterable[Any], *, blocks: str | None = None,
                   what: str = "model", mesh: Mesh | None = None, reduction: Reduction = "ordered") -> "Calibrator":
        """Trace ``fn(params, *batch)`` on the first batch and calibrate over all of them."""
        bs = as_batches(batches)
        return cls(trace(fn, params, bs[0], what=what), bs, blocks=blocks, mesh=mesh, reduction=reduction)

    # ---- where things live ----------------------------------------------------------------------

    def place_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` (by path) on the mesh, at rest: replicated along ``data``, output channels split
        along ``model`` where they divide (leaves already there are kept)."""
        return {p: self._at_rest(p, v) for p, v in params.items()}

    def _at_rest(self, path: str, leaf: Any) -> Any:
        mesh = self.mesh
        if mesh.shape[MODEL] == 1:
            return place(leaf, lambda shape: replicated(mesh))
        axes = self._out_axes.get(path, ())
        return place(leaf, lambda shape: param_sharding(shape, mesh, axes))

    def _steps(self) -> list[dict[int, Any]]:
        envs, self._valids = [], []
        for j in range(n_steps(len(self.batches), self.mesh)):
            arrays, valid = stack_step(self.batches, j, self.mesh)
            envs.append(dict(zip(self.program.args, arrays)))
            self._valids.append(valid)
        return envs

    def _unstack(self, steps: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """Per-step stacked values ``[S, ...]`` -> per real batch, in batch order."""
        S, n = self.mesh.size, len(self.batches)
        return [[v[s] for v in vals] for j, vals in enumerate(steps) for s in range(S) if j * S + s < n]

    def _check_same_data(self) -> None:
        if self._checked or jax.process_count() == 1:
            return

        check_same_job({"calibration batches": fingerprint(self.batches)})
        self._checked = True

    # ---- segments -------------------------------------------------------------------------------

    def _param_paths(self, block: Block) -> list[str]:
        prog = self.program
        seen: dict[str, None] = {}
        for n in prog.nodes[block.start:block.stop]:
            for r in n.ins:
                if isinstance(r, int) and r in prog.param_of:
                    seen[prog.param_of[r]] = None
        for u in block.uses:
            seen[u.path] = None
        return list(seen)

    def _params_for(self, block: Block, params: Mapping[str, Any]) -> dict[str, Any]:
        return {p: params[p] for p in self._param_paths(block)}

    def _in_ids(self, block: Block) -> tuple[int, ...]:
        prog = self.program
        produced: set[int] = set()
        ins: dict[int, None] = {}
        for n in prog.nodes[block.start:block.stop]:
            for r in n.ins:
                if isinstance(r, int) and r not in produced and r not in prog.param_of and r not in prog.consts:
                    ins[r] = None
            produced.update(n.outs)
        return tuple(ins)

    def _out_ids(self, block: Block) -> tuple[int, ...]:
        prog = self.program
        cand = set(self._in_ids(block))
        for n in prog.nodes[block.start:block.stop]:
            cand.update(n.outs)
        return tuple(sorted(v for v in cand if self._last.get(v, -1) >= block.stop))

    def _ins(self, block: Block, env: Mapping[int, Any]) -> list[Any]:
        return [env[v] for v in self._in_ids(block)]

    def _batch_fn(self, block: Block, groups: tuple | None, items: tuple, sink_tokens: int, sink_weight: float,
                  dot_hook: DotHook | None = None) -> Callable:
        """One batch through the segment: ``(params, ins) -> (live outputs, per-group partials | None)``."""
        prog, an = self.program, self.analysis
        in_ids, out_ids = self._in_ids(block), self._out_ids(block)
        gid = {} if groups is None else {node: gi for gi, g in enumerate(groups) for node in g}

        def fn(params: Mapping[str, Any], ins: list[Any]):
            env = dict(zip(in_ids, ins))
            parts: list | None = None if groups is None else [None] * len(groups)

            def hook(use: WeightUse, x: Any, w: Any, default: Callable) -> Any:
                gi = gid.get(use.node)
                if gi is not None and parts is not None and parts[gi] is None:
                    x2 = activation_matrix(x, use)
                    rw = jnp.asarray(row_weights(use, tuple(x.shape), sink_tokens, sink_weight))
                    parts[gi] = {n: st.partial(x2, rw) for n, st in items}
                return dot_hook(use, x, w, default) if dot_hook is not None else default(x, w)

            run(prog, an, env, params, block.start, block.stop, dot_hook=hook)
            return [env[v] for v in out_ids], parts

        return fn

    def _step(self, block: Block, groups: tuple | None, items: tuple, sink_tokens: int, sink_weight: float,
              dot_hook: DotHook | None = None, *, outputs: bool = True) -> Callable:
        """One step, jitted on the mesh: ``(params, ins [S, ...], states | None, valid [S]) -> (outputs
        [S, ...] (empty without ``outputs``), states merged with the step's batches)``."""
        key = (block.start, groups, tuple((n, id(s)) for n, s in items), sink_tokens, sink_weight, dot_hook, outputs)
        if key in self._cache:
            return self._cache[key]
        batch_fn = self._batch_fn(block, groups, items, sink_tokens, sink_weight, dot_hook)
        mesh, how = self.mesh, self.reduction
        axes, S = slot_axes(mesh), mesh.size
        ks = () if groups is None else tuple(self._k_of(g) for g in groups)

        def body(params: Mapping[str, Any], ins: list[Any], states: list | None, valid: jax.Array):
            outs, parts = batch_fn(params, [x[0] for x in ins])
            new = None
            if states is not None:
                new = [{n: merge_slots(st, states[gi][n], parts[gi][n], valid[0], st.init(ks[gi]), axes, S, how)
                        for n, st in items} for gi in range(len(states))]
            return ([o[None] for o in outs] if outputs else []), new

        # one executable for every block that traces to the same program (a transformer's blocks differ
        # only in their arrays): the step compiles once per model, not once per block
        fn = shared_jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axes), P(), P(axes)),
                                      out_specs=(P(axes), P()), check_vma=False))
        self._cache[key] = fn
        return fn

    def _k_of(self, nodes: tuple[int, ...]) -> int:
        return self.analysis.use_at(nodes[0]).k

    # ---- the driver -----------------------------------------------------------------------------

    def run_blocks(
        self,
        params: Mapping[str, Any],
        per_block: Callable[[BlockCalibration, dict[str, Any]], dict[str, Any]],
        *,
        advance: Literal["new", "original"] = "new",
        progress: bool = False,
        desc: str = "calibrate",
    ) -> dict[str, Any]:
        """Apply ``per_block(block_calibration, params) -> params`` block by block (see the module docs).

        ``params`` maps every param path of the program to its leaf; the result has the same keys,
        every leaf on the mesh (:meth:`place_params`).
        """
        if advance not in ("new", "original"):
            raise CalibrationError(f"{desc}: advance must be 'new' or 'original', got {advance!r}")
        missing = [p for p in self.program.param_paths if p not in params]
        if missing:
            raise CalibrationError(f"{desc}: params have no leaf at {missing[0]!r}")
        self._check_same_data()
        params = self.place_params(params)
        envs = self._steps()
        valids = list(self._valids)
        blocks: Any = self.blocks
        if progress and jax.process_index() == 0:
            from tqdm.auto import tqdm

            blocks = tqdm(blocks, desc=desc, unit="block")
        last = self.blocks[-1] if len(self.blocks) else None
        for block in blocks:
            bc = BlockCalibration(self, block, envs, params, valids)
            new = dict(per_block(bc, dict(params)))
            new = {p: (v if v is params.get(p) else self._at_rest(p, v)) for p, v in new.items()}
            del bc
            if block is last:  # nothing reads the last block's outputs (e.g. a head's logits): not computed
                params = new
                break
            fn = self._step(block, None, (), 0, 0.0)
            use = new if advance == "new" else params
            sub = self._params_for(block, use)
            out_ids = self._out_ids(block)
            nxt = []
            for env, valid in zip(envs, valids):
                outs, _ = fn(sub, self._ins(block, env), None, valid)
                keep = {v: env[v] for v in env if self._last.get(v, -1) >= block.stop and v not in out_ids}
                keep.update(zip(out_ids, outs))
                nxt.append(keep)
            envs = nxt
            params = new
        return params
