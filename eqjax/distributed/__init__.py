"""Calibration, evaluation and saving on one device, many devices or many hosts: one code path.

* :mod:`~eqjax.distributed.mesh`: the ``(data, model)`` mesh, batch slots, where params live.
* :mod:`~eqjax.distributed.merge`: statistics merged across the mesh in a fixed order.
* :mod:`~eqjax.distributed.runtime`: joining a job (``jax.distributed``), barriers, who writes.
* :mod:`~eqjax.distributed.watchdog` / :mod:`~eqjax.distributed.supervise`: a dead peer or lost
  coordinator ends every survivor with an eqjax error, never a hang.
* :mod:`~eqjax.distributed.consistency`: processes check they hold the same job.
* :mod:`~eqjax.distributed.synced_ema`: EMA activation scales synced across replicas.
* :mod:`~eqjax.distributed.sharded`: :class:`eqjax.calibration.statistics.Statistic` values of arrays already
  sharded over a mesh axis, :func:`host_rows` / :func:`global_batch` for feeding per-process rows.
* :mod:`~eqjax.distributed.tensor_parallel`: quantizing a weight sharded along one dimension.

The Calibrator (:mod:`eqjax.calibration.calibrate`) and :func:`eqjax.evaluate.perplexity` run on
:func:`default_mesh` (every device, or the one set with :func:`use_mesh`); there is no separate
distributed API beside the methods.
"""

from eqjax.distributed.consistency import InconsistentJobError, check_same_job, fingerprint
from eqjax.distributed.merge import COLLECTIVES, Reduction, merge_slots
from eqjax.distributed.mesh import (
                                    DATA,
                                    MODEL,
                                    default_mesh,
                                    describe_mesh,
                                    device_bytes,
                                    make_mesh,
                                    n_steps,
                                    param_sharding,
                                    place,
                                    put,
                                    replicated,
                                    set_default_mesh,
                                    slot_axes,
                                    slot_sharding,
                                    stack_step,
                                    use_mesh,
)
from eqjax.distributed.runtime import (
                                    DEFAULT_TIMEOUT_S,
                                    DistributedError,
                                    DistributedInfo,
                                    add_distributed_args,
                                    barrier,
                                    broadcast_str,
                                    finish,
                                    init_distributed,
                                    init_from_args,
                                    is_main_process,
                                    process_count,
                                    set_stage,
                                    shutdown_distributed,
                                    write_once,
)
from eqjax.distributed.sharded import (  # noqa: F401
                                    DEFAULT_BLOCKS,
                                    _axes_tuple,
                                    compute_statistics,
                                    global_batch,
                                    host_rows,
                                    sharded_statistic,
                                    sharded_statistics,
                                    tree_sum,
)
from eqjax.distributed.synced_ema import synced_ema_update
from eqjax.distributed.tensor_parallel import _tp_plan, qarray_shardings, quantize_sharded  # noqa: F401

__all__ = [
    "DATA", "MODEL", "make_mesh", "default_mesh", "use_mesh", "set_default_mesh", "slot_axes", "replicated", "slot_sharding",
    "param_sharding", "place", "put", "stack_step", "n_steps", "device_bytes", "describe_mesh",
    "Reduction", "merge_slots", "COLLECTIVES",
    "DistributedError", "DistributedInfo", "init_distributed", "add_distributed_args", "init_from_args", "finish",
    "shutdown_distributed", "is_main_process", "process_count", "write_once", "barrier", "broadcast_str",
    "set_stage", "DEFAULT_TIMEOUT_S",
    "InconsistentJobError", "fingerprint", "check_same_job", "synced_ema_update",
    "DEFAULT_BLOCKS", "tree_sum", "compute_statistics", "sharded_statistics", "sharded_statistic", "host_rows",
    "global_batch", "quantize_sharded", "qarray_shardings",
]
