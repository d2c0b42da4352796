"""Measured sensitivity for the mixed-precision search (:mod:`eqjax.search.layers`): the effect on the logits of
quantizing one layer (or the embedding table) alone.

* :func:`calibrate_kl`: the ``kl`` proxy: per layer, the mean KL(FP || quantized) of the next-token
  distributions (nats per prediction) with that layer alone at a reference bit width, carried to the
  layer's other candidates in proportion to their Hessian error.
* :func:`method_errors`: each option's Hessian error under the method that will apply the mix (GPTQ
  compensates much of a layer's rounding error, RTN none), so the ``kl`` proxy ranks the options as applied.
* :func:`embedding_layer`: the embedding table(s) as one knapsack item, each option's KL measured.
* :func:`validate_proxy`: the rank correlation of every proxy with measured single-layer KL.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.errors import EqjaxError
from eqjax.core.numerics import QuantSpec
from eqjax.core.pytree import flatten, get_path, set_path
from eqjax.core.qarray import is_quantized
from eqjax.methods.gptq import gptq_matrix
from eqjax.methods.grid import group_ids
from eqjax.methods.halffloat import HALF_KINDS, HalfFloats
from eqjax.recipes.apply import quantize as run_recipe
from eqjax.recipes.registry import embedding_step
from eqjax.recipes.types import Recipe
from eqjax.search.layers import EmbeddingCandidate, Layer, _errors, _fake_quant

__all__ = ["calibrate_kl", "embedding_layer", "method_errors", "validate_proxy", "KLProbe", "kl_from_logits"]


def _spearman(a: Sequence[float], b: Sequence[float]) -> float:
    ra = np.argsort(np.argsort(np.asarray(a)))
    rb = np.argsort(np.argsort(np.asarray(b)))
    return float(np.corrcoef(ra, rb)[0, 1])


def kl_from_logits(ref_logits: jax.Array, logits: jax.Array) -> jax.Array:
    """KL(softmax(ref) || softmax(logits)) per row, in nats, from two ``[..., V]`` float32 logit arrays.

    Computed from the logit difference ``d = logits - ref`` as ``log E_p[exp(d - E_p d)]`` (``log1p`` of an
    ``expm1`` mean), not as ``sum p (log p - log q)``: the latter subtracts two log-probabilities of size
    ``log V`` and keeps an absolute float32 error of about ``ulp(log V)`` (~5e-7 at ``V`` = 100), as large as
    the KL of a layer rounded to 16 bits. Here every term is of the size of ``d``, so the error is a few
    float32 ulps of ``E_p |d|`` and the result is accurate relative to the KL itself.
    """
    p = jax.nn.softmax(ref_logits, -1)
    d = logits - ref_logits
    d = d - jnp.sum(p * d, -1, keepdims=True)
    return jnp.log1p(jnp.sum(p * jnp.expm1(d), -1))


class KLProbe:
    """The float model's next-token logits on ``windows`` and the effect of one layer quantized alone."""

    def __init__(self, model: Any, params: Any, windows: np.ndarray) -> None:
        self.params = params
        self.toks = jnp.asarray(windows, jnp.int32)
        toks = self.toks
        self.fwd = jax.jit(lambda p: model.apply(p, toks)[0][:, :-1].astype(jnp.float32))
        self.ref = self.fwd(params)
        self.nll_ref = self._nll(self.ref)

    def _nll(self, logits: jax.Array) -> float:
        logp = jax.nn.log_softmax(logits, -1)
        return float(-jnp.mean(jnp.take_along_axis(logp, self.toks[:, 1:, None], -1)))

    def of(self, params: Any) -> tuple[float, float]:
        """(mean KL(FP || ``params``) per prediction in nats, NLL change) of another param tree of the model."""
        lq = self.fwd(params)
        kl = float(jnp.mean(kl_from_logits(self.ref, lq)))
        return kl, self._nll(lq) - self.nll_ref

    def measure(self, path: str, spec: QuantSpec) -> tuple[float, float]:
        """(mean KL(FP || quantized) per prediction in nats, NLL change) with only ``path`` fake-quantized."""

        w = jnp.asarray(get_path(self.params, path), jnp.float32)
        return self.of(set_path(self.params, path, _fake_quant(w, spec)))


