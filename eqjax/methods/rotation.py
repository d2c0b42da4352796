"""Rotations (QuaRot family): orthogonal randomized-Hadamard rotations that keep the float function
and spread activation / weight outliers over all channels before quantization.

:class:`Rotation` is a recipe step wrapping the steps that quantize the rotated model::

    Recipe("w4a8-rot-gptq", (Rotation(then=(GPTQ(4, 128, pattern=LAYERS),), act_bits=8),))

What it does to a Llama-family param tree (eqjax's own :class:`~eqjax.models.Model`), in float64:

1. **Norm scales folded** into the weights reading them: ``attn_norm`` into the rows of q/k/v,
   ``mlp_norm`` into gate/up, ``final_norm`` into the LM head; the norms' scales become 1 (RMSNorm
   without a scale commutes with an orthogonal map: ``rms(h Q) = rms(h)``).
2. **Residual stream rotated** by ``Q = diag(s) H_D / sqrt(D)`` (:mod:`eqjax.core.hadamard`; a random
   orthogonal matrix with ``residual="random"`` or when no Hadamard of order ``D`` is built): the
   embedding's rows ``E Q``; every weight reading the residual (q/k/v, gate/up, LM head) ``Q^T W``;
   every weight writing into it (o_proj, down_proj; o_proj's bias) ``W Q``. A tied embedding is
   untied: the LM head becomes an ``lm_head`` kernel ``Q^T diag(g_final) E^T`` (a new ``[D, V]``
   float param; the embedding table keeps its size).
3. **Values / o_proj** (``rotate_values``): per kv head ``v_proj``'s columns (and bias) times
   ``Q_hd``, the matching rows of ``o_proj`` (every query head of the kv head) times ``Q_hd^T``:
   exact offline, and ``o_proj``'s input is rotated within each head.
4. **Online Hadamard before down_proj** (``online_down``): ``down_proj`` becomes a
   :class:`~eqjax.core.qarray.RotatedKernel` holding ``Q_F^T W_down``; its use rotates the activation by
   ``Q_F`` with the fast transform (``O(F log F)`` per token; :mod:`eqjax.core.qdot` for any traced
   model, :func:`eqjax.core.linear.linear` for eqjax's models).

The ``then`` steps (RTN, GPTQ, AWQ, ...) run on the rotated float model through a fresh
:class:`~eqjax.recipes.types.Context` whose model call includes the online transforms, so calibration
statistics (GPTQ's Hessians) are those of the rotated activations; their results are wrapped back
(``RotatedKernel`` around down_proj's quantized kernel; ``act_bits``: every quantized layer weight
in an :class:`~eqjax.core.qarray.ActQuantKernel` with dynamic per-token activations, e.g. W4A8 after
GPTQ). The untied LM head is a matmul weight like the others: the ``then`` steps' rules decide (the
built-in recipes keep it float, as the other recipes keep the tied table float).

Supported: eqjax's Llama-family ``Model`` (Llama, Mistral, Qwen2, Qwen3; biases, GQA, q/k norms).
Refused with an :class:`~eqjax.core.errors.InputError` naming why: GPT-2 (LayerNorm subtracts the mean,
which does not commute with a rotation, and adds a bias), a user's model or function (eqjax's core
finds the norm feeding each weight, :mod:`eqjax.core.folds`, but not yet which weights write into the
residual stream), already-quantized weights, widths without a Hadamard order for the online
transform (``online_down=False`` then works).

Not done: learned rotations (SpinQuant's Cayley-SGD on the Stiefel manifold); the post-RoPE online
query/key Hadamard and rotated KV-cache quantization; GGUF export of a model holding a
:class:`~eqjax.core.qarray.RotatedKernel` (refused, naming the weight). Orbax checkpoints keep the leaf;
the HF writer folds the rotation into a float weight; the ONNX export lowers the online Hadamard
(:func:`eqjax.export.qlower.emit_rotation`).

Measured on SmolLM2 (bench/results/quality_rotation.md, 8 x 1024 eval tokens, 16 x 512 calibration):
rotation helps W8A8 with per-token int8 activations (+0.28 % vs +2.86 % over FP) and GPTQ W4 g128
(22.44 vs 24.67 ppl), and hurts plain W4 g128 RTN (38.42 vs 25.80; cause not established: the
per-weight RTN error with isotropic inputs is about the same in both bases). The untied float LM
head adds ``D x V`` float32 params (113 MB on SmolLM2) unless the ``then`` steps quantize it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import jax
import numpy as np

from eqjax.core.errors import InputError
from eqjax.core.hadamard import HadamardError, hadamard_factors, random_signs, rotation_matrix
from eqjax.core.pytree import flatten_with_paths, unflatten_paths
from eqjax.core.qarray import ActQuantKernel, QArray, RotatedKernel, is_quantized
from eqjax.models import LlamaConfig
from eqjax.recipes.types import Context, with_paths

__all__ = ["Rotation", "rotate_params", "residual_rotation", "LAYERS"]

LAYERS = r"layers_\d+/.*"
"""Name pattern of the decoder layers' params (built-in rotated recipes keep the LM head float)."""


