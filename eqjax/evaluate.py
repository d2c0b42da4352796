"""Perplexity, throughput, model size and peak memory under one stated protocol.

Protocol (the same as the reference numbers in ``shared/REFERENCES.md``): the evaluation text is
tokenized whole (no BOS), cut into non-overlapping windows of ``ctx`` tokens; every window is scored
independently from position 0, so each window gives ``ctx - 1`` predictions; perplexity is
``exp(total NLL / total predictions)`` in float64 on the host from float32 per-window sums.

Devices and hosts: the windows are dealt to the mesh's devices (:mod:`eqjax.distributed.mesh`:
each device scores its own batch of ``batch_size`` windows per step, with the shapes of a
one-device run, and each process feeds only its devices' windows); the per-window sums are gathered
and added on the host in window order, so the perplexity is bitwise the same on 1 device, N devices
and N hosts.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from eqjax.core.errors import CompatibilityError, InputError, NonFiniteResult
from eqjax.core.linear import current_backend, use_backend
from eqjax.core.pytree import nest_paths, tree_nbytes
from eqjax.core.validate import check_params
from eqjax.distributed.mesh import default_mesh, put, replicated, slot_axes, stack_step

__all__ = ["PplResult", "perplexity", "window_nll", "by_block_scorer", "by_block_logits", "peak_rss_mb", "model_size_bytes", "check_token_ids",
           "ulp_bumped", "rounding_band", "within_band", "is_streamed"]


@dataclasses.dataclass(frozen=True)
class PplResult:
    """Perplexity of one model on a set of windows.

    Attributes:
      ppl: perplexity.
      nll: mean negative log-likelihood per prediction (nats).
      predictions: number of scored next-token predictions (``windows * (ctx - 1)``).
      tokens: tokens fed (``windows * ctx``).
      ctx: window length.
      windows: number of windows.
      seconds: wall time of the scoring, excluding compilation.
      compile_seconds: time to trace and compile the scoring function (near zero where an earlier call
        compiled it for the same model, params structure and shapes).
      tokens_per_s: ``tokens / seconds``.
    """

    ppl: float
    nll: float
    predictions: int
    tokens: int
    ctx: int
    windows: int
    seconds: float
    compile_seconds: float
    tokens_per_s: float


def window_nll(model: Any, params: Any, tokens: jax.Array, kv_quant: Any = None) -> jax.Array:
    """Summed next-token NLL of each window: ``tokens [B, T]`` -> float32 ``[B]`` (``T - 1`` terms each)."""
    return _next_token_nll(model.apply(params, tokens, kv_quant=kv_quant)[0], tokens)


def _next_token_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Summed NLL of each window's next tokens: logits ``[B, T, V]``, tokens ``[B, T]`` -> float32 ``[B]``."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll, axis=-1)


@functools.lru_cache(maxsize=8)
def _scoring_fn(model: Any, kv_quant: Any, mesh: Mesh, backend: str) -> Any:
    """The jitted per-window NLL of ``model`` on ``mesh``, gathered and replicated: one function per
    (model, kv_quant, mesh, :func:`eqjax.core.linear.use_backend` backend), so that params of the same
    structure, shapes and dtypes (the :func:`ulp_bumped` copies of :func:`rounding_band`, another
    checkpoint of the same model) reuse its compiled code instead of tracing and compiling the whole model
    again. The backend is part of the key: switching backends traces anew instead of reusing the other's."""
    axes = slot_axes(mesh)

    def body(p: Any, t: jax.Array) -> jax.Array:
        with use_backend(backend):
            nll = window_nll(model, p, t[0], kv_quant)
        return jax.lax.all_gather(nll, axes)  # [S, bs], replicated

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(), check_vma=False))