def _smallest_option(L: Layer, bits: int) -> int | None:
    opts = [j for j, c in enumerate(L.options) if c.bits == bits]
    return min(opts, key=lambda j: L.nbytes[j]) if opts else None


def calibrate_kl(model: Any, params: Any, windows: np.ndarray, layers: Sequence[Layer], *,
                 ref_bits: int | Sequence[int] = 3, progress: Callable[[str], None] | None = None,
                 probe: KLProbe | None = None) -> list[Layer]:
    """``layers`` with a ``kl`` proxy added: the measured KL of the logits (nats per prediction) when a layer alone
    is quantized at its smallest ``ref_bits`` option, carried to the layer's other options in proportion to
    their Hessian error (``kl(c) = kl(ref) * hessian(c) / hessian(ref)``, a layer's second-order KL being
    proportional to its output error). One forward pass per layer and reference width on ``windows``.

    The measured factor carries what the Hessian error of a layer alone cannot: how much the rest of the
    network amplifies or damps that layer's output error. With several widths (``ref_bits=(2, 3)``) each
    option is carried from the reference of the nearest width (the narrower on a tie): the factor is not
    the same at every width (2-bit damage grows faster than the Hessian error says)."""
    probe = probe or KLProbe(model, params, windows)
    widths = sorted({int(b) for b in np.atleast_1d(ref_bits)})
    out = []
    for n, L in enumerate(layers):
        h = L.errors["hessian"]  # the applying method's (method_errors), measured with RTN at the reference
        h_ref = L.errors.get("hessian_rtn", h)
        scale = {}
        for b in widths:
            j = _smallest_option(L, b)
            if j is None:
                raise ValueError(f"{L.path}: no {b}-bit option to measure the kl proxy at")
            kl, _ = probe.measure(L.path, L.options[j].spec(L.shape[0]))
            scale[b] = max(kl, 0.0) / h_ref[j] if h_ref[j] > 0 else 0.0
        near = [min(widths, key=lambda b: (abs(b - c.bits), b)) for c in L.options]
        out.append(dataclasses.replace(L, errors={**L.errors, "kl": tuple(scale[b] * e for b, e in zip(near, h))}))
        if progress and (n + 1) % 10 == 0:
            progress(f"kl proxy: {n + 1}/{len(layers)} layers measured")
    return out


def method_errors(params: Any, hessians: Any, layers: Sequence[Layer], step: Any, *,
                  progress: Callable[[str], None] | None = None) -> list[Layer]:
    """``layers`` with each option's ``hessian`` error (``tr(dW^T H dW)``) recomputed for the result of the
    GPTQ ``step`` (:class:`eqjax.methods.gptq.GPTQ`: its act-order, damping, block size and grid) given the
    layer's ``H``; RTN's is kept as ``hessian_rtn``. One GPTQ sweep per layer and option."""

    out = []
    for n, L in enumerate(layers):
        if L.is_embedding:
            out.append(L)
            continue
        w = np.asarray(get_path(params, L.path), np.float32)
        h = np.asarray(hessians[L.path], np.float64)
        errs = []
        for c in L.options:
            spec = c.spec(L.shape[0])
            g = spec.granularity
            gid, ng = group_ids((L.shape[0],), g.group_size if g.kind == "group" else None)
            q, _, _ = gptq_matrix(w, h, gid, ng, bits=spec.bits, symmetric=spec.symmetric, act_order=step.act_order,
                                  static_groups=step.static_groups, percdamp=step.percdamp, blocksize=step.blocksize,
                                  scale_dtype=spec.scale_dtype, full_range=spec.full_range, grid=step.grid,
                                  grid_kwargs=step.grid_kwargs(), name=L.path)
            errs.append(float(_errors(jnp.asarray(w), jnp.asarray(q, jnp.float32), jnp.asarray(h, jnp.float32))[0]))
        out.append(dataclasses.replace(L, errors={**L.errors, "hessian": tuple(errs), "hessian_rtn": L.errors["hessian"]}))
        if progress and (n + 1) % 10 == 0:
            progress(f"{step.name} errors: {n + 1}/{len(layers)} layers")
    return out