class RotationError(InputError):
    """The model (or its params) cannot be rotated; the message names why."""


def residual_rotation(d: int, seed: int, kind: str = "hadamard") -> np.ndarray:
    """The orthogonal ``[d, d]`` float64 residual rotation: randomized Hadamard, or (``"random"``, or
    no Hadamard of order ``d``) a Haar-random orthogonal matrix from ``seed``."""
    if kind == "hadamard":
        try:
            hadamard_factors(d)
            return rotation_matrix(d, random_signs(d, seed))
        except HadamardError:
            pass
    elif kind != "random":
        raise ValueError(f"rotation residual must be 'hadamard' or 'random', got {kind!r}")
    a = np.random.default_rng(seed).normal(size=(d, d))
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))[None, :]


def _check_model(model: Any) -> Any:

    cfg = getattr(model, "config", None)
    if model is None:
        raise RotationError("rotation: needs eqjax's own Llama-family Model (model=eqjax.models.Model): for a user's "
                            "model or function eqjax does not yet know which weights write into the residual stream")
    if not isinstance(cfg, LlamaConfig):
        raise RotationError(f"rotation: {type(cfg).__name__} models cannot be rotated: GPT-2's LayerNorm subtracts "
                            "the mean and adds a bias, which do not commute with a rotation of the residual stream")
    return cfg


def _f64(x: Any, path: str) -> np.ndarray:
    if is_quantized(x):
        raise RotationError(f"rotation: {path} is already quantized; rotate the float model first")
    return np.asarray(x, np.float64)


