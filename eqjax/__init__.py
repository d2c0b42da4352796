"""eqjax: quantization for large language models in JAX.

The public surface; implementation modules are importable too but may change.
"""

from eqjax import qat  # quantization-aware training: eqjax.qat.train
from eqjax.api import QuantizedFunction, QuantizedLinen, QuantizedNNX, quantize_model
from eqjax.calibration.ema import EmaState, ema_absmax, scale_from_state
from eqjax.core.errors import EqjaxError, InputError, RecipeError, RuleError, RuntimeFailure
from eqjax.core.linear import linear, use_backend
from eqjax.core.numerics import QuantSpec, dequantize, fake_quantize, quantize_with
from eqjax.core.numerics import quantize as quantize_array
from eqjax.core.pytree import tree_nbytes
from eqjax.core.qarray import (
    ActQuantKernel,
    Granularity,
    QArray,
    QArrayError,
    per_channel,
    per_group,
    per_input_group,
    per_output_channel,
    per_tensor,
    validate,
)
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import get_recipe, load_recipe, recipe_names
from eqjax.recipes.rules import Rule
from eqjax.recipes.types import Context, Recipe

__version__ = "0.1.0"

__all__ = [
    "ActQuantKernel", "Context", "EmaState", "EqjaxError", "Granularity", "InputError", "QArray", "QArrayError",
    "QuantSpec", "QuantizedFunction", "QuantizedLinen", "QuantizedNNX", "Recipe", "RecipeError", "Rule", "RuleError",
    "RuntimeFailure", "dequantize", "ema_absmax", "fake_quantize", "get_recipe", "linear", "load_recipe",
    "per_channel", "per_group", "per_input_group", "per_output_channel", "per_tensor", "qat", "quantize", "quantize_array",
    "quantize_model", "quantize_with", "recipe_names", "scale_from_state", "tree_nbytes", "use_backend", "validate",
]
