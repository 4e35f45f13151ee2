"""Ten rounds of what a Horovod script does, each on a ring of its own: ``hvd.init()``, an
allreduce, an optimizer step, ``hvd.shutdown()``. Each round prints its sum and what this
process holds after the shutdown: threads, open files, mapped shared memory."""

import gc
import os
import threading

import torch

import ringflow.horovod as hvd


def held() -> tuple[int, int, int]:
    gc.collect()
    with open("/proc/self/maps") as maps:
        mapped = sum("/dev/shm/ringflow-" in line for line in maps)
    return threading.active_count(), len(os.listdir("/proc/self/fd")), mapped


for round_ in range(10):
    hvd.init()
    summed = hvd.allreduce(torch.tensor([float(hvd.rank() + round_)]), op=hvd.Sum)
    model = torch.nn.Linear(2, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    hvd.shutdown()
    threads, files, mapped = held()
    print(f"round {round_}: sum {summed.item():g} threads {threads} files {files} mapped {mapped}")
