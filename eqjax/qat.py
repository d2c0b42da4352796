"""Quantization-aware training of any model :func:`eqjax.quantize_model` takes (:mod:`eqjax.methods.qat`).

::

    qmodel, qparams = eqjax.quantize_model(module, "w3g128-gptq", params=params, calibration=batches)
    qparams = eqjax.qat.train(module, qparams, teacher=params, data=batches, steps=500)       # linen, HF, fn
    logits = qmodel.apply({"params": qparams}, tokens)                     # the same runner, new QArrays

    qnnx = eqjax.quantize_model(nnx_module, "w3g128-gptq", calibration=batches)
    qnnx = eqjax.qat.train(qnnx, teacher=nnx_module, data=batches, steps=500)               # NNX -> QuantizedNNX

    model = eqjax.qat.FakeQuantNNX(qnnx)                 # or your own NNX loop on the quantized module
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=eqjax.qat.QatParam)       # grid units
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, eqjax.qat.QatParam))(model)
    opt.update(model, grads)
    qnnx = model.freeze()

``train`` distills from the float teacher (KL on the logits) unless ``loss`` is given, with
:func:`eqjax.methods.qat.default_optimizer` unless ``optimizer`` is; ``checkpoint`` makes the run resumable
(:func:`eqjax.calibration.train.fit`: Orbax saves, the same batches in the same order after a restart).
The NNX path trains the :class:`FakeQuantNNX` module with ``nnx.Optimizer``.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Iterable, Mapping

import flax.linen as nn
import jax
import optax
from flax import nnx

from eqjax.api import QuantizedFunction, QuantizedLinen, QuantizedNNX, QuantizedParam
from eqjax.calibration.train import fit
from eqjax.core.errors import InputError
from eqjax.core.pytree import flatten_with_paths, unflatten_paths
from eqjax.core.qarray import QArray
from eqjax.methods.qat import (
    FakeQuant,
    default_optimizer,
    distillation_step,
    export,
    fake_value,
    kl_to_teacher,
    logits_of,
    to_qarray,
    trainable,
)

__all__ = ["train", "FakeQuantNNX", "QatParam", "QatScale", "QatZero", "QatUnit"]


class QatParam(nnx.Param):
    """A trainable part of a quantized weight in an NNX module in training: ``nnx.Optimizer(model, tx,
    wrt=QatParam)`` trains the latent weights, scales and zero points (and no float param)."""


class QatScale(QatParam):
    """A quantized weight's relative scale (float32, its QArray's scale layout; the scale is ``scale * unit``)."""


class QatZero(QatParam):
    """A quantized weight's zero point (float32 codes, used rounded)."""


class QatUnit(nnx.Variable):
    """A quantized weight's grid unit (its starting scale): a constant, not trained."""


