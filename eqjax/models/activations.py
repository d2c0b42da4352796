"""MLP activations by their Hugging Face names (``hidden_act`` / ``activation_function``).

One table for every eqjax model: the Llama family's gated MLP (``act(gate) * up``) and GPT-2's
``act(c_fc)``. Numerics follow transformers' ``ACT2FN``:

* ``silu``: ``x * sigmoid(x)``.
* ``gelu``: exact GELU, ``x * Phi(x)`` with the error function.
* ``gelu_new``, ``gelu_pytorch_tanh``: the tanh approximation
  ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (two names, one function).
* ``relu``: ``max(x, 0)`` (GPT-2 configs only).
"""

from __future__ import annotations

from typing import Callable

import jax

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "activation"]

_FUNCTIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}
ACTIVATIONS: tuple[str, ...] = tuple(_FUNCTIONS)
# The gated (Llama-family) MLPs eqjax checks against transformers: silu and the GELUs.
GATED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh")


def activation(name: str, x: jax.Array) -> jax.Array:
    """``name`` applied elementwise to ``x`` (same shape and dtype). ``name`` must be in :data:`ACTIVATIONS`."""
    return _FUNCTIONS[name](x)