def rotate_params(params: Mapping[str, Any], cfg: Any, *, seed: int = 0, residual: str = "hadamard",
                  rotate_values: bool = True, online_down: bool = True) -> tuple[dict[str, Any], dict[str, int]]:
    """Rotated float params by path (module docs, steps 1-4 except wrapping down_proj) and the
    ``{path: seed}`` of the down_proj kernels whose input must be rotated online by ``Q_F``.

    ``params``: flat ``{path: array}`` of a Llama-family tree; returns a new flat dict (``lm_head/kernel``
    added when the embedding is tied), each param in its original dtype.
    """
    p = dict(params)

    def get(path: str) -> np.ndarray:
        if path not in p:
            raise RotationError(f"rotation: no param {path!r} (expected eqjax's Llama param tree)")
        return _f64(p[path], path)

    out: dict[str, Any] = {}

    def put(path: str, v: np.ndarray) -> None:
        like = params.get(path)
        out[path] = np.asarray(v, np.float32 if like is None else np.asarray(like).dtype)

    D, F, hd = cfg.hidden, cfg.intermediate, cfg.head_dim
    Hq, Hkv = cfg.n_heads, cfg.n_kv_heads
    Q = residual_rotation(D, seed, residual)
    Qv = rotation_matrix(hd, random_signs(hd, seed + 1)) if rotate_values else None
    down_seed = seed + 2
    QF = None
    if online_down:
        try:
            hadamard_factors(F)
        except HadamardError as e:
            raise RotationError(f"rotation: the online transform before down_proj needs a Hadamard order for the "
                                f"FFN width: {e} (use online_down=False)") from None
        QF = rotation_matrix(F, random_signs(F, down_seed))
    emb = get("embed/embedding")
    if emb.shape != (cfg.vocab, D):
        raise RotationError(f"rotation: embed/embedding has shape {emb.shape}, expected {(cfg.vocab, D)}")
    put("embed/embedding", emb @ Q)
    online: dict[str, int] = {}
    for i in range(cfg.n_layers):
        L = f"layers_{i}"
        g = get(f"{L}/attn_norm/scale")
        for name in ("q_proj", "k_proj", "v_proj"):
            w = get(f"{L}/attn/{name}/kernel")
            w = Q.T @ (g[:, None] * w)
            if name == "v_proj" and Qv is not None:
                w = (w.reshape(D, Hkv, hd) @ Qv).reshape(D, Hkv * hd)
                if f"{L}/attn/v_proj/bias" in p:
                    b = get(f"{L}/attn/v_proj/bias")
                    put(f"{L}/attn/v_proj/bias", (b.reshape(Hkv, hd) @ Qv).reshape(-1))
            put(f"{L}/attn/{name}/kernel", w)
        put(f"{L}/attn_norm/scale", np.ones_like(g))
        wo = get(f"{L}/attn/o_proj/kernel")
        if Qv is not None:
            wo = np.einsum("ij,hjd->hid", Qv.T, wo.reshape(Hq, hd, D)).reshape(Hq * hd, D)
        put(f"{L}/attn/o_proj/kernel", wo @ Q)
        if f"{L}/attn/o_proj/bias" in p:
            put(f"{L}/attn/o_proj/bias", get(f"{L}/attn/o_proj/bias") @ Q)
        g = get(f"{L}/mlp_norm/scale")
        for name in ("gate_proj", "up_proj"):
            put(f"{L}/mlp/{name}/kernel", Q.T @ (g[:, None] * get(f"{L}/mlp/{name}/kernel")))
        put(f"{L}/mlp_norm/scale", np.ones_like(g))
        wd = get(f"{L}/mlp/down_proj/kernel") @ Q
        if QF is not None:
            wd = QF.T @ wd
            online[f"{L}/mlp/down_proj/kernel"] = down_seed
        put(f"{L}/mlp/down_proj/kernel", wd)
    g = get("final_norm/scale")
    head = get("lm_head/kernel") if "lm_head/kernel" in p else emb.T
    out["lm_head/kernel"] = np.asarray(Q.T @ (g[:, None] * head), np.asarray(params["embed/embedding"]).dtype)
    put("final_norm/scale", np.ones_like(g))
    keep = re.compile(r"layers_\d+/attn/((q|k)_norm/scale|(q|k|v)_proj/bias)")
    for path in p:
        if path not in out:
            if not keep.fullmatch(path):
                raise RotationError(f"rotation: param {path!r} is not part of eqjax's Llama param tree")
            out[path] = p[path]
    return out, online


def _wrap(flat: Mapping[str, Any], online: Mapping[str, int]) -> dict[str, Any]:
    out = dict(flat)
    for path, seed in online.items():
        out[path] = RotatedKernel(flat[path], seed, 0)
    return out


