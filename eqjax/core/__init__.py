"""The bottom layer, importing nothing else of eqjax: errors, the quantized array types
(:mod:`~eqjax.core.qarray`), quantization numerics (:mod:`~eqjax.core.numerics`), Hadamard transforms, pytree
helpers, param checks, the quantized matmul (:mod:`~eqjax.core.linear`) and tracing a model to a program
(:mod:`~eqjax.core.program`, :mod:`~eqjax.core.analysis`, :mod:`~eqjax.core.interpret`)."""
