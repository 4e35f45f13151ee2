"""``import horovod.torch as hvd`` gives ``ringflow.horovod`` itself (the same module, so that
what Horovod's tests set on it, and its refusals by name, are ringflow's)."""

import sys

import ringflow.horovod

sys.modules[__name__] = ringflow.horovod
