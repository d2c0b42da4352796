"""KV-cache quantization as KVQuant does it (the seed's "SimQuant"): keys per channel before RoPE,
values per token, optional dense-and-sparse outliers and float attention-sink tokens.

:class:`KVQuant` is a frozen (hashable) dataclass usable as the model's static ``kv_quant`` hook
(``model.apply(params, tokens, kv_quant=KVQuant(4, 4))``, ``jax.jit(..., static_argnames="kv_quant")``).
It *fake-quantizes*: the hook returns ``dequantize(quantize(x))`` so perplexity and decoding see the
error of the stored cache; :func:`kv_bytes_per_token` counts what the stored cache would occupy.

Numerics (both keys and values, ``b`` bits, asymmetric uniform grid, ``q = 2**b - 1``):

* ``lo`` = float16 rounded *down* of the block minimum, ``scale = (hi - lo) / q`` rounded *up* to
  float16 (so the grid covers ``[lo, hi]``), ``code = clip(round((x - lo) / scale), 0, q)``,
  ``x_hat = lo + code * scale``; an in-range entry's error is at most ``scale / 2``. A min-based float
  offset (not an integer zero point) because pre-RoPE key channels carry large offsets that a
  zero-containing range would waste at 2-3 bits.
* Keys, per channel: one (lo, scale) per (sequence, kv head, channel) over the tokens of the call
  (**dynamic**, the default), or **static** per-layer per-channel ranges calibrated offline
  (:func:`calibrate_kv`; needs a layer-bound quantizer, see below).
* Values, per token: one (lo, scale) per (token, kv head) over ``head_dim``.
* Outliers (``outlier_fraction = f > 0``): dynamic keys keep the ``round(f * T)`` largest-magnitude
  entries of each channel, values the ``round(f * Hkv * hd)`` largest of each token, in float16; the
  range is computed without them. Static keys: entries outside the calibrated ``[f/2, 1 - f/2]``
  per-channel quantiles are outliers.
* Sink tokens: the first ``sink_tokens`` *positions* are kept in float16 and excluded from key ranges.
* Non-uniform levels (``key_levels`` / ``value_levels``, KVQuant's "NUQ" idea without its per-layer
  fit): ``2**b`` sorted positions ``c_j`` in ``[0, 1]`` of the same ``[lo, lo + q * scale]`` range;
  ``code`` = the nearest ``c_j`` (a tie goes to the lower one), ``x_hat = lo + c_code * q * scale``.
  The codes take the same ``b`` bits; the levels are one table per model (not per token). At 2 bits the
  uniform grid spends two of its four levels on the block's minimum and maximum, which only the
  extreme entries use.
* Float recent block (``recent_float``, KIVI's residual; needs ``key_group``): a cache quantizes a key
  block only once its ``key_group`` tokens are all written, so until then they are float16. Evaluating a
  whole window, query ``i`` therefore reads keys and values of its own block (positions
  ``i - i % key_group .. i``) as float16 and the earlier blocks quantized (whose ranges cover past
  tokens only; the dynamic outliers are still chosen over the call's tokens). :func:`kv_bytes` counts
  one block of float16 keys and values on top of the codes. In decoding with a cache (which holds each
  call's fake-quantized entries) the block does not apply.

The model's hook is ``keys(k)`` / ``values(v)`` with no layer index and no positions: an unbound
quantizer assumes the call's tokens start at position 0 (true for perplexity windows) and can only
use dynamic keys. :func:`kv_apply` (a drop-in for ``Model.apply``) binds each layer's quantizer with
:meth:`KVQuant.bind` (layer index and start position), which static keys and sinks in incremental
decoding need.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KVQuant", "kv_bytes_per_token", "kv_bytes", "kv_apply", "calibrate_kv", "kv_fake_quant_channels"]

_F16 = jnp.float16


def _f16_down(x: jax.Array) -> jax.Array:
    """float16 value <= x (as float32)."""
    h = x.astype(_F16)
    h = jnp.where(h.astype(jnp.float32) > x, jnp.nextafter(h, jnp.asarray(-jnp.inf, _F16)), h)
    return h.astype(jnp.float32)


def _f16_up(x: jax.Array) -> jax.Array:
    """float16 value >= x (as float32), at least the smallest float16 subnormal."""
    h = x.astype(_F16)
    h = jnp.where(h.astype(jnp.float32) < x, jnp.nextafter(h, jnp.asarray(jnp.inf, _F16)), h)
    return jnp.maximum(h.astype(jnp.float32), float(jnp.finfo(_F16).smallest_subnormal))


def _qparams(lo: jax.Array, hi: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """(lo16, scale16) as float32 for a float range; an empty/degenerate range gets scale 1."""
    qmax = 2**bits - 1
    lo = jnp.where(jnp.isfinite(lo), lo, 0.0)
    hi = jnp.where(jnp.isfinite(hi), hi, lo)
    lo16 = _f16_down(lo)
    span = jnp.maximum(hi - lo16, 0.0)
    scale = jnp.where(span > 0, _f16_up(span / qmax), 1.0)
    return lo16, scale


def _grid(x: jax.Array, lo: jax.Array, scale: jax.Array, bits: int, levels: tuple[float, ...] | None = None) -> jax.Array:
    """``x`` rounded to the grid of ``[lo, lo + (2**bits - 1) * scale]``: uniform, or the nearest of
    ``levels`` (positions in [0, 1] of that range; ties to the lower level)."""
    qmax = 2**bits - 1
    if levels is None:
        code = jnp.clip(jnp.round((x - lo) / scale), 0, qmax)
        return lo + code * scale
    c = np.asarray(levels, np.float64)
    mids = ((c[1:] + c[:-1]) / 2).astype(np.float32)
    t = (x - lo) / (scale * qmax)
    code = jnp.sum(t[..., None] > jnp.asarray(mids), axis=-1)
    return lo + jnp.asarray(c.astype(np.float32))[code] * (scale * qmax)


def check_levels(levels: Any, bits: int, what: str) -> tuple[float, ...] | None:
    """``levels`` as a tuple of ``2**bits`` increasing floats in [0, 1] (None stays None); ValueError
    naming ``what`` otherwise."""
    if levels is None:
        return None
    try:
        c = tuple(float(v) for v in levels)
    except (TypeError, ValueError):
        raise ValueError(f"KVQuant {what} must be a list of numbers, got {levels!r}") from None
    if bits == 16:
        raise ValueError(f"KVQuant {what} given for a side kept in float (bits 16)")
    if len(c) != 2**bits:
        raise ValueError(f"KVQuant {what} needs 2**{bits} = {2**bits} levels, got {len(c)}")
    if not all(0.0 <= v <= 1.0 for v in c) or any(b <= a for a, b in zip(c, c[1:])):
        raise ValueError(f"KVQuant {what} must increase strictly within [0, 1], got {list(c)}")
    return c


def _topk_mask(mag: jax.Array, k: int, axis: int) -> jax.Array:
    """True at the ``k`` largest entries of ``mag`` along ``axis`` (ties broken by index)."""
    if k <= 0:
        return jnp.zeros(mag.shape, bool)
    m = jnp.moveaxis(mag, axis, -1)
    _, idx = jax.lax.top_k(m, k)
    hit = jnp.zeros(m.shape, bool)
    hit = jnp.put_along_axis(hit, idx, True, axis=-1, inplace=False)
    return jnp.moveaxis(hit, -1, axis)


def kv_fake_quant_channels(
    x: jax.Array, bits: int, *, n_outliers: int = 0, keep: jax.Array | None = None, group: int | None = None,
    levels: tuple[float, ...] | None = None,
) -> jax.Array:
    """Fake-quantize ``x [B, T, H, hd]`` per channel (one range per (B, H, hd) over T).

    ``keep [T]`` marks tokens kept in float16 (sinks; excluded from the range); the ``n_outliers``
    largest-magnitude non-kept entries of each channel (over all T) are kept in float16 too.
    ``group``: one range per block of ``group`` consecutive tokens instead of one over T (the last
    block may be shorter), computed without the kept entries. ``levels``: non-uniform grid (module docs).
    """
    B, T, H, hd = x.shape
    keep_b = None if keep is None else keep[None, :, None, None]
    if group is None or T <= group:
        return _channels(x, bits, n_outliers, keep_b, levels)
    # Outliers are chosen per channel over all T; each block's range then excludes them.
    exact = jnp.zeros(x.shape, bool) if keep_b is None else jnp.broadcast_to(keep_b, x.shape)
    if n_outliers > 0:
        exact = exact | _topk_mask(jnp.where(exact, -1.0, jnp.abs(x.astype(jnp.float32))), n_outliers, axis=1)
    nb = -(-T // group)
    pad = nb * group - T
    xp = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    ep = jnp.pad(exact, ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=True)  # padding: not in ranges
    yb = _channels(xp.reshape(B * nb, group, H, hd), bits, 0, ep.reshape(B * nb, group, H, hd), levels)
    return yb.reshape(B, nb * group, H, hd)[:, :T]


def _channels(x: jax.Array, bits: int, n_outliers: int, keep: jax.Array | None,
              levels: tuple[float, ...] | None = None) -> jax.Array:
    """Per-channel fake quantization over axis 1; ``keep`` broadcasts to ``x`` (True = float16)."""
    xf = x.astype(jnp.float32)
    keep_b = jnp.zeros(xf.shape, bool) if keep is None else jnp.broadcast_to(keep, xf.shape)
    mag = jnp.where(keep_b, -1.0, jnp.abs(xf))
    out = _topk_mask(mag, n_outliers, axis=1)
    exact = keep_b | out
    lo = jnp.min(jnp.where(exact, jnp.inf, xf), axis=1, keepdims=True)
    hi = jnp.max(jnp.where(exact, -jnp.inf, xf), axis=1, keepdims=True)
    lo16, scale = _qparams(lo, hi, bits)
    xq = _grid(xf, lo16, scale, bits, levels)
    xq = jnp.where(exact, xf.astype(_F16).astype(jnp.float32), xq)
    return xq.astype(x.dtype)


def _fake_quant_tokens(x: jax.Array, bits: int, *, n_outliers: int = 0, keep: jax.Array | None = None,
                       levels: tuple[float, ...] | None = None) -> jax.Array:
    """Values: one range per (B, T, H) over hd; outliers chosen per token over all heads."""
    B, T, H, hd = x.shape
    xf = x.astype(jnp.float32)
    flat = xf.reshape(B, T, H * hd)
    out = _topk_mask(jnp.abs(flat), n_outliers, axis=2).reshape(xf.shape)
    lo = jnp.min(jnp.where(out, jnp.inf, xf), axis=3, keepdims=True)
    hi = jnp.max(jnp.where(out, -jnp.inf, xf), axis=3, keepdims=True)
    lo16, scale = _qparams(lo, hi, bits)
    xq = _grid(xf, lo16, scale, bits, levels)
    exact = out if keep is None else out | keep[None, :, None, None]
    xq = jnp.where(exact, xf.astype(_F16).astype(jnp.float32), xq)
    return xq.astype(x.dtype)


def _n_out(fraction: float, n: int) -> int:
    return int(math.floor(fraction * n + 0.5)) if fraction > 0 else 0


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """KV-cache fake quantizer (see the module docs). Hashable; pass as ``kv_quant``.

    Attributes:
      key_bits, value_bits: 2..8 (16 keeps that side in float).
      outlier_fraction: fraction of entries kept in float16 (dense-and-sparse); 0 disables.
      sink_tokens: the first positions kept in float16 (attention sinks).
      key_group: dynamic keys get one range per channel per block of this many tokens (None: one
        range over the call's tokens).
      value_group: values get one range per token per this many channels (must divide head_dim;
        None: one per kv head).
      key_ranges: static per-layer per-channel key ranges ``((lo..., hi...), ...)`` (one
        ``(tuple[Hkv*hd], tuple[Hkv*hd])`` per layer) from :func:`calibrate_kv`; None = dynamic.
      recent_float: a query reads its own still-filling key block in float16 (module docs).
      key_levels, value_levels: non-uniform grids (``2**bits`` increasing positions in [0, 1] of each
        range, module docs); None = uniform.
      layer: the bound layer index (set by :meth:`bind`), else None.
      start: position of the call's first token (set by :meth:`bind`); an int or a traced scalar.
    """

    key_bits: int = 4
    value_bits: int = 4
    outlier_fraction: float = 0.0
    sink_tokens: int = 0
    key_group: int | None = None
    value_group: int | None = None
    key_ranges: tuple | None = dataclasses.field(default=None, repr=False)
    key_levels: tuple[float, ...] | None = None
    value_levels: tuple[float, ...] | None = None
    recent_float: bool = False
    layer: int | None = None
    start: Any = 0
    name: str = "kvquant"

    def __post_init__(self) -> None:
        for side, b in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if b != 16 and not (isinstance(b, (int, np.integer)) and 2 <= b <= 8):
                raise ValueError(f"KVQuant {side} must be 2..8 (or 16 = float), got {b!r}")
        if not 0.0 <= self.outlier_fraction < 0.5:
            raise ValueError(f"KVQuant outlier_fraction must be in [0, 0.5), got {self.outlier_fraction}")
        if self.sink_tokens < 0:
            raise ValueError(f"KVQuant sink_tokens must be >= 0, got {self.sink_tokens}")
        for side, g in (("key_group", self.key_group), ("value_group", self.value_group)):
            if g is not None and not (isinstance(g, (int, np.integer)) and g >= 1):
                raise ValueError(f"KVQuant {side} must be a positive int or None, got {g!r}")
        if self.recent_float and (self.key_group is None or self.key_ranges is not None):
            raise ValueError("KVQuant recent_float needs dynamic keys in blocks (key_group) and no static key ranges")
        object.__setattr__(self, "key_levels", check_levels(self.key_levels, self.key_bits, "key_levels"))
        object.__setattr__(self, "value_levels", check_levels(self.value_levels, self.value_bits, "value_levels"))

    # ------------------------------------------------------------------ config
    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "KVQuant":
        """From a recipe file's ``kv`` table: ``{key_bits, value_bits, outlier_fraction?, sink_tokens?}``."""
        d = dict(d)
        known = {"key_bits", "value_bits", "bits", "outlier_fraction", "sink_tokens", "key_group", "value_group",
                 "key_levels", "value_levels", "recent_float"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown kv key(s) {sorted(unknown)}; allowed: {sorted(known)}")
        bits = d.pop("bits", None)
        kb = int(d.pop("key_bits", bits if bits is not None else 4))
        vb = int(d.pop("value_bits", bits if bits is not None else 4))
        kg, vg = d.pop("key_group", None), d.pop("value_group", None)
        return cls(kb, vb, float(d.pop("outlier_fraction", 0.0)), int(d.pop("sink_tokens", 0)),
                   key_group=None if kg is None else int(kg), value_group=None if vg is None else int(vg),
                   key_levels=d.pop("key_levels", None), value_levels=d.pop("value_levels", None),
                   recent_float=bool(d.pop("recent_float", False)))

    def bind(self, layer: int, start: Any = 0) -> "KVQuant":
        """This quantizer for layer ``layer`` with the call's first token at position ``start``."""
        if self.key_ranges is not None and not 0 <= layer < len(self.key_ranges):
            raise ValueError(f"KVQuant has static key ranges for {len(self.key_ranges)} layers, not layer {layer}")
        return dataclasses.replace(self, layer=layer, start=start)

    @property
    def float_block(self) -> int:
        """Tokens per float recent block (``key_group`` with ``recent_float``), else 0 (models' attention)."""
        return int(self.key_group) if self.recent_float else 0

    @property
    def is_static(self) -> bool:
        return self.key_ranges is not None

    def _keep(self, T: int) -> jax.Array | None:
        if self.sink_tokens <= 0:
            return None
        pos = jnp.asarray(self.start, jnp.int32) + jnp.arange(T, dtype=jnp.int32)
        return pos < self.sink_tokens

    # ------------------------------------------------------------------ hook
    def keys(self, k: jax.Array) -> jax.Array:
        """Fake-quantized pre-RoPE keys ``[B, T, Hkv, hd]``."""
        if self.key_bits == 16:
            return k
        T = k.shape[1]
        keep = self._keep(T)
        if self.key_ranges is None:
            n_out = _n_out(self.outlier_fraction, T - min(self.sink_tokens, T) if keep is not None else T)
            return kv_fake_quant_channels(k, self.key_bits, n_outliers=n_out, keep=keep, group=self.key_group,
                                          levels=self.key_levels)
        if self.layer is None:
            raise ValueError(
                "KVQuant with static (calibrated) key ranges needs a layer index: use kv_apply(...) or "
                "kvq.bind(layer_index, start) per layer"
            )
        lo_t, hi_t = self.key_ranges[self.layer]
        shape = (1, 1) + k.shape[2:]
        lo = jnp.asarray(np.asarray(lo_t, np.float32).reshape(shape))
        hi = jnp.asarray(np.asarray(hi_t, np.float32).reshape(shape))
        kf = k.astype(jnp.float32)
        lo16, scale = _qparams(lo, hi, self.key_bits)
        kq = _grid(kf, lo16, scale, self.key_bits, self.key_levels)
        exact = jnp.zeros(kf.shape, bool)
        if self.outlier_fraction > 0:
            exact = (kf < lo) | (kf > hi)
        if keep is not None:
            exact = exact | keep[None, :, None, None]
        kq = jnp.where(exact, kf.astype(_F16).astype(jnp.float32), kq)
        return kq.astype(k.dtype)

    def values(self, v: jax.Array) -> jax.Array:
        """Fake-quantized values ``[B, T, Hkv, hd]`` (per token and kv head)."""
        if self.value_bits == 16:
            return v
        B, T, H, hd = v.shape
        g = hd if self.value_group is None else self.value_group
        if hd % g:
            raise ValueError(f"KVQuant value_group {g} must divide the head dim {hd}")
        vq = _fake_quant_tokens(
            v.reshape(B, T, H * hd // g, g), self.value_bits, n_outliers=_n_out(self.outlier_fraction, H * hd),
            keep=self._keep(T), levels=self.value_levels,
        )
        return vq.reshape(v.shape)


# ---------------------------------------------------------------------- bytes
def kv_bytes(config: Any, kvq: KVQuant | None, seq_len: int) -> int:
    """Exact bytes of one sequence's KV cache of ``seq_len`` tokens, all layers, as stored.

    Per layer: codes (``bits/8`` per entry, packed), values' float16 (lo, scale) per (token, kv head)
    or per (token, ``value_group`` channels); dynamic keys' float16 (lo, scale) per (kv head, channel)
    per sequence or per block of ``key_group`` tokens (outliers per block); static keys' per-layer
    ranges (counted once, in the sequence's total); sink tokens as float16 entries (no codes);
    each outlier as a float16 value + an int16 index (token index for key outliers, channel index for
    value outliers; counts per channel/token are fixed, so no row pointers); ``recent_float``: one block of
    float16 keys and values on top (the tokens not yet quantized). Static keys' outliers are
    data-dependent: counted at the nominal ``outlier_fraction``. ``kvq=None``: float16 cache.
    """
    L = config.n_layers
    H = getattr(config, "n_kv_heads", None) or config.n_heads
    hd = config.head_dim
    C = H * hd
    if kvq is None:
        return L * 2 * seq_len * C * 2
    sink = min(kvq.sink_tokens, seq_len)
    Tq = seq_len - sink
    per_layer = 0.0
    # keys
    if kvq.key_bits == 16:
        per_layer += seq_len * C * 2
    else:
        per_layer += sink * C * 2 + math.ceil(Tq * C * kvq.key_bits / 8)
        # (lo, scale) per channel: per sequence or per block of key_group tokens (dynamic), per layer (static)
        kg = seq_len if kvq.is_static or kvq.key_group is None else min(kvq.key_group, seq_len)
        n_blocks = -(-seq_len // kg)
        per_layer += n_blocks * C * 2 * 2
        if kvq.outlier_fraction > 0:
            n = _n_out(kvq.outlier_fraction, Tq) * C if not kvq.is_static else kvq.outlier_fraction * Tq * C
            per_layer += n * (2 + 2)
    # values
    if kvq.value_bits == 16:
        per_layer += seq_len * C * 2
    else:
        per_layer += sink * C * 2 + math.ceil(Tq * C * kvq.value_bits / 8)
        per_layer += Tq * (C // (kvq.value_group or hd)) * 2 * 2  # (lo, scale) per token per value group
        per_layer += Tq * _n_out(kvq.outlier_fraction, C) * (2 + 2)
    per_layer += min(kvq.float_block, seq_len) * C * 2 * 2  # the float16 recent block of keys and values
    return int(round(L * per_layer))


def kv_bytes_per_token(config: Any, kvq: KVQuant | None, *, seq_len: int = 1024) -> float:
    """:func:`kv_bytes` of a ``seq_len``-token sequence divided by ``seq_len`` (all layers, K and V)."""
    return kv_bytes(config, kvq, seq_len) / seq_len


# ---------------------------------------------------------------------- apply
def kv_apply(
    model: Any, params: Mapping[str, Any], tokens: jax.Array, kvq: KVQuant | None, *, cache: Any = None
) -> tuple[jax.Array, Any]:
    """``model.apply`` with each layer's quantizer bound to its layer index and start position.

    Same signature and result as :meth:`eqjax.models.Model.apply`; jit with ``static_argnames=("model",
    "kvq")``. Needed for static key ranges, and for sink tokens during incremental decoding.
    """
    if kvq is None:
        return model.apply(params, tokens, cache=cache)
    B, T = tokens.shape
    start = 0 if cache is None else cache.length
    positions = model.positions(B, T, start)
    h = model.embed(params, tokens, positions)
    for i, name in enumerate(model.layer_names):
        lc = None if cache is None else cache.layer(i)
        h, lc = model.block(params[name], h, positions, layer_index=i, cache=lc, kv_quant=kvq.bind(i, start))
        if cache is not None:
            cache = cache.with_layer(i, lc)
    logits = model.head(params, h)
    return logits, (None if cache is None else cache.advanced(T))


@dataclasses.dataclass
class _KeyRecorder:
    """Eager-only hook that records each call's pre-RoPE keys (returns them unchanged)."""

    seen: list

    def keys(self, k):
        self.seen.append(np.asarray(k, np.float32))
        return k

    def values(self, v):
        return v


def calibrate_kv(
    model: Any, params: Mapping[str, Any], calibration: Any, kvq: KVQuant, *, batch: int = 4
) -> KVQuant:
    """``kvq`` with static per-layer per-channel key ranges calibrated on ``calibration [n, T]``.

    Range per channel: min/max over all calibration tokens (positions ``>= sink_tokens``), or the
    ``[f/2, 1 - f/2]`` quantiles with ``f = outlier_fraction`` (beyond them = outliers at run time).
    """
    cal = np.asarray(calibration, np.int32)
    if cal.ndim != 2 or cal.shape[0] == 0:
        raise ValueError(f"calibrate_kv needs token windows [n, T], got shape {cal.shape}")
    n, T = cal.shape
    per_layer: list[list[np.ndarray]] = [[] for _ in model.layer_names]
    for s in range(0, n, batch):
        toks = jnp.asarray(cal[s : s + batch])
        pos = model.positions(*toks.shape)
        h = model.embed(params, toks, pos)
        for i, name in enumerate(model.layer_names):
            rec = _KeyRecorder([])
            h, _ = model.block(params[name], h, pos, layer_index=i, kv_quant=rec)
            k = rec.seen[0][:, kvq.sink_tokens :]
            if not np.isfinite(k).all():
                raise ValueError(f"calibrate_kv: non-finite keys in {name}")
            per_layer[i].append(k.reshape(-1, k.shape[2] * k.shape[3]))
    ranges = []
    for ks in per_layer:
        k = np.concatenate(ks, 0)
        if kvq.outlier_fraction > 0:
            lo, hi = np.quantile(k, [kvq.outlier_fraction / 2, 1 - kvq.outlier_fraction / 2], axis=0)
        else:
            lo, hi = k.min(0), k.max(0)
        ranges.append((tuple(float(x) for x in lo), tuple(float(x) for x in hi)))
    return dataclasses.replace(kvq, key_ranges=tuple(ranges))
