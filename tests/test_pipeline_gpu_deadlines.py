"""On GPUs the pipeline's NCCL links keep ringflow's deadlines: a stage whose neighbour died
or stalls mid-step raises ``CollectiveTimeoutError`` within the deadline, never a hang on
NCCL's own timeout. Marked ``gpu``: run with ``-m gpu`` on a machine with 2 CUDA devices."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.net import free_port
from tests.test_gpu_workers import needs_2_gpus

DEADLINE_S = 3.0


def _stage(stage: int, port: int, fault: str, results) -> None:
    import datetime as dt
    import faulthandler

    import torch.distributed as dist

    from ringflow.engine.errors import CollectiveTimeoutError, PeerLostError
    from ringflow.engine.pipeline.p2p import FORWARD, StageLink

    faulthandler.dump_traceback_later(60, exit=True)  # a hang shows where it hangs
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # as the pipeline's workers set it
    torch.cuda.set_device(stage)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=stage == 0)
    dist.init_process_group(
        "nccl", store=store, rank=stage, world_size=2, timeout=dt.timedelta(seconds=120)
    )
    link = StageLink(store=None, stage=stage, stages=2, timeout_s=DEADLINE_S, backend="nccl")
    activation = torch.ones(1024, device="cuda")
    if stage == 0:
        link.send(activation, what=FORWARD, micro=0)
        link.flush()
        torch.cuda.synchronize()
        store.set("sent", "1")
        store.wait(["received"])
        if fault == "dies":
            os._exit(1)  # mid-step: micro-batch 1 never leaves
        time.sleep(60)  # stalls
        return
    first = link.post_receive((1024,), torch.float32, torch.device("cuda"), what=FORWARD, micro=0)
    assert float(link.wait(first).sum()) == 1024
    store.set("received", "1")
    started = time.monotonic()
    try:
        pending = link.post_receive(
            (1024,), torch.float32, torch.device("cuda"), what=FORWARD, micro=1
        )
        float(link.wait(pending).sum())  # the host syncs on the GPU, as a step's end does
        link.flush()
        results.put(("no error", time.monotonic() - started))
    except (CollectiveTimeoutError, PeerLostError) as err:
        results.put((type(err).__name__, time.monotonic() - started))
    except BaseException as err:  # noqa: BLE001 - reported, so the test says what went wrong
        results.put((repr(err), time.monotonic() - started))
    results.close()
    results.join_thread()  # put() hands the report to a feeder thread: let it finish
    os._exit(0)  # a communicator was aborted: leave without NCCL's teardown


@needs_2_gpus
@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_a_stage_whose_neighbour_dies_or_stalls_raises_within_the_deadline(fault):
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    stages = [context.Process(target=_stage, args=(s, port, fault, results)) for s in (0, 1)]
    for process in stages:
        process.start()
    try:
        kind, seconds = results.get(timeout=120)
    finally:
        for process in stages:
            process.kill()
            process.join()
    assert kind == "CollectiveTimeoutError", kind
    assert seconds < DEADLINE_S + 5, seconds