def perplexity(
    model: Any,
    params: Any,
    windows: np.ndarray,
    *,
    batch_size: int = 2,
    kv_quant: Any = None,
    progress: bool = False,
    mesh: Mesh | None = None,
    by_block: bool = False,
) -> PplResult:
    """Perplexity of ``model`` with ``params`` on ``windows`` (int32 ``[n, ctx]``), jitted and batched
    (``batch_size`` windows per device and step) on ``mesh`` (default
    :func:`eqjax.distributed.default_mesh`; see the module docs).

    ``by_block``: run eqjax's own model one decoder block at a time, every batch through a block before the
    next block (the programs of :func:`by_block_scorer`), so a quantized model never holds more than one
    block's float weights; ``params`` may then be read on demand (:func:`is_streamed`: one block's params
    resident at a time). One device only; the hidden states of all windows stay resident (``n x ctx x
    hidden`` float32).

    Padding (a short last step) repeats the last windows and is not counted.
    Token ids outside the model's vocabulary raise :class:`~eqjax.core.errors.CompatibilityError`; a NaN or
    Inf loss or perplexity raises :class:`~eqjax.core.errors.NonFiniteResult` (never a silent ``inf``).
    """

    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise InputError(f"bad evaluation windows (windows): expected int [n >= 1, ctx >= 2], found shape {windows.shape}")
    if not np.issubdtype(windows.dtype, np.integer):
        raise InputError(f"bad evaluation windows (windows): expected integer token ids, found dtype {windows.dtype}")
    check_token_ids(model, windows, "evaluation windows")
    if int(batch_size) < 1:
        raise InputError(f"bad batch size (batch_size): expected an integer >= 1, found {batch_size}")
    mesh = mesh if mesh is not None else default_mesh()
    n, ctx = windows.shape
    bs = max(1, min(batch_size, n))
    batches = [(np.concatenate([windows[i:i + bs], np.repeat(windows[-1:], max(0, i + bs - n), axis=0)]),)
               for i in range(0, n, bs)]
    if by_block:
        if mesh.size != 1:
            raise InputError(f"block-at-a-time evaluation (by_block, eval --by-block) runs on one device, found a "
                             f"mesh of {mesh.size} devices")
        sums, compile_s, seconds = _by_block_sums(model, params, batches, kv_quant, progress)
    elif is_streamed(params):
        raise InputError("params read on demand (StreamedParams) are evaluated block at a time: pass by_block=True "
                         "(eval --by-block)")
    else:
        sums, compile_s, seconds = _whole_model_sums(model, params, batches, kv_quant, progress, mesh)
    per = np.concatenate(sums)[:n]
    total = float(np.sum(per))
    preds = n * (ctx - 1)
    if not np.isfinite(total):
        bad = int(np.argmax(~np.isfinite(per)))
        raise NonFiniteResult(
            f"non-finite loss (evaluation window {bad} of {n}): expected a finite NLL, found {per[bad]} "
            "(the (quantized) model produced NaN/Inf logits)"
        )
    nll = total / preds
    with np.errstate(over="ignore"):
        ppl = float(np.exp(nll))
    if not np.isfinite(ppl):
        raise NonFiniteResult(
            f"perplexity overflows ({n} windows of {ctx}): expected a finite perplexity, found exp({nll:.1f}) = inf "
            "(the model's predictions are far off: wrong or broken weights?)"
        )
    return PplResult(
        ppl=ppl,
        nll=nll,
        predictions=preds,
        tokens=n * ctx,
        ctx=ctx,
        windows=n,
        seconds=seconds,
        compile_seconds=compile_s,
        tokens_per_s=n * ctx / seconds if seconds > 0 else float("inf"),
    )


