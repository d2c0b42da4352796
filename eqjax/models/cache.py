"""Key/value caches for incremental decoding (JAX pytrees).

Keys are stored *after* RoPE (and after the optional ``kv_quant`` fake quantization, which runs on the
pre-RoPE keys). Slot ``s`` of the sequence axis holds the token at position ``s``; ``length`` counts
the filled slots, which are the same for every batch row (no ragged batches).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["KVCache", "LayerCache", "init_cache"]


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One layer's cache.

    Attributes:
      k: keys ``[B, Hkv, S, hd]`` (post-RoPE).
      v: values ``[B, Hkv, S, hd]``.
      length: int32 scalar, filled slots before this call's tokens.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]  # an int, or a symbolic dimension under shape-polymorphic tracing


@dataclasses.dataclass(frozen=True)
class KVCache:
    """All layers' caches, stacked.

    Attributes:
      k: keys ``[L, B, Hkv, S, hd]`` (post-RoPE).
      v: values ``[L, B, Hkv, S, hd]``.
      length: int32 scalar, number of filled positions (same for every layer and row).
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]  # an int, or a symbolic dimension under shape-polymorphic tracing

    def layer(self, i: int) -> LayerCache:
        """Layer ``i``'s view."""
        return LayerCache(self.k[i], self.v[i], self.length)

    def with_layer(self, i: int, lc: LayerCache) -> "KVCache":
        """A copy with layer ``i`` replaced by ``lc`` (``length`` unchanged)."""
        return dataclasses.replace(self, k=self.k.at[i].set(lc.k), v=self.v.at[i].set(lc.v))

    def advanced(self, n: int) -> "KVCache":
        """A copy whose ``length`` moved ``n`` tokens on."""
        return dataclasses.replace(self, length=self.length + jnp.int32(n))


for _cls in (LayerCache, KVCache):
    jax.tree_util.register_dataclass(_cls, data_fields=["k", "v", "length"], meta_fields=[])


def init_cache(
    n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype: Any = jnp.float32
) -> KVCache:
    """An empty cache: zeros ``[n_layers, batch, n_kv_heads, max_len, head_dim]``, length 0."""
    shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


def update_layer(lc: LayerCache, k: jax.Array, v: jax.Array) -> LayerCache:
    """Write ``k, v [B, Hkv, T, hd]`` at slots ``[length, length + T)`` (length unchanged)."""
    start = (0, 0, lc.length, 0)
    return LayerCache(
        jax.lax.dynamic_update_slice(lc.k, k.astype(lc.k.dtype), start),
        jax.lax.dynamic_update_slice(lc.v, v.astype(lc.v.dtype), start),
        lc.length,
    )
