"""ONNX export: the public entry points, and ``eqjax export-onnx``.

There is no hand-written model graph here: every export traces the JAX function eqjax runs
(:func:`eqjax.core.program.trace`) and lowers its program with :mod:`eqjax.export.walker`:

* :func:`eqjax.export.package.export_package`: the edge package for onnxruntime-genai (an eqjax
  :class:`~eqjax.models.Model`'s KV-cache decode step, fused attention / RoPE / norms, tokenizer files);
* :func:`build_model`: the same decoder graph as a ``ModelProto`` (tests, benchmarks);
* :func:`export_function`: any ``fn(params, *args)`` (a user's Flax ``module.apply``, an NNX module called
  functionally, a plain JAX function) with its quantized params, as a bare graph whose inputs are the
  array arguments; dimensions given as ``jax.export.symbolic_shape`` stay dynamic in the graph;
* :func:`linear_graph`: one linear layer (``eqjax.linear.linear``), for per-layer checks.

Modules: ``graph`` (builder, symbolic dims), ``walker`` (primitive lowerings), ``qlower`` (quantized
ops: MatMulNBits / MatMulInteger / DequantizeLinear / GatherBlockQuantized), ``fusions``
(GroupQueryAttention, RotaryEmbedding, SkipSimplifiedLayerNormalization), ``pack`` (sibling
MatMulNBits), ``package`` (directory writer), ``runtime`` (sessions, plain loop, self-check).
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from eqjax.export.graph import OPSET, ExportError, Graph, value_info
from eqjax.export.qlower import W8A8_ZERO_POINT, w8a8_weight_codes
from eqjax.export.runtime import Runner, make_session, perplexity
from eqjax.recipes import EMBEDDINGS

__all__ = ["ExportError", "OPSET", "W8A8_ZERO_POINT", "w8a8_weight_codes", "make_session", "build_model",
           "export_function", "function_graph", "linear_graph", "onnx_logits", "onnx_perplexity", "add_export_args",
           "export_main", "EMBEDDING_CHOICES", "check_context_length", "recipe_for_export"]


def build_model(model: Any, params: Mapping[str, Any], *, accuracy_level: int | None = 0, fuse: bool = True,
                context_length: int | None = None) -> onnx.ModelProto:
    """The decoder graph of ``model`` with ``params`` (see :mod:`eqjax.export.package` for its I/O).

    ``accuracy_level`` 0 (default here): MatMulNBits computes with float activations, i.e. exactly what
    eqjax computes. The graph always has the KV cache.
    """
    from eqjax.export.package import build_decoder  # noqa: PLC0415

    return build_decoder(model, params, accuracy_level=accuracy_level, context_length=context_length, fuse=fuse)[0]


def function_graph(fn: Any, params: Any, args: Sequence[Any], *, input_names: Sequence[str] | None = None,
                   output_names: Sequence[str] | None = None, accuracy_level: int | None = 0,
                   fuse: bool = True) -> onnx.ModelProto:
    """A bare graph of ``fn(params, *args)``: one graph input per array argument (arrays or
    ``jax.ShapeDtypeStruct`` s, whose ``jax.export.symbolic_shape`` dimensions stay dynamic), one output
    per output leaf; quantized params lowered as in the package."""
    import jax  # noqa: PLC0415

    from eqjax.core.analysis import analyze  # noqa: PLC0415
    from eqjax.core.program import trace  # noqa: PLC0415
    from eqjax.export.fusions import find_fusions  # noqa: PLC0415
    from eqjax.export.qlower import export_params  # noqa: PLC0415
    from eqjax.export.walker import Walker  # noqa: PLC0415

    traced, by_path = export_params(params)
    prog = trace(fn, traced, tuple(args), what="function")
    an = analyze(prog)
    names = list(input_names or [f"input_{i}" for i in range(len(prog.args))])
    if len(names) != len(prog.args):
        raise ExportError(f"{len(names)} input names for {len(prog.args)} array arguments")
    sources: dict[str, tuple[str, int]] = {}
    g = Graph()
    inputs = {}
    for vid, nm in zip(prog.args, names):
        aval = prog.avals[vid]
        dims = []
        for ax, d in enumerate(aval.shape):
            if isinstance(d, (int, np.integer)):
                dims.append(int(d))
            else:
                for var in d._get_vars():
                    sources.setdefault(var, (nm, ax)) if str(d) == var else None
                dims.append(str(d))
        g.inputs.append(value_info(nm, aval.dtype, dims))
        inputs[vid] = nm
    g.dim_sources = sources
    w = Walker(prog, an, by_path, g, accuracy_level=accuracy_level,
               fused=find_fusions(prog, None, norms=fuse))
    outs = w.run(inputs)
    onames = list(output_names or (["y"] if len(outs) == 1 else [f"output_{i}" for i in range(len(outs))]))
    for ref, val, nm in zip(prog.outputs, outs, onames):
        g.op("Identity", [w.name(val)], outputs=[nm])
        aval = jax.typeof(ref.value) if not isinstance(ref, int) else prog.avals[ref]
        g.outputs.append(value_info(nm, aval.dtype, [d if isinstance(d, (int, np.integer)) else str(d)
                                                     for d in aval.shape]))
    return g.finish("eqjax_function")


def export_function(fn: Any, params: Any, args: Sequence[Any], path: str | os.PathLike[str], *,
                    overwrite: bool = True, **kw: Any) -> pathlib.Path:
    """:func:`function_graph` checked and written atomically to ``path`` (weights as external data)."""
    from eqjax.atomic import atomic_directory  # noqa: PLC0415

    m = function_graph(fn, params, args, **kw)
    onnx.checker.check_model(m)
    path = pathlib.Path(path)
    with atomic_directory(path, overwrite=overwrite) as tmp:
        onnx.save_model(m, str(pathlib.Path(tmp) / "model.onnx"), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    return path / "model.onnx"


def linear_graph(layer: Mapping[str, Any], *, path: str = "linear", accuracy_level: int | None = 0,
                 batch: int | None = None) -> onnx.ModelProto:
    """One ``eqjax.linear.linear`` layer as a graph ``x [M, K] -> y [M, N]`` (M dynamic)."""
    import jax  # noqa: PLC0415
    from jax import export as jexport  # noqa: PLC0415

    from eqjax.linear import linear  # noqa: PLC0415

    K = int(layer["kernel"].shape[0])
    (m,) = jexport.symbolic_shape("m") if batch is None else (batch,)
    params = {path: dict(layer)}
    return function_graph(lambda p, x: linear(x, p[path]), params, (jax.ShapeDtypeStruct((m, K), np.float32),),
                          input_names=["x"], accuracy_level=accuracy_level)


def onnx_logits(session: Any, tokens: np.ndarray) -> np.ndarray:
    """Prefill logits ``[B, T, V]`` of a decoder graph (empty cache)."""
    return Runner(session).logits(np.asarray(tokens), cache="buffer")  # genai's shared buffer: fused and fallback graphs


def onnx_perplexity(session: Any, windows: np.ndarray) -> float:
    """Perplexity of a decoder graph over token windows ``[n, T]``."""
    return perplexity(Runner(session), windows)


# ------------------------------------------------------------------------------------ CLI
EMBEDDING_CHOICES = ("recipe", *EMBEDDINGS)


def add_export_args(p: Any) -> Any:
    """Arguments of ``eqjax export-onnx``."""
    from eqjax.export.package import TARGETS  # noqa: PLC0415

    p.add_argument("--recipe", default="fp", help="built-in recipe name or a .toml/.json recipe file")
    p.add_argument("--out", required=True, help="output package directory (model.onnx, genai_config.json, tokenizer)")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--target", default="cpu", choices=sorted(TARGETS),
                   help="runtime target: picks the MatMulNBits accuracy level (cpu: float activations, within 0.5 %% of "
                        "eqjax's perplexity; cpu-int8: int8 activations, faster, costs perplexity)")
    p.add_argument("--accuracy-level", type=int, default=None, choices=(0, 1, 2, 3, 4),
                   help="override the MatMulNBits accuracy_level of --target")
    p.add_argument("--embedding", default="recipe", choices=EMBEDDING_CHOICES,
                   help="quantize the embedding table (and a tied LM head): int8 per row, int4 groups of 32, or w7a8 "
                        "(7-bit rows; a tied head's activations int8 per token); 'recipe' keeps what the recipe does")
    p.add_argument("--context-length", type=int, default=None, help="max sequence length (default: the model's)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime vs eqjax logits check")
    p.add_argument("--calib-windows", type=int, default=16, help="calibration windows for calibrated recipes")
    p.add_argument("--calib-len", type=int, default=256)
    return p


def recipe_for_export(name: str, embedding: str = "recipe") -> Any:
    """The recipe ``name``, checked for exportability, with the ``--embedding`` step appended."""
    from eqjax.export.package import check_recipe  # noqa: PLC0415
    from eqjax.recipes import get_recipe, with_embedding  # noqa: PLC0415

    recipe = get_recipe(name)
    check_recipe(recipe)
    if embedding == "recipe":
        return recipe
    if any(str(getattr(s, "name", "")).startswith("embedding-") for s in recipe.steps):
        raise ExportError(f"conflicting embedding options (--embedding {embedding} vs --recipe {name}): expected the "
                          "embedding set once, found it in the recipe as well (drop --embedding or the +emb- suffix)")
    return with_embedding(recipe, embedding)


def check_context_length(model_path: str | None, context_length: int | None) -> None:
    """Refuse ``--context-length`` above the model's trained context (the GGUF header's
    ``llama.context_length``, read without loading the weights), naming the flag and the model's value."""
    if context_length is None:
        return
    from eqjax.errors import CompatibilityError  # noqa: PLC0415
    from eqjax.io.gguf import default_model_path, read_metadata  # noqa: PLC0415

    src = model_path or default_model_path()
    meta = read_metadata(src, tokenizer=False)
    mx = int(meta.get(f"{meta.get('general.architecture', 'llama')}.context_length") or 2048)
    if context_length > mx:
        raise CompatibilityError(f"context length above the model's (--context-length vs {src}: context_length): "
                                 f"expected <= {mx}, found {context_length}")


