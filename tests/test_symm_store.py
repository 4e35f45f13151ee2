"""The symm transport's parts that run without a GPU: its settings, and its store.

The store symmetric memory rendezvous through: a worker that joins a ring later meets the
others, although torch numbers each handle exchange by a count of the whole process. Each
rank runs the exchange as torch's ``StoreExchange::all_gather`` does (set its own key under
its count, wait for and read the peers' under the same count), from a thread of its own with a
TCP store client of its own, through the prefixes a process group adds.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading

import pytest
import torch.distributed as dist

from ringflow.engine.collective import ENVIRONMENT_KNOBS
from ringflow.engine.collective._symm_store import GroupSequenceStore
from ringflow.engine.config import SymmConfig, TrainConfig
from tests.support.net import free_port

GROUP = "nccl/0//1//"
"""The prefix the ring's process group adds to its store's keys."""


def _all_gather(store: dist.Store, count: int, rank: int, world: int, value: bytes) -> list:
    store.set(f"CUDASymmetricMemory/{count}/{rank}", value)
    keys = [f"CUDASymmetricMemory/{count}/{r}" for r in range(world)]
    store.wait(keys, dt.timedelta(seconds=5))
    return [store.get(k) for k in keys]


def _exchanges(port: int, wrap: bool, counts: list[int], exchanges: int) -> dict:
    """Each rank's results: ``counts[r]`` exchanges already made by rank ``r``'s process."""
    results: dict[int, object] = {}
    world = len(counts)

    def run(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, world, False, timeout=dt.timedelta(seconds=10))
        store = GroupSequenceStore(client) if wrap else client
        group = dist.PrefixStore(GROUP, dist.PrefixStore("nccl", store))
        try:
            results[rank] = [
                _all_gather(group, counts[rank] + i, rank, world, b"%d-%d" % (rank, i))
                for i in range(exchanges)
            ]
        except Exception as err:  # noqa: BLE001 - the test reports it
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


@pytest.fixture
def server():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    yield port
    del store


def test_a_member_that_joined_later_meets_the_others_in_every_exchange(server):
    # Ranks 0 and 2 have made 12 exchanges in earlier rings; rank 1 is new.
    results = _exchanges(server, wrap=True, counts=[12, 0, 12], exchanges=3)
    want = [[b"%d-%d" % (r, i) for r in range(3)] for i in range(3)]
    assert results == {0: want, 1: want, 2: want}


def test_without_it_the_new_member_waits_for_keys_nobody_writes(server):
    """What the store prevents: the exchange of torch's own numbering never meets."""
    results = _exchanges(server, wrap=False, counts=[12, 0], exchanges=1)
    assert all(isinstance(r, dist.DistStoreError) for r in results.values()), results


def test_other_keys_and_other_groups_pass_through_as_they_are():
    inner = dist.HashStore()
    store = GroupSequenceStore(inner)
    store.set("nccl/0//cpu//0/0", b"id")
    store.set("a//CUDASymmetricMemory/40/0", b"x")
    store.set("b//CUDASymmetricMemory/41/0", b"y")  # another group: its own first exchange
    store.set("a//CUDASymmetricMemory/42/0", b"z")
    assert inner.get("nccl/0//cpu//0/0") == b"id"
    assert [inner.get(f"a//CUDASymmetricMemory/{n}/0") for n in (0, 1)] == [b"x", b"z"]
    assert inner.get("b//CUDASymmetricMemory/0/0") == b"y"
    assert store.get("a//CUDASymmetricMemory/42/0") == b"z"
    assert store.add("counter", 2) == 2
    assert store.check(["a//CUDASymmetricMemory/40/0"])
    assert not store.check(["a//CUDASymmetricMemory/43/0"])


def test_a_clone_numbers_the_exchanges_as_its_original_does(server):
    """torch may clone a group's store for a connection of its own."""
    inner = dist.TCPStore("127.0.0.1", server, 1, False)
    store = GroupSequenceStore(inner)
    twin = dist.PrefixStore("p", store).clone()  # through torch, as a group's store is
    twin.set("g//CUDASymmetricMemory/31/0", b"a")  # the group "p/g//", its first exchange
    store.set("p/g//CUDASymmetricMemory/32/1", b"b")  # the same group, its second
    want = {"p/g//CUDASymmetricMemory/0/0": b"a", "p/g//CUDASymmetricMemory/1/1": b"b"}
    assert inner.check(list(want))
    assert {key: inner.get(key) for key in want} == want


