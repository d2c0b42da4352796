"""eqjax: quantization for large language models in JAX.

The public surface; implementation modules are importable too but may change.
"""

from eqjax.api import QuantizedFunction, QuantizedLinen, QuantizedNNX, quantize_model
from eqjax.ema import EmaState, ema_absmax, scale_from_state
from eqjax.errors import EqjaxError, InputError, RuntimeFailure
from eqjax.linear import linear, use_backend
from eqjax.numerics import QuantSpec, dequantize, fake_quantize, quantize as quantize_array, quantize_with
from eqjax.qarray import (ActQuantKernel, Granularity, QArray, QArrayError, per_channel, per_group, per_input_group,
                          per_output_channel, per_tensor, validate)
from eqjax.recipe import Context, Recipe, RecipeError, load_recipe, quantize
from eqjax.recipes import get_recipe, recipe_names
from eqjax.rules import Rule, RuleError
from eqjax.pytree import tree_nbytes

__version__ = "0.1.0"

__all__ = [
    "ActQuantKernel", "Context", "EmaState", "EqjaxError", "Granularity", "InputError", "QArray", "QArrayError",
    "QuantSpec", "QuantizedFunction", "QuantizedLinen", "QuantizedNNX", "Recipe", "RecipeError", "Rule", "RuleError",
    "RuntimeFailure", "dequantize", "ema_absmax", "fake_quantize", "get_recipe", "linear", "load_recipe",
    "per_channel", "per_group", "per_input_group", "per_output_channel", "per_tensor", "quantize", "quantize_array",
    "quantize_model", "quantize_with", "recipe_names", "scale_from_state", "tree_nbytes", "use_backend", "validate",
]
