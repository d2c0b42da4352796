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
statistics of its weights' inputs (:mod:`eqjax.statistics`, computed inside the jitted segment: one
pass over the batches, inputs read by several weights reduced once), for the segment's outputs, or
for a differentiable segment function, and returns updated params; then the batches advance through
the segment with the new params (``advance="new"``: quantized outputs of block ``b`` feed block ``b+1``,
as GPTQ does) or the old ones (``"original"``: the float model's activations, as AWQ / SmoothQuant /
LKD do). Memory: the values live across one block boundary per batch (about one residual stream
``[n, T, D]`` in all) plus the statistics.

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

from eqjax.core.analysis import Analysis, WeightUse, activation_matrix, analyze, group_uses_by_input, token_axis
from eqjax.core.folds import Fold, find_fold
from eqjax.core.interpret import DotHook, run
from eqjax.core.program import Program, trace
from eqjax.errors import InputError
from eqjax.statistics import Statistic, accumulate

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
    """One block's view: its uses, the batches' values entering its segment, statistics and outputs."""

    def __init__(self, cal: "Calibrator", block: Block, envs: list[dict[int, Any]], params: Mapping[str, Any]):
        self.cal, self.block, self.envs, self.params = cal, block, envs, params
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
        return len(self.envs)

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
        over every batch, with ``params`` (default: the current ones)."""
        uses = tuple(self.block.uses if uses is None else uses)
        params = self.params if params is None else params
        groups = group_uses_by_input(uses)
        items = tuple(stats.items())
        fn = self.cal._segment(self.block, groups_key(groups), items, sink_tokens, float(sink_weight))
        states = [{n: st.init(g[0].k) for n, st in items} for g in groups]
        sub = self.cal._params_for(self.block, params)
        for env in self.envs:
            _, states = fn(sub, self.cal._ins(self.block, env), states)
        out: dict[str, dict[str, Any]] = {}
        for g, s in zip(groups, states):
            fin = {n: st.finalize(s[n]) for n, st in items}
            for u in g:
                out.setdefault(u.path, fin)
        return out

    def outputs(self, params: Mapping[str, Any] | None = None, dot_hook: DotHook | None = None) -> list[list[Any]]:
        """Per batch, the segment's live outputs (the values later nodes read) with ``params``."""
        params = self.params if params is None else params
        fn = self.cal._segment(self.block, None, (), 0, 0.0, dot_hook)
        sub = self.cal._params_for(self.block, params)
        return [fn(sub, self.cal._ins(self.block, env), None)[0] for env in self.envs]

    def inputs(self) -> list[list[Any]]:
        """Per batch, the values entering the segment (in :meth:`function`'s argument order)."""
        return [self.cal._ins(self.block, env) for env in self.envs]

    def function(self, dot_hook: DotHook | None = None) -> Callable[[Mapping[str, Any], list[Any]], list[Any]]:
        """A pure, differentiable ``(params by path, inputs) -> live outputs`` of the segment."""
        seg = self.cal._segment_fn(self.block, None, (), 0, 0.0, dot_hook)
        return lambda params, ins: seg(params, ins, None)[0]

    def param_paths(self) -> tuple[str, ...]:
        """Every param the segment reads (weights, norms, biases)."""
        return tuple(self.cal._param_paths(self.block))


def block_mse(outs: Sequence[Sequence[Any]], ref: Sequence[Sequence[Any]]) -> float:
    """Mean squared error over the float outputs of every batch (each element weighted equally)."""
    num, den = 0.0, 0
    for a, b in zip(outs, ref):
        for x, y in zip(a, b):
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
                num += float(jnp.sum(jnp.square(x.astype(jnp.float32) - y.astype(jnp.float32))))
                den += int(np.prod(x.shape))
    return num / max(den, 1)


def groups_key(groups: Sequence[Sequence[WeightUse]]) -> tuple:
    return tuple(tuple(u.node for u in g) for g in groups)