def export_main(args: Any) -> int:
    """``eqjax export-onnx``: quantize with ``--recipe`` and write the package ``--out``."""
    from eqjax.io.gguf import default_model_path, load_gguf, read_metadata  # noqa: PLC0415
    from eqjax.export.package import export_package  # noqa: PLC0415
    from eqjax.models import Model  # noqa: PLC0415
    from eqjax.recipe import quantize  # noqa: PLC0415

    recipe = recipe_for_export(args.recipe, getattr(args, "embedding", "recipe"))
    src = args.model or default_model_path()
    cfg, params, tok = load_gguf(src)
    model = Model(cfg)
    cal = None
    if recipe.needs_calibration:
        from eqjax.data import calibration_windows, wikipedia_tokens  # noqa: PLC0415

        cal = calibration_windows(wikipedia_tokens(tok)[0], args.calib_windows, args.calib_len, 0)
    qparams = quantize(params, recipe, model=model, calibration=cal, seed=0)
    template = read_metadata(src).get("tokenizer.chat_template")
    man = export_package(model, qparams, args.out, tokenizer=tok, chat_template=template, target=args.target,
                         accuracy_level=args.accuracy_level, context_length=args.context_length, recipe=recipe.name,
                         overwrite=getattr(args, "overwrite", False), check=not args.no_check)
    out = pathlib.Path(args.out)
    print(f"wrote {out}/ (recipe {recipe.name}, target {args.target}, MatMulNBits accuracy_level "
          f"{man['accuracy_level']}):")
    for name, size in man["files"].items():
        print(f"  {name:24s} {size / 2**20:9.2f} MiB")
    print(f"  total {man['bytes'] / 2**20:.1f} MiB; fused ops: " + ", ".join(f"{k} x{v}" for k, v in man["fused"].items()))
    if "check" in man:
        c = man["check"]
        print(f"  check: onnxruntime vs eqjax logits max diff {c['max_rel_diff']:.2e} of their range "
              f"(tolerance {c['tolerance']}), top-1 agreement {c['top1_agreement']:.2f}")
    print(f"chat with it:\n  {sys.executable} -m eqjax.export.chat {out}")
    return 0