def _block_programs(model: Any, shape: tuple[int, int], kv_quant: Any, *, logits: bool = False
                    ) -> tuple[Callable[..., Any], Callable[[int], Callable[..., Any]], Callable[..., Any], dict[int, int]]:
    """``(embed(rest, tokens), block(i)(layer, h), head_nll(rest, h, tokens), rep)`` of eqjax's own
    ``model`` for batches of ``shape``; ``rep[i]``: the first layer whose program layer ``i`` shares (its
    attention window, or every layer its own with ``kv_quant``). ``logits``: the head returns the logits
    ``[B, T, V]`` instead of the summed next-token NLL."""
    if not hasattr(model, "layer_names") or not hasattr(model, "block"):
        raise InputError(f"block-at-a-time evaluation (by_block, eval --by-block): expected eqjax's own Model, found "
                         f"{type(model).__name__}")
    backend, names = current_backend(), model.layer_names
    window = getattr(model.config, "window_for", lambda i: None)
    rep = {i: i if kv_quant is not None else min(j for j in range(len(names)) if window(j) == window(i))
           for i in range(len(names))}
    pos = model.positions(*shape)

    def embed(p: Any, t: jax.Array) -> jax.Array:
        with use_backend(backend):
            return model.embed(p, t, pos)

    def head_nll(p: Any, h: jax.Array, t: jax.Array) -> jax.Array:
        with use_backend(backend):
            out = model.head(p, h)
            return out.astype(jnp.float32) if logits else _next_token_nll(out, t)

    def block(i: int) -> Callable[[Any, jax.Array], jax.Array]:
        def run(p: Any, h: jax.Array) -> jax.Array:
            with use_backend(backend):
                return model.block(p, h, pos, layer_index=i, kv_quant=kv_quant)[0]
        return run

    return embed, block, head_nll, rep


def by_block_scorer(model: Any, params: Any, shape: tuple[int, int], kv_quant: Any = None) -> Callable[..., Any]:
    """``score(params, tokens [1, B, T]) -> [1, B]`` summed next-token NLL, as :func:`window_nll`, computed one
    decoder block at a time: the embedding, each block and the head are compiled programs of their own (one
    per distinct block: its layer's attention window, or every layer with ``kv_quant``), so a block's weights
    are dequantized inside its own program and freed with it. ``params``: eqjax's own model's tree (for the
    shapes); ``shape``: ``(B, T)`` of every batch. ``score.programs``: the compiled programs."""
    embed, block, head_nll, rep = _block_programs(model, shape, kv_quant)
    names = model.layer_names
    layers = set(names)
    tok = jax.ShapeDtypeStruct(tuple(shape), jnp.int32)
    outer = {k: v for k, v in params.items() if k not in layers}
    embed_c = jax.jit(embed).lower(outer, tok).compile()
    h = jax.eval_shape(embed, outer, tok)
    blocks = {i: jax.jit(block(i)).lower(params[names[i]], h).compile() for i in sorted(set(rep.values()))}
    head_c = jax.jit(head_nll).lower(outer, h, tok).compile()

    def score(p: Any, tokens: jax.Array) -> jax.Array:
        rest = {k: v for k, v in p.items() if k not in layers}
        t = jnp.asarray(tokens[0])
        x = embed_c(rest, t)
        for i, name in enumerate(names):
            x = blocks[rep[i]](p[name], x)
        return head_c(rest, x, t)[None]

    score.programs = (embed_c, *blocks.values(), head_c)  # type: ignore[attr-defined]  (their memory_analysis())
    return score


def by_block_logits(model: Any, params: Any, tokens: Any) -> np.ndarray:
    """``model.apply(params, tokens)``'s logits (``[B, T, V]`` float32, ``tokens [B, T]``) computed one decoder
    block at a time, each block's weights dequantized inside its own program: the logits of a quantized model
    whose dequantized weights do not fit in memory at once. ``params``: a tree, or params read on demand
    (:func:`is_streamed`; one block read at a time). eqjax's own Model only."""
    t = jnp.asarray(tokens, jnp.int32)
    embed, block, head, rep = _block_programs(model, tuple(t.shape), None, logits=True)
    names = model.layer_names
    keys, read = _parts(params)
    rest = read([k for k in keys if k not in set(names)])
    x = jax.jit(embed)(rest, t)
    programs: dict[int, Any] = {}
    for i, name in enumerate(names):
        if rep[i] not in programs:
            programs[rep[i]] = jax.jit(block(i))
        layer = read([name])[name]
        x = jax.block_until_ready(programs[rep[i]](layer, x))
        del layer
    return np.asarray(jax.jit(head)(rest, x, t))


