"""``import horovod.ray`` gives ``ringflow.horovod.ray`` itself, and Horovod's
``horovod.ray.elastic`` and ``horovod.ray.ray_logger`` its modules of those names."""

import sys

import ringflow.horovod.ray
from ringflow.horovod.ray import elastic, ray_logger

sys.modules[f"{__name__}.elastic"] = elastic
sys.modules[f"{__name__}.ray_logger"] = ray_logger
sys.modules[__name__] = ringflow.horovod.ray
