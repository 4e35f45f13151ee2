"""``bench.chaos``'s torchft runner: a supervisor with one replica group (one process) per
worker, each restarted at once when it dies, as a cluster scheduler would, and the lighthouse
they find their quorum through (held by the benchmark, as a cluster's lighthouse outlives a job).

    python -m bench._chaos_torchft supervise ROOT NAME     # what bench.chaos starts

A replica trains ``bench.chaos``'s workload with torchft's ``DistributedDataParallel`` and
``Manager`` (gloo, ``min_replica_size=1``): a lost peer leaves the others going on once the
lighthouse has missed its heartbeat, and a restarted replica recovers the state from a live
peer at its first quorum. Participant rank 0 logs each committed step and writes a checkpoint
(model, optimizer, manager) every ``commit_every`` steps, from which a restarted supervisor
(every replica lost) resumes.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.server
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from bench.chaos import BATCH, Workload, final_loss, steps_per_epoch, training_split  # noqa: E402
from bench.ports import free_port  # noqa: E402
from engine.collective._rendezvous import tcp_store  # noqa: E402

HEARTBEAT_TIMEOUT_MS = 1000
"""A killed peer holds the survivors' next quorum for about this long (torchft's default is
5 s); 1 s gave no false deaths on 2 busy cores."""
TIMEOUT = timedelta(seconds=10)
"""Collectives, commits, the state transfer from a peer, connections."""
TITLE = "torchft-replica"
"""In each replica's command line, for the benchmark to find it."""


class _SurvivingDDP:
    """torchft 0.2.0's gradient hook fails (``assert fut._fut``) when a peer dies mid-step,
    taking the survivor down too; this one returns the bucket as it is instead: the manager
    knows of the error already, so the step is not committed and is done again."""

    @staticmethod
    def _comm_hook(manager, bucket):
        work = manager.allreduce(bucket.buffer())
        if work.wait():
            future = work.get_future()
            return getattr(future, "_fut", future)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future


def _loopback_transport():
    """torchft 0.2.0 listens on every interface: its manager's server on ``[::]``, the server
    a recovering peer fetches the state from on ``::``. The benchmark runs on one host, so
    both listen on 127.0.0.1 only; the checkpoint transport this returns goes to the Manager."""
    import torchft.manager
    from torchft.checkpointing import http_transport

    class LoopbackServer(http.server.ThreadingHTTPServer):
        request_queue_size = 1024

        def server_bind(self):
            self.server_address = ("127.0.0.1", self.server_address[1])
            super().server_bind()

    class LoopbackTransport(http_transport.HTTPTransport):
        def address(self) -> str:  # torchft's names socket.gethostname()
            return f"http://127.0.0.1:{self._server.socket.getsockname()[1]}/checkpoint/"

    server = torchft.manager.ManagerServer
    torchft.manager.ManagerServer = lambda *, bind, **kw: server(
        bind="127.0.0.1:" + bind.rsplit(":", 1)[1], **kw
    )
    http_transport._IPv6HTTPServer = LoopbackServer
    return LoopbackTransport(timeout=TIMEOUT, num_chunks=0)


