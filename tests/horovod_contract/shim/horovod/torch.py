"""``import horovod.torch as hvd`` gives ``ringflow.horovod`` itself (the same module, so that
what Horovod's tests set on it, and its refusals by name, are ringflow's); Horovod's
``horovod.torch.elastic`` and its ``sampler`` and ``state`` modules are
``ringflow.horovod.elastic``."""

import sys

import ringflow.horovod
from ringflow.horovod import elastic

for _module in ("elastic", "elastic.sampler", "elastic.state"):
    sys.modules[f"{__name__}.{_module}"] = elastic
sys.modules[__name__] = ringflow.horovod
