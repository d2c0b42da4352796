"""The calibration engine every calibrated method runs on: activation statistics
(:mod:`~eqjax.calibration.statistics`), running absmax EMAs (:mod:`~eqjax.calibration.ema`), the block-by-block
calibrator over a traced model (:mod:`~eqjax.calibration.calibrate`) and block output fitting
(:mod:`~eqjax.calibration.blockfit`)."""