def test_the_kernel_piece_size_is_a_power_of_two_the_user_may_set():
    import torch

    from ringflow.engine.collective._fused import piece_elements

    default = SymmConfig()
    assert piece_elements(torch.float32, 1000, default) == 1 << 16  # small: a small stage
    assert piece_elements(torch.float32, 1 << 30, default) == 64 << 20  # 256 MiB of float32
    assert piece_elements(torch.float32, 6 << 20, default) == 8 << 20  # 25 MiB bucket: 32 MiB
    set_by_variable = default.with_environment({"RINGFLOW_SYMM_PIECE_MB": "64"})
    assert piece_elements(torch.bfloat16, 1 << 30, set_by_variable) == 32 << 20
    assert piece_elements(torch.bfloat16, 1 << 30, SymmConfig(piece_mb=64)) == 32 << 20
    with pytest.raises(ValueError, match="RINGFLOW_SYMM_PIECE_MB must be a power of two"):
        default.with_environment({"RINGFLOW_SYMM_PIECE_MB": "100"})
    with pytest.raises(ValueError, match=r"symm.piece_mb must be a power of two \(MiB\), got 100"):
        SymmConfig(piece_mb=100)


def test_plain_tensors_from_64_mib_go_through_the_kernel_in_rounds():
    from ringflow.engine.collective._fused import rounds_for

    default = SymmConfig()
    assert rounds_for(64 << 20, in_place=False, settings=default) == 4  # the copy-out hidden
    assert rounds_for((64 << 20) - 2, in_place=False, settings=default) == 1  # smaller: one
    assert rounds_for(1 << 30, in_place=True, settings=default) == 1  # own buffers: no copy
    assert rounds_for(1 << 30, in_place=False, settings=SymmConfig(rounds=1)) == 1
    every_size = default.with_environment(
        {"RINGFLOW_SYMM_ROUNDS": "3", "RINGFLOW_SYMM_ROUNDS_FROM_MB": "0"}
    )
    assert rounds_for(2, in_place=False, settings=every_size) == 3
    with pytest.raises(ValueError, match="RINGFLOW_SYMM_ROUNDS must be 1 to 16, got '17'"):
        default.with_environment({"RINGFLOW_SYMM_ROUNDS": "17"})
    with pytest.raises(ValueError, match="RINGFLOW_SYMM_ROUNDS_FROM_MB must be a whole number"):
        default.with_environment({"RINGFLOW_SYMM_ROUNDS_FROM_MB": "1.5"})


def test_every_symm_setting_is_a_field_its_variable_overrides():
    """Each ``RINGFLOW_SYMM_*`` variable the ring's GPU transport reads is a field of
    ``SymmConfig`` (a field of ``TrainConfig``); where one is set it wins, and the others
    keep what the configuration says."""
    configured = TrainConfig(symm={"depth": 4, "graphs": False}).symm
    assert configured == SymmConfig(depth=4, graphs=False)
    environ = {"RINGFLOW_SYMM_DEPTH": "3", "RINGFLOW_SYMM_BUCKETS": "0", "PATH": "/bin"}
    assert configured.with_environment(environ) == SymmConfig(depth=3, graphs=False, buckets=False)
    assert configured.with_environment({}) == configured
    assert set(ENVIRONMENT_KNOBS) == {
        f"RINGFLOW_SYMM_{f.name.upper()}" for f in dataclasses.fields(SymmConfig)
    }
    with pytest.raises(ValueError, match="RINGFLOW_SYMM_GRAPHS must be true or false"):
        configured.with_environment({"RINGFLOW_SYMM_GRAPHS": "yes"})
    with pytest.raises(ValueError, match="symm.rounds must be 1 to 16, got 0"):
        TrainConfig(symm={"rounds": 0})