@dataclasses.dataclass(frozen=True)
class Rotation:
    """QuaRot-style rotation, then the ``then`` steps on the rotated model (see the module docs).

    Attributes:
      then: the steps quantizing the rotated float model (RTN, GPTQ, AWQ, ...), in order.
      seed: seed of the random signs (residual ``seed``, values ``seed + 1``, down_proj ``seed + 2``).
      residual: ``"hadamard"`` (randomized Hadamard) or ``"random"`` (Haar-random orthogonal).
      rotate_values: fold a per-head Hadamard into v_proj / o_proj.
      online_down: rotate down_proj's input online (RotatedKernel).
      act_bits: wrap every quantized layer weight in an ActQuantKernel with dynamic per-token
        activations of this many bits (None: leave the ``then`` steps' results as they are).
    """

    then: tuple[Any, ...] = ()
    seed: int = 0
    residual: str = "hadamard"
    rotate_values: bool = True
    online_down: bool = True
    act_bits: int | None = None
    name: str = "rotation"

    def __post_init__(self) -> None:
        if self.residual not in ("hadamard", "random"):
            raise ValueError(f"rotation residual must be 'hadamard' or 'random', got {self.residual!r}")
        if self.act_bits is not None and not (isinstance(self.act_bits, int) and 2 <= self.act_bits <= 8):
            raise ValueError(f"rotation act_bits must be 2..8 or None, got {self.act_bits!r}")
        if not isinstance(self.then, tuple):
            raise ValueError("rotation: 'then' must be a tuple of steps")

    @property
    def needs_calibration(self) -> bool:
        return any(getattr(s, "needs_calibration", False) for s in self.then)

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "Rotation":
        """From a recipe file: ``{then = [steps], seed?, residual?, rotate_values?, online_down?, act_bits?}``
        (``then``'s tables already built into steps by :func:`eqjax.recipes.registry.recipe_from_dict`)."""

        d = dict(d)
        then = d.pop("then", [])
        if not isinstance(then, list):
            raise ValueError("rotation: 'then' must be a list of step tables")
        steps = tuple(then)  # step objects: the registry builds the tables of 'then' before calling this
        known = {"name", "seed", "residual", "rotate_values", "online_down", "act_bits"}
        if set(d) - known:
            raise ValueError(f"unknown 'rotation' key(s): {sorted(set(d) - known)}; allowed: then, {sorted(known)}")
        for k, typ in (("name", str), ("seed", int), ("rotate_values", bool), ("online_down", bool), ("residual", str)):
            if k in d and (not isinstance(d[k], typ) or (typ is int and isinstance(d[k], bool))):
                raise ValueError(f"rotation: {k} must be a {typ.__name__}, got {d[k]!r}")
        return cls(then=steps, **d)

    def __call__(self, params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:

        model = getattr(ctx, "model", None)
        cfg = _check_model(model)
        rot, online = rotate_params(params, cfg, seed=self.seed, residual=self.residual,
                                    rotate_values=self.rotate_values, online_down=self.online_down)
        rot = {k: jax.numpy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in rot.items()}
        template = with_paths(ctx.template, rot)

        def fn(tree: Any, *args: Any) -> Any:

            paths, leaves, _ = flatten_with_paths(tree)
            return model.apply(unflatten_paths(_wrap(dict(zip(paths, leaves)), online), tree), *args)[0]

        inner = Context(fn=fn, batches=ctx.batches, example=ctx.example, template=template, blocks=ctx.blocks,
                        model=None, seed=ctx.seed, progress=ctx.progress, report=ctx.report)
        ctx.report.append(("*", f"{self.name}: residual {self.residual} rotation (D={cfg.hidden})"
                           + (", per-head value rotation" if self.rotate_values else "")
                           + (f", online Hadamard before down_proj (F={cfg.intermediate})" if online else "")
                           + ("" if "lm_head/kernel" in params else ", tied embedding untied (lm_head added)")))
        flat = rot
        for step in self.then:
            flat = step(flat, inner)
        if self.act_bits is not None:
            for path, leaf in list(flat.items()):
                if isinstance(leaf, QArray) and re.fullmatch(LAYERS, path):
                    flat[path] = ActQuantKernel(leaf, None, self.act_bits, "token")
        return _wrap(flat, online)
