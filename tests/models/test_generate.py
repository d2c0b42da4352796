"""eqjax.models.generate: the jitted decode step is keyed by the matmul backend."""

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.linear import ActQuantKernel, use_backend
from eqjax.core.numerics import QuantSpec, quantize
from eqjax.core.qarray import per_channel
from eqjax.models import LlamaConfig, Model
from eqjax.models import generate as gen


def test_switching_backend_retraces_the_step():
    model = Model(LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=1, n_heads=4, n_kv_heads=2))
    params = model.init_params(jax.random.key(0))
    q = params["layers_0"]["mlp"]["down_proj"]["kernel"]
    params["layers_0"]["mlp"]["down_proj"]["kernel"] = ActQuantKernel(quantize(q, QuantSpec(8, True, per_channel(1))))
    prompt = jnp.asarray([[1, 2, 3]], jnp.int32)
    with use_backend("xla"):
        want = np.asarray(gen.generate(model, params, prompt, 2))
    before = gen._greedy_step._cache_size()
    with use_backend("pallas_interpret"):
        got = np.asarray(gen.generate(model, params, prompt, 2))
    # the other backend compiles its own two programs (prompt, single token) instead of reusing xla's
    assert gen._greedy_step._cache_size() - before == 2
    np.testing.assert_array_equal(got, want)
