"""Horovod's ``test_timeline_api`` (``parallel/test_torch.py``), which Horovod's own file
marks skip (its issue 2496), run as it is on each rank: ``ringflow-run -np 2 python
tests/horovod_contract/timeline_api.py`` exits 0 where its assertions hold, with
``horovod.torch`` resolving to ``ringflow.horovod`` (``shim/``)."""

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "shim"))  # before any folder holding another horovod

if __name__ == "__main__":
    path = os.path.join(HERE, "parallel", "test_torch.py")
    spec = importlib.util.spec_from_file_location("test_torch", path)
    test_torch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_torch)
    test_torch.TorchTests("test_timeline_api").test_timeline_api()
    print("test_timeline_api passed")