def embedding_layer(model: Any, params: Any, probe: KLProbe, kinds: Sequence[str] = ("int8", "int4")) -> Layer | None:
    """The embedding table(s) (a tied LM head with them) as one searchable pseudo-layer: options ``float`` and
    ``kinds`` (:func:`eqjax.recipes.registry.embedding_rule_dict`'s, or ``f16`` / ``bf16``: the table stored in 16
    bits), their stored bytes, and a ``kl`` error measured directly (one forward pass per option). None when
    the model has no embedding table."""
    import re


    flat = dict(flatten(params))

    def changed(qp: Any) -> tuple[str, ...]:
        return tuple(sorted(k for k, v in flatten(qp) if is_quantized(v) and not is_quantized(flat[k])))

    try:  # the tables: what the embedding step quantizes (by role)
        int8 = run_recipe(params, Recipe("emb-int8", (embedding_step("int8"),)), model=model)
    except EqjaxError:  # quantizes nothing: no embedding table
        return None
    covers = changed(int8)
    if not covers:
        return None
    tables = "|".join(re.escape(p) for p in covers)
    opts, sizes, kls = [EmbeddingCandidate("float")], [sum(int(flat[k].nbytes) for k in covers)], [0.0]
    for kind in kinds:
        step = HalfFloats(HALF_KINDS[kind], tables, name=f"emb-{kind}") if kind in HALF_KINDS else embedding_step(kind)
        qp = int8 if kind == "int8" else run_recipe(params, Recipe(f"emb-{kind}", (step,)), model=model)
        got = changed(qp)
        if got != covers and kind == "f16":  # a value beyond float16's range: no f16 option
            continue
        if got != covers:
            raise ValueError(f"embedding option {kind} stores other params than {covers}: {got}")
        qflat = dict(flatten(qp))
        sizes.append(sum(int(qflat[k].nbytes) for k in covers))
        kls.append(max(probe.of(qp)[0], 0.0))
        opts.append(EmbeddingCandidate(kind))
    shape = tuple(int(d) for d in flat[covers[0]].shape)
    return Layer(covers[0], shape, tuple(opts), tuple(sizes), {"kl": tuple(kls)}, covers)


def validate_proxy(model: Any, params: Any, windows: np.ndarray, layers: Sequence[Layer], *,
                   n_layers: int = 12, bits: Sequence[int] = (2, 3), seed: int = 0,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure the real effect of quantizing one layer alone (mean KL(FP || quantized) of the next-token
    distributions on ``windows``, and the NLL change) for a random subset of layers at each of ``bits``
    (their smallest-group option), and the Spearman rank correlation of each proxy with it. Use windows
    and bits other than those the ``kl`` proxy was measured at, or its correlation is not a check."""
    layers = [L for L in layers if not L.is_embedding]
    rng = np.random.default_rng(seed)
    subset = sorted(rng.choice(len(layers), size=min(n_layers, len(layers)), replace=False).tolist())
    probe = KLProbe(model, params, windows)
    rows = []
    for n, i in enumerate(subset):
        L = layers[i]
        for b in bits:
            j = _smallest_option(L, b)
            if j is None:
                continue
            kl, dnll = probe.measure(L.path, L.options[j].spec(L.shape[0]))
            rows.append({"layer": L.path, "option": L.options[j].label(L.shape[0]), "kl": kl,
                         "dnll": dnll, **{f"proxy_{k}": v[j] for k, v in L.errors.items()}})
        if progress:
            progress(f"proxy check: {n + 1}/{len(subset)} layers")
    kls = [r["kl"] for r in rows]
    names = sorted({k for L in layers for k in L.errors})
    corr = {k: _spearman([r[f"proxy_{k}"] for r in rows], kls) for k in names}
    return {"n_measurements": len(rows), "windows": list(np.asarray(windows).shape), "bits": list(bits),
            "spearman_vs_kl": corr, "rows": rows}