class Calibrator:
    """Block-by-block calibration of a program over fixed batches (see the module docs)."""

    def __init__(self, program: Program, batches: Sequence[Sequence[Any]], *, analysis: Analysis | None = None,
                 blocks: str | None = None):
        self.program = program
        self.analysis = analysis or analyze(program)
        self.batches = [list(jax.tree_util.tree_leaves(b)) for b in batches]
        for i, b in enumerate(self.batches):
            if len(b) != len(program.args):
                raise CalibrationError(f"calibration batch {i} has {len(b)} arrays; the model takes {len(program.args)}")
        self.blocks = find_blocks(self.analysis, blocks)
        if not self.blocks:
            raise CalibrationError("the model has no matmul weights to calibrate")
        self._cache: dict[tuple, Callable] = {}
        last: dict[int, int] = {}
        for i, n in enumerate(program.nodes):
            for r in n.ins:
                if isinstance(r, int):
                    last[r] = i
        for r in program.output_ids:
            last[r] = len(program.nodes)
        self._last = last

    @classmethod
    def from_model(cls, fn: Callable, params: Any, batches: Iterable[Any], *, blocks: str | None = None,
                   what: str = "model") -> "Calibrator":
        """Trace ``fn(params, *batch)`` on the first batch and calibrate over all of them."""
        bs = as_batches(batches)
        return cls(trace(fn, params, bs[0], what=what), bs, blocks=blocks)

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

    def _segment_fn(self, block: Block, groups: tuple | None, items: tuple, sink_tokens: int, sink_weight: float,
                    dot_hook: DotHook | None = None) -> Callable:
        prog, an = self.program, self.analysis
        in_ids, out_ids = self._in_ids(block), self._out_ids(block)
        gid = {} if groups is None else {node: gi for gi, g in enumerate(groups) for node in g}

        def fn(params: Mapping[str, Any], ins: list[Any], states: list | None = None):
            env = dict(zip(in_ids, ins))
            new = None if states is None else list(states)
            done: set[int] = set()

            def hook(use: WeightUse, x: Any, w: Any, default: Callable) -> Any:
                gi = gid.get(use.node)
                if gi is not None and gi not in done and new is not None:
                    done.add(gi)
                    x2 = activation_matrix(x, use)
                    rw = jnp.asarray(row_weights(use, tuple(x.shape), sink_tokens, sink_weight))
                    new[gi] = {n: accumulate(st, new[gi][n], x2, rw) for n, st in items}
                return dot_hook(use, x, w, default) if dot_hook is not None else default(x, w)

            run(prog, an, env, params, block.start, block.stop, dot_hook=hook)
            return [env[v] for v in out_ids], new

        return fn

    def _segment(self, block: Block, groups: tuple | None, items: tuple, sink_tokens: int, sink_weight: float,
                 dot_hook: DotHook | None = None) -> Callable:
        key = (block.start, groups, tuple((n, id(s)) for n, s in items), sink_tokens, sink_weight, dot_hook)
        if key not in self._cache:
            self._cache[key] = jax.jit(self._segment_fn(block, groups, items, sink_tokens, sink_weight, dot_hook))
        return self._cache[key]

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

        ``params`` maps every param path of the program to its leaf; the result has the same keys.
        """
        if advance not in ("new", "original"):
            raise CalibrationError(f"{desc}: advance must be 'new' or 'original', got {advance!r}")
        missing = [p for p in self.program.param_paths if p not in params]
        if missing:
            raise CalibrationError(f"{desc}: params have no leaf at {missing[0]!r}")
        params = dict(params)
        envs = [dict(zip(self.program.args, b)) for b in self.batches]
        blocks: Any = self.blocks
        if progress:
            from tqdm.auto import tqdm  # noqa: PLC0415

            blocks = tqdm(blocks, desc=desc, unit="block")
        for block in blocks:
            bc = BlockCalibration(self, block, envs, params)
            new = dict(per_block(bc, dict(params)))
            fn = self._segment(block, None, (), 0, 0.0)
            use = new if advance == "new" else params
            sub = self._params_for(block, use)
            out_ids = self._out_ids(block)
            nxt = []
            for env in envs:
                outs, _ = fn(sub, self._ins(block, env), None)
                keep = {v: env[v] for v in env if self._last.get(v, -1) >= block.stop and v not in out_ids}
                keep.update(zip(out_ids, outs))
                nxt.append(keep)
            envs = nxt
            params = new
        return params

