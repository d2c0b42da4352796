"""The ``eqjax`` command: one parser tree (:mod:`eqjax.cli.main`) over the run, eval, quantize, search and
export commands."""
