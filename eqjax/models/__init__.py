"""Model definitions (Llama family, GPT-2) and the :class:`Model` facade used by calibration code.

Example::

    from eqjax.models import Model, LlamaConfig
    model = Model(LlamaConfig(vocab=128, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2))
    params = model.init_params(jax.random.key(0))
    logits, _ = jax.jit(model.apply)(params, tokens)            # [B, T, V] float32
    out = model.generate(params, tokens, max_new_tokens=8)       # greedy, KV-cached
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from eqjax.core.numerics import widen_halves
from eqjax.models import generate as _decoding
from eqjax.models import gpt2, llama
from eqjax.models.cache import KVCache, LayerCache, init_cache
from eqjax.models.config import ConfigError, GPT2Config, LlamaConfig, ModelConfig, RopeScaling
from eqjax.models.hf_config import from_hf_config, to_hf_config
from eqjax.models.llama import KVQuantizer

__all__ = [
    "Model",
    "LlamaConfig",
    "GPT2Config",
    "ModelConfig",
    "RopeScaling",
    "ConfigError",
    "KVCache",
    "LayerCache",
    "KVQuantizer",
    "from_hf_config",
    "to_hf_config",
]

Params = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder-only LM: its config plus pure functions over a param pytree. Hashable (jit-static).

    Attributes:
      config: a :class:`LlamaConfig` (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3) or :class:`GPT2Config`.
      dtype: activation dtype (``"float32"`` default, or ``"bfloat16"``); norms, softmax and logits
        are float32 regardless.

    Block-by-block use (calibration)::

        h = model.embed(params, tokens, positions)
        for i, name in enumerate(model.layer_names):
            h, _ = model.block(params[name], h, positions, layer_index=i)
        logits = model.head(params, h)
    """

    config: ModelConfig
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.config, (LlamaConfig, GPT2Config)):
            raise TypeError(f"Model needs a LlamaConfig or GPT2Config, got {type(self.config).__name__}")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)

    @property
    def _impl(self) -> Any:
        return gpt2 if isinstance(self.config, GPT2Config) else llama

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """``("layers_0", ..., "layers_{L-1}")``: the keys of the blocks in the param tree."""
        return tuple(f"layers_{i}" for i in range(self.config.n_layers))

    def param_shapes(self) -> dict[str, Any]:
        """The param tree with shape tuples as leaves."""
        return self._impl.param_shapes(self.config)

    def init_params(self, key: jax.Array, std: float = 0.02, dtype: Any = jnp.float32) -> dict[str, Any]:
        """Random params (normal(0, std) weights, unit norm scales, zero biases) for tests."""
        shapes = self.param_shapes()
        leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
        keys = jax.random.split(key, len(leaves))
        out = []
        for (path, shape), k in zip(leaves, keys):
            name = path[-1].key
            if name == "scale":
                out.append(jnp.ones(shape, dtype))
            elif name == "bias":
                out.append(jnp.zeros(shape, dtype))
            else:
                out.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
        return jax.tree.unflatten(treedef, out)

    def positions(self, batch: int, length: int, start: jax.Array | int = 0) -> jax.Array:
        """int32 positions ``[batch, length]``: ``start, start + 1, ...``."""
        return jnp.broadcast_to(jnp.asarray(start, jnp.int32) + jnp.arange(length, dtype=jnp.int32), (batch, length))

    def _widen_outside_layers(self, params: Params) -> Params:
        """``params`` with the HalfFloat leaves of its non-layer entries (tables, final norm, head) widened;
        the layers are left as they are (:meth:`block` widens its own)."""
        layers = set(self.layer_names)
        return {k: v if k in layers else widen_halves(v) for k, v in params.items()}

    def embed(self, params: Params, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Embeddings ``h [B, T, D]`` (compute dtype) of ``tokens [B, T]`` at ``positions [B, T]``."""
        if positions is None:
            positions = self.positions(*tokens.shape)
        params = self._widen_outside_layers(params)
        if isinstance(self.config, GPT2Config):
            return gpt2.embed(self.config, params, tokens, positions, self.compute_dtype)
        return llama.embed(self.config, params, tokens, self.compute_dtype)

    def block(
        self,
        layer_params: Params,
        h: jax.Array,
        positions: jax.Array,
        *,
        layer_index: int,
        cache: LayerCache | None = None,
        kv_quant: KVQuantizer | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """Decoder layer ``layer_index`` on ``h [B, T, D]`` at ``positions [B, T]``.

        Returns ``(h [B, T, D], cache)``: with ``cache=None`` the second item is None; with a
        :class:`LayerCache` the new keys/values are written at ``[cache.length, cache.length + T)``
        (``length`` itself is left for the caller to advance).
        """
        return self._impl.block(
            self.config, widen_halves(layer_params), h, positions, layer_index=layer_index, cache=cache, kv_quant=kv_quant
        )

    def head(self, params: Params, h: jax.Array) -> jax.Array:
        """Final norm and LM head: float32 logits ``[B, T, V]``."""
        return self._impl.head(self.config, self._widen_outside_layers(params), h)

    def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32) -> KVCache:
        """An empty KV cache: k, v ``[L, batch, Hkv, max_len, hd]``, length 0."""
        c = self.config
        return init_cache(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, dtype)

    def apply(
        self, params: Params, tokens: jax.Array, *, cache: KVCache | None = None, kv_quant: KVQuantizer | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        """Logits ``[B, T, V]`` (float32) for ``tokens [B, T]`` (int32), and the advanced cache.

        Without a cache the tokens sit at positions ``0..T-1``; with one they continue at
        ``cache.length``. Jit with ``jax.jit(model.apply, static_argnames="kv_quant")``.
        """
        B, T = tokens.shape
        start: jax.Array | int = 0
        if cache is not None:
            start = cache.length
            if not isinstance(start, jax.core.Tracer) and int(start) + T > cache.max_len:
                raise ValueError(f"KV cache overflow: {int(start)} + {T} tokens > max_len {cache.max_len}")
        positions = self.positions(B, T, start)
        h = self.embed(params, tokens, positions)
        for i, name in enumerate(self.layer_names):
            lc = None if cache is None else cache.layer(i)
            h, lc = self.block(params[name], h, positions, layer_index=i, cache=lc, kv_quant=kv_quant)
            if cache is not None:
                cache = cache.with_layer(i, lc)
        logits = self.head(params, h)
        return logits, (None if cache is None else cache.advanced(T))

    def generate(
        self,
        params: Params,
        prompt_tokens: jax.Array,
        max_new_tokens: int,
        *,
        max_len: int | None = None,
        kv_quant: KVQuantizer | None = None,
    ) -> jax.Array:
        """Greedy decoding: ``[B, T0 + max_new_tokens]`` int32 (see :func:`eqjax.models.generate.generate`)."""
        return _decoding.generate(self, params, prompt_tokens, max_new_tokens, max_len=max_len, kv_quant=kv_quant)
