"""``ringflow.horovod.ray``: Horovod's ``horovod.ray`` on ringflow's ranks.

A script written for ``from horovod.ray import RayExecutor`` (or ``ElasticRayExecutor``,
``ray_logger``) runs with that import changed. :class:`RayExecutor` starts its workers as
the ranks of ``ringflow.horovod.run`` and runs functions on them; :class:`ElasticRayExecutor`
runs an elastic function on the Ray cluster's slots as ``ringflow.horovod.run(fn, min_np=,
max_np=)`` does. Each rank's output reaches the caller's standard output, each line
prefixed by ``[rank]`` (an elastic run's by ``[worker]``), as under ``ringflow-run``.
"""

from ringflow.horovod.ray import ray_logger
from ringflow.horovod.ray.elastic import (
    ElasticRayExecutor,
    ElasticSettings,
    RayHostDiscovery,
    TestDiscovery,
)
from ringflow.horovod.ray.runner import RayExecutor, Settings

__all__ = [
    "ElasticRayExecutor",
    "ElasticSettings",
    "RayExecutor",
    "RayHostDiscovery",
    "Settings",
    "TestDiscovery",
    "ray_logger",
]