def is_streamed(params: Any) -> bool:
    """Whether ``params`` are read on demand (an :class:`eqjax.io.hf.StreamedParams`: ``paths`` and
    ``load(paths) -> {path: leaf}``) rather than a tree."""
    return hasattr(params, "paths") and callable(getattr(params, "load", None))


def _parts(params: Any) -> tuple[list[str], Callable[[Iterable[str]], dict[str, Any]]]:
    """``(top-level keys in order, read(keys) -> {key: subtree})`` of a tree or of streamed params (read
    from their files on each call, every leaf checked finite)."""
    if not is_streamed(params):
        return list(params), lambda keys: {k: params[k] for k in keys}
    keys = list(dict.fromkeys(p.split("/", 1)[0] for p in params.paths))

    def read(wanted: Iterable[str]) -> dict[str, Any]:
        want = set(wanted)
        tree = nest_paths(params.load([p for p in params.paths if p.split("/", 1)[0] in want]))
        check_params(tree, "params read for block-at-a-time evaluation", allow_int=True)
        return tree

    return keys, read


def _by_block_sums(model: Any, params: Any, batches: list[tuple[np.ndarray]], kv_quant: Any, progress: bool
                   ) -> tuple[list[np.ndarray], float, float]:
    """Per-window NLL sums of every batch, decoder block outermost: each block's params are read (streamed
    params: from their files) once and run on every batch's hidden states, which stay resident (``windows x
    ctx x hidden`` float32). Returns ``(sums per batch, compile seconds, run seconds)``."""
    shape = batches[0][0].shape
    embed, block, head_nll, rep = _block_programs(model, shape, kv_quant)
    names = model.layer_names
    keys, read = _parts(params)
    rest = read([k for k in keys if k not in set(names)])
    tokens = [jnp.asarray(b[0]) for b in batches]
    start = time.perf_counter()
    compile_s = 0.0

    def compiled(fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal compile_s
        t0 = time.perf_counter()
        out = jax.jit(fn).lower(*args).compile()
        compile_s += time.perf_counter() - t0
        return out

    embed_c = compiled(embed, rest, tokens[0])
    xs = [embed_c(rest, t) for t in tokens]
    programs: dict[int, Any] = {}
    it: Any = enumerate(names)
    if progress and jax.process_index() == 0:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="eval (blocks)", unit="block", total=len(names), leave=False)
    for i, name in it:
        layer = read([name])[name]
        if rep[i] not in programs:
            programs[rep[i]] = compiled(block(i), layer, xs[0])
        xs = [programs[rep[i]](layer, x) for x in xs]
        jax.block_until_ready(xs)  # this block's weights go before the next block's are read
        del layer
    head_c = compiled(head_nll, rest, xs[0], tokens[0])
    sums = [np.asarray(head_c(rest, x, t)).reshape(-1).astype(np.float64) for x, t in zip(xs, tokens)]
    return sums, compile_s, time.perf_counter() - start - compile_s