def _swap(model: nnx.Module, convert: Callable[[str, Any], Any]) -> nnx.Module:
    """A copy of ``model`` with each variable replaced by ``convert(path, variable)``."""
    graphdef, state = nnx.split(model)
    flat = [(path, convert("/".join(map(str, path)), var)) for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _key(path: str) -> str:
    return path.replace("/", "__")


class FakeQuantNNX(nnx.Module):
    """A :class:`~eqjax.api.QuantizedNNX` in training (see the module docs).

    Each QArray's latent float32 weight (in grid units: :mod:`eqjax.methods.qat`) is a :class:`QatParam` where
    the module keeps its kernel; its relative scale (:class:`QatScale`), zero point (:class:`QatZero`) and grid
    unit (:class:`QatUnit`) live under ``qat_grids``; the format (bits, layout, dtypes) is static. The module runs with the fake-quantized weights (straight-through gradients);
    :meth:`freeze` gives the QuantizedNNX of the trained QArrays. Float params stay ``nnx.Param``.
    """

    def __init__(self, qmodel: QuantizedNNX):
        if not isinstance(qmodel, QuantizedNNX):
            raise InputError(f"FakeQuantNNX(qmodel): expected the QuantizedNNX quantize_model returns, found "
                             f"{type(qmodel).__name__}")
        grids: dict[str, Any] = {}
        meta: dict[str, tuple[Any, ...]] = {}

        def to_train(path: str, var: Any) -> Any:
            if not isinstance(var, QuantizedParam):
                return var
            fq = trainable({path: var.get_value()})[0][path]  # refuses a non-QArray quantized leaf, naming it
            grids[_key(path)] = nnx.Dict({"scale": QatScale(fq.scale), "unit": QatUnit(fq.unit),
                                          **({} if fq.zero is None else {"zero": QatZero(fq.zero)})})
            meta[path] = (fq.bits, fq.granularity, fq.dtype, fq.scale_dtype)
            return QatParam(fq.weight)

        self.model = _swap(qmodel.model, to_train)
        self.qat_grids = nnx.Dict(grids)
        self.formats = tuple(sorted(meta.items()))
        self.report = tuple(qmodel.report)

    def fake_quant(self, path: str, weight: Any) -> FakeQuant:
        """The :class:`~eqjax.methods.qat.FakeQuant` of the quantized weight at ``path``."""
        bits, gran, dtype, scale_dtype = dict(self.formats)[path]
        grid = self.qat_grids[_key(path)]
        zero = grid["zero"][...] if "zero" in grid else None
        return FakeQuant(weight, grid["scale"][...], zero, grid["unit"][...], bits, gran, dtype, scale_dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = _swap(self.model, lambda p, v: nnx.Param(fake_value(self.fake_quant(p, v[...])))
                    if isinstance(v, QatParam) else v)
        return run(*args, **kwargs)

    def freeze(self) -> QuantizedNNX:
        """The quantized module of the trained weights (packed QArrays, eqjax's integer matmuls)."""
        frozen = _swap(self.model, lambda p, v: QuantizedParam(to_qarray(self.fake_quant(p, v[...]), p))
                       if isinstance(v, QatParam) else v)
        return QuantizedNNX(frozen, self.report)


def _float_call(model: Any, qparams: Any) -> tuple[Callable[..., Any], Any]:
    """``(fn(params, *args), params)`` for a linen module / HF model / QuantizedLinen / eqjax Model / fn."""
    if isinstance(model, QuantizedLinen):
        model = model.module
    if isinstance(model, QuantizedFunction):
        model = model.fn
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module  # a Hugging Face Flax model
    others: dict[str, Any] = {}
    if isinstance(qparams, Mapping) and "params" in qparams and not isinstance(qparams.get("params"), QArray):
        others = {k: v for k, v in qparams.items() if k != "params"}
        qparams = qparams["params"]
    if isinstance(model, nn.Module):
        return (lambda p, *a: model.apply({"params": p, **others}, *a)), qparams
    if hasattr(model, "apply") and hasattr(model, "config") and hasattr(model, "layer_names"):
        return (lambda p, *a: model.apply(p, *a)[0]), qparams
    if callable(model):
        return model, qparams
    raise InputError(f"eqjax.qat.train: cannot train a {type(model).__name__}: pass the model quantize_model took "
                     "(linen / NNX module, Hugging Face Flax model, eqjax Model or fn(params, *args))")


def _batches(data: Iterable[Any]) -> list[tuple[Any, ...]]:
    if hasattr(data, "shape") or isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise InputError(f"training data (data= of eqjax.qat.train): expected an iterable of argument tuples of the "
                         f"model's call, found {type(data).__name__}")
    out = [b if isinstance(b, tuple) else (b,) for b in data]
    if not out:
        raise InputError("training data (data= of eqjax.qat.train): expected at least one batch, found none")
    return out


def train(
    model: Any,
    qparams: Any = None,
    *,
    teacher: Any = None,
    data: Iterable[Any],
    steps: int,
    optimizer: optax.GradientTransformation | None = None,
    loss: Callable[[Any, Any, tuple[Any, ...]], jax.Array] | None = None,
    checkpoint: str | pathlib.Path | None = None,
    save_every: int = 100,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> Any:
    """Train the quantized weights of ``model`` (see the module docs); returns the new quantized params
    (linen, HF, eqjax Model, function: a tree shaped like ``qparams``) or a new :class:`QuantizedNNX`.

    Args:
      model: what :func:`eqjax.quantize_model` took (or returned: a QuantizedLinen / QuantizedFunction /
        QuantizedNNX); eqjax's own Model (its logits are trained).
      qparams: the quantized params (not for NNX).
      teacher: the float params (NNX: the float module); needed by the default loss.
      data: argument tuples of the model's call (token windows for a language model), one shape.
      steps: optimizer steps (batches cycle in a seeded order).
      optimizer: an optax transformation over the :class:`~eqjax.methods.qat.FakeQuant` tree
        (:func:`~eqjax.methods.qat.leaf_kind` tells its leaves apart); default :func:`default_optimizer`.
      loss: ``loss(student_output, teacher_output, batch) -> scalar``; default KL on the logits.
      checkpoint, save_every, seed, on_step: see :func:`eqjax.calibration.train.fit` (``on_step(step, loss)``
        after each step).
    """
    if loss is None and teacher is None:
        raise InputError("eqjax.qat.train: the default loss distills from the float model: pass teacher= (the "
                         "float params, or the float NNX module), or your own loss=")
    batches = _batches(data)
    tx = optimizer if optimizer is not None else default_optimizer(steps)
    if isinstance(model, QuantizedNNX):
        return _train_nnx(model, teacher, batches, steps, tx, loss, (checkpoint, save_every, seed, on_step))
    if isinstance(model, nnx.Module):
        raise InputError("eqjax.qat.train: an NNX module is trained as the QuantizedNNX quantize_model returns; "
                         "pass that")
    if qparams is None:
        raise InputError("eqjax.qat.train: pass the quantized params (qparams) quantize_model returned")
    fn, tree = _float_call(model, qparams)
    if teacher is not None:
        teacher = _float_call(model, teacher)[1]
    paths, leaves, _ = flatten_with_paths(tree)
    train_w, frozen = trainable(dict(zip(paths, leaves)))
    step = distillation_step(fn, tree, tx, loss)
    run = fit(step, (train_w, tx.init(train_w)), batches, steps=steps, seed=seed, checkpoint=checkpoint,
              save_every=save_every, on_step=on_step, consts=(frozen, teacher))
    return unflatten_paths({**frozen, **export(run.state[0])}, tree)


def _train_nnx(qmodel: QuantizedNNX, teacher: Any, batches: list, steps: int, tx: optax.GradientTransformation,
               loss: Callable | None, run_args: tuple[Any, int, int, Any]) -> QuantizedNNX:
    if teacher is not None and not isinstance(teacher, nnx.Module):
        raise InputError(f"eqjax.qat.train: the teacher of an NNX model is the float nnx.Module, found "
                         f"{type(teacher).__name__}")
    model = FakeQuantNNX(qmodel)
    opt = nnx.Optimizer(model, tx, wrt=QatParam)
    graphdef, state = nnx.split((model, opt))
    tgraph, tstate = nnx.split(teacher) if teacher is not None else (None, None)

    def step(state, batch, tstate):
        m, o = nnx.merge(graphdef, state)
        ref = None if tgraph is None else jax.lax.stop_gradient(nnx.merge(tgraph, tstate)(*batch))

        def objective(mm):
            out = mm(*batch)
            return loss(out, ref, batch) if loss is not None else kl_to_teacher(logits_of(out), logits_of(ref))

        value, grads = nnx.value_and_grad(objective, argnums=nnx.DiffState(0, QatParam))(m)
        o.update(m, grads)
        return nnx.state((m, o)), value

    checkpoint, save_every, seed, on_step = run_args
    run = fit(step, state, batches, steps=steps, seed=seed, checkpoint=checkpoint, save_every=save_every,
              on_step=on_step, consts=(tstate,))
    trained, _ = nnx.merge(graphdef, run.state)
    return trained.freeze()