def replica(root: str, name: str) -> int:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from bench.dp_throughput import mlp

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the supervisor
    if os.getppid() != int(os.environ["CHAOS_SUPERVISOR"]):
        return 1  # it died before this line
    torch.set_num_threads(1)
    workload = Workload(**json.loads(Path(f"{root}/{name}/workload.json").read_text()))
    me, checkpoint = int(os.environ["REPLICA_GROUP_ID"]), f"{root}/{name}/checkpoint.pt"
    x, y = training_split(root)
    torch.manual_seed(workload.seed)
    model = mlp(hidden=workload.hidden, layers=workload.layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=workload.lr)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    # The manager connects to its replica group's store, which must exist first.
    store = tcp_store(  # noqa: F841 - kept alive with the manager; on 127.0.0.1 only
        f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", is_master=True, timeout_s=60
    )
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        checkpoint_transport=_loopback_transport(),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        replica_id=f"chaos_{me}",
        hostname="127.0.0.1",
        timeout=TIMEOUT,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=TIMEOUT,
    )
    if os.path.exists(checkpoint):  # a live peer ahead of it heals this replica at its quorum
        state = torch.load(checkpoint, weights_only=True)
        load_state_dict(state)
        manager.load_state_dict(state["manager"])
    ddp = type("SurvivingDDP", (_SurvivingDDP, DistributedDataParallel), {})(manager, model)
    ft_optimizer = Optimizer(manager, optimizer)
    per_epoch = steps_per_epoch(root)
    total = workload.epochs * per_epoch
    while manager.current_step() < total:
        ft_optimizer.zero_grad()  # starts the quorum (and a recovery from a peer)
        rank, count = manager.participating_rank(), manager.num_participants()
        step = manager.current_step()
        epoch, position = divmod(step, per_epoch)
        order = torch.randperm(
            len(y), generator=torch.Generator().manual_seed(workload.seed + epoch)
        )
        batch = order[position * BATCH : (position + 1) * BATCH]
        mine = batch[rank::count] if rank is not None else batch[:1]  # not in: grads zeroed
        F.cross_entropy(ddp(x[mine] / 16.0), y[mine]).backward()
        ft_optimizer.step()  # steps only if every participant committed
        if manager.current_step() > step and rank == 0:
            with open(f"{root}/{name}/steps.log", "a") as log:
                log.write(f"{time.time()} {step + 1}\n")
            if (step + 1) % workload.commit_every == 0 or step + 1 == total:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                state |= {"manager": manager.state_dict(), "step": step + 1}
                torch.save(state, f"{checkpoint}.{os.getpid()}")
                os.replace(f"{checkpoint}.{os.getpid()}", checkpoint)
    Path(f"{root}/{name}/loss-{me}.json").write_text(json.dumps(final_loss(model, root)))
    manager.shutdown(wait=False)
    return 0


@contextlib.contextmanager
def lighthouse() -> Iterator[str]:
    """torchft's lighthouse on 127.0.0.1, for as long as the block runs; its address."""
    from torchft._torchft import LighthouseServer

    port = free_port()
    server = LighthouseServer(
        bind=f"127.0.0.1:{port}",
        min_replicas=1,
        join_timeout_ms=1000,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    try:
        yield f"http://127.0.0.1:{port}"  # server.address() names the host, not the loopback
    finally:
        server.shutdown()


def supervise(root: str, name: str) -> None:
    """One replica per worker, each restarted when it dies, until every one has trained to
    the end; the final loss (replica 0's) in ``result.json``. The lighthouse is the one
    ``TORCHFT_LIGHTHOUSE`` names (the benchmark's, which outlives this process)."""
    workload = Workload(**json.loads(Path(f"{root}/{name}/workload.json").read_text()))

    def spawn(me: int) -> subprocess.Popen:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        env |= {"RANK": "0", "WORLD_SIZE": "1", "REPLICA_GROUP_ID": str(me)}
        env |= {"CHAOS_SUPERVISOR": str(os.getpid()), "GLOO_SOCKET_IFNAME": "lo"}
        command = [sys.executable, "-m", "bench._chaos_torchft", "replica", root, name, TITLE]
        return subprocess.Popen(command, env=env)

    replicas, done = {me: spawn(me) for me in range(workload.workers)}, set()
    try:
        while len(done) < len(replicas):
            for me, process in replicas.items():
                if me in done or process.poll() is None:
                    continue
                if process.returncode == 0:
                    done.add(me)
                else:
                    replicas[me] = spawn(me)
            time.sleep(0.02)
    finally:
        for process in replicas.values():
            if process.poll() is None:
                process.kill()
    loss = json.loads(Path(f"{root}/{name}/loss-0.json").read_text())
    Path(f"{root}/{name}/result.json").write_text(json.dumps({"final_loss": loss}))


if __name__ == "__main__":
    if sys.argv[1] == "replica":
        raise SystemExit(replica(sys.argv[2], sys.argv[3]))
    supervise(sys.argv[2], sys.argv[3])