def ulp_bumped(params: Any, k: int) -> Any:
    """``params`` with every floating leaf (quantized leaves' scales included) times ``1 + k * eps`` of its
    dtype (``k`` ulps of 1; ``eps = 2**-23`` in float32): a perturbation below any real change of the model,
    to measure how much of a difference is eqjax's own rounding noise (:func:`rounding_band`)."""
    def bump(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x * (1 + k * jnp.finfo(x.dtype).eps).astype(x.dtype)
    return jax.tree.map(bump, params)


def rounding_band(model: Any, params: Any, windows: np.ndarray, bumps: tuple[int, ...] = (1, 2, 3), **kw: Any) -> list[float]:
    """Perplexities of ``params`` and of its :func:`ulp_bumped` copies on ``windows`` (``kw`` as
    :func:`perplexity`).

    With int8 activations a float that differs in its last bit (another CPU's or compiler's fused kernels,
    onnxruntime) flips an activation code now and then, and the flips propagate through the layers: the
    spread of these perplexities is the noise any other correct implementation of the same quantized model
    shows against eqjax on these windows. It shrinks with more tokens. Float and weight-only models
    barely move."""
    return [perplexity(model, params if k == 0 else ulp_bumped(params, k), windows, **kw).ppl for k in (0, *bumps)]


def _whole_model_sums(model: Any, params: Any, batches: list[tuple[np.ndarray]], kv_quant: Any, progress: bool,
                      mesh: Mesh) -> tuple[list[np.ndarray], float, float]:
    """Per-window NLL sums of every batch from one compiled program of the whole model on ``mesh``
    (``mesh.size`` batches a step). Returns ``(sums per step, compile seconds, run seconds)``."""
    # reused only for a model and KV quantizer that hash by value (frozen dataclasses): an object hashed by
    # identity may change between calls, and a function traced earlier would not see that
    by_value = all(x is None or type(x).__hash__ not in (None, object.__hash__) for x in (model, kv_quant))
    fn = (_scoring_fn if by_value else _scoring_fn.__wrapped__)(model, kv_quant, mesh, current_backend())
    params = jax.tree.map(lambda x: put(x, replicated(mesh)) if _needs_placing(x, mesh) else x, params)
    t0 = time.perf_counter()
    first, _ = stack_step(batches, 0, mesh)
    compiled = fn.lower(params, first[0]).compile()
    compile_s = time.perf_counter() - t0
    sums: list[np.ndarray] = []
    it: Any = range(-(-len(batches) // mesh.size))
    if progress and jax.process_index() == 0:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="eval", unit="step", leave=False)
    t0 = time.perf_counter()
    for j in it:
        arrays, _ = stack_step(batches, j, mesh)
        out = compiled(params, arrays[0])
        sums.append(np.asarray(out.addressable_data(0)).reshape(-1).astype(np.float64))
    return sums, compile_s, time.perf_counter() - t0


def within_band(value: float, band: list[float], rel_tol: float) -> bool:
    """Whether ``value`` lies in ``[min, max]`` of ``band`` widened on each side by the band's own width and
    ``rel_tol`` of its ends: one more draw of the same noise falls there unless it is an outlier (a draw
    outside the min..max of ``n`` others has odds ``2 / (n + 1)``; the widening covers it)."""
    lo, hi = min(band), max(band)
    width = hi - lo
    return lo * (1 - rel_tol) - width <= value <= hi * (1 + rel_tol) + width


def _needs_placing(x: Any, mesh: Mesh) -> bool:
    """A leaf that is not yet a global array on ``mesh`` (host, single-device, or another mesh)."""
    if not hasattr(x, "shape"):
        return False
    sh = getattr(x, "sharding", None)
    return getattr(sh, "mesh", None) != mesh


def check_token_ids(model: Any, ids: np.ndarray, what: str = "token ids", source: str | None = None) -> None:
    """Refuse ids outside ``[0, vocab)`` of ``model`` (naming the first offender and the embedding)."""
    vocab = getattr(getattr(model, "config", None), "vocab", None)
    ids = np.asarray(ids)
    if ids.size == 0 or vocab is None:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= int(vocab):
        bad = lo if lo < 0 else hi
        src = f" from {source}" if source else ""
        raise CompatibilityError(
            f"token id outside the model's vocabulary ({what}{src} vs embed/embedding): "
            f"expected ids in [0, {int(vocab)}), found {bad}"
        )


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux ``ru_maxrss`` is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def model_size_bytes(params: Any) -> int:
    """Stored size of a param tree: float leaves at their dtype, quantized leaves as packed."""
    return tree_nbytes(params)
