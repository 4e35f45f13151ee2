"""Point-to-point between the neighbouring stages of one pipeline, with deadlines.

Activations flow forward over one process group and their gradients backward over another,
so each group carries traffic one way per pair and both ends see it in the same order; on
NCCL this also keeps a send in one direction from blocking a receive in the other (the
deadlock ``batch_isend_irecv`` exists to avoid). Sends are asynchronous; every receive is
waited for with the deadline ``timeout_s``, and a neighbour that died or stopped answering
raises ``PeerLostError`` or ``CollectiveTimeoutError`` naming that stage, never a hang.

On CPU (gloo) a receive is waited for on the host, up to the deadline. On GPU (NCCL) a wait
only orders the compute stream and the host runs ahead; a thread of this module then holds
every transfer to its deadline (a CUDA event recorded after it), and when one passes it
aborts the link's communicators, so kernels stuck on a dead or silent neighbour return, and
the next wait, send or flush on this stage raises ``CollectiveTimeoutError``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringflow.engine.collective._watchdog import Watchdog
from ringflow.engine.errors import CollectiveTimeoutError, PeerLostError

__all__ = ["PendingReceive", "StageLink"]

FORWARD, BACKWARD = "activation", "gradient"
_SUM_TAG = 1 << 21
"""The tag of :meth:`StageLink.sum_over_stages`' transfers, apart from the steps'."""


@dataclass
class PendingReceive:
    """A receive posted ahead of the action that needs it."""

    work: dist.Work
    buffer: torch.Tensor
    peer: int
    what: str


class StageLink:
    """This stage's connections to the stages before and after it in its pipeline.

    Args:
        store: a rendezvous store shared by the pipeline's stages (give each pipeline
            replica its own ``PrefixStore``).
        stage: this stage's index; its rank in both groups.
        stages: stages in the pipeline.
        timeout_s: every receive's deadline.
        connect_timeout_s: how long connecting may wait for every stage.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        groups: with ``nccl``, the pipeline's two NCCL groups (activations, gradients), each
            with this stage at rank ``stage``; made with ``dist.new_group`` from the default
            process group when not given, which must then hold exactly one rank per stage.
    """

    def __init__(
        self,
        *,
        store: dist.Store | None,
        stage: int,
        stages: int,
        timeout_s: float,
        connect_timeout_s: float = 120.0,
        backend: str = "gloo",
        groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if groups is not None and (backend != "nccl" or len(groups) != len(_DIRS)):
            raise ValueError("groups takes the two NCCL groups of backend='nccl'")
        self.stage, self.stages, self.timeout_s = stage, stages, timeout_s
        self._sends: list[tuple[dist.Work, torch.Tensor, int]] = []
        self.prepost = 2
        """Receives posted ahead of the action that needs them."""
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._deadline, self._watchdog = False, None
        if stages == 1:
            return
        if backend == "nccl":
            if groups is None:  # NCCL's own watchdog stays behind this module's deadlines
                timeout = dt.timedelta(seconds=max(timeout_s, connect_timeout_s) + 60)
                groups = tuple(dist.new_group(backend="nccl", timeout=timeout) for _ in _DIRS)
            self._groups = dict(zip(_DIRS, groups, strict=True))
            self._connect_nccl()
        else:
            timeout = dt.timedelta(seconds=max(timeout_s, connect_timeout_s))
            self._groups = {
                d: dist.ProcessGroupGloo(dist.PrefixStore(d, store), stage, stages, timeout)
                for d in _DIRS
            }
        self._deadline = backend == "gloo"
        if backend == "nccl":
            self._watchdog = Watchdog(
                "ringflow-pipeline-deadlines",
                late=lambda item: time.monotonic() > item[0],
                expire=self._expire,
            )
        # gloo moves bytes on its own threads: receives posted ahead overlap compute. NCCL
        # receives posted ahead of sends in the other direction can stall the pair: none.
        self.prepost = 2 if backend == "gloo" else 0

    def _connect_nccl(self) -> None:
        """Create every pair's NCCL communicator now, in one order on every stage.

        NCCL creates a pair's communicator at its first transfer and blocks the host until
        both ends join: a stage that first receives a gradient would wait there for a
        neighbour that is itself waiting to send it an activation.
        """
        token = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        for what in _DIRS:
            if self.stage > 0:
                self._groups[what].recv([token], self.stage - 1, 0).wait()
            if self.stage < self.stages - 1:
                self._groups[what].send([token], self.stage + 1, 0).wait()
        torch.cuda.synchronize()

    def send(self, tensor: torch.Tensor, *, what: str, micro: int) -> None:
        """Start sending ``tensor`` to the next stage (activation) or the previous (gradient)."""
        peer = self.stage + 1 if what == FORWARD else self.stage - 1
        tensor = tensor.contiguous()
        with self._checked(peer, f"pipeline {what} send"):
            work = self._groups[what].send([tensor], peer, micro)
        self._sends.append((work, tensor, peer))
        self._sends = [s for s in self._sends if not s[0].is_completed()]

    def post_receive(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        *,
        what: str,
        micro: int,
    ) -> PendingReceive:
        """Post the receive of micro-batch ``micro``'s activation (from the previous stage) or
        gradient (from the next)."""
        peer = self.stage - 1 if what == FORWARD else self.stage + 1
        buffer = torch.empty(shape, dtype=dtype, device=device)
        with self._checked(peer, f"pipeline {what} receive"):
            work = self._groups[what].recv([buffer], peer, micro)
        return PendingReceive(work=work, buffer=buffer, peer=peer, what=what)

    def wait(self, pending: PendingReceive) -> torch.Tensor:
        """The received tensor, once it arrived.

        Raises:
            CollectiveTimeoutError: nothing arrived within ``timeout_s``.
            PeerLostError: the neighbour's connection broke (it died).
        """
        self._wait(pending.work, pending.peer, f"pipeline {pending.what} receive")
        return pending.buffer

    def flush(self) -> None:
        """Wait until every send has left (end of a step); on NCCL, until every transfer of
        the step is done on the GPU or one passed its deadline."""
        sends, self._sends = self._sends, []
        for work, _, peer in sends:
            self._wait(work, peer, "pipeline send")
        if self._watchdog is not None:
            self._watchdog.drain()

    def sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the pipeline's stages, in stage order, the same on every
        stage: passed forward from stage to stage, the total then back (the whole model's
        gradient norm, a gradient scaler's overflow)."""
        if self.stages == 1:
            return value
        total = value.detach().reshape(1).clone()
        shape, dtype, device = total.shape, total.dtype, total.device
        if self.stage > 0:
            pending = self.post_receive(shape, dtype, device, what=FORWARD, micro=_SUM_TAG)
            total = self.wait(pending) + total
        if self.stage < self.stages - 1:
            self.send(total, what=FORWARD, micro=_SUM_TAG)
            pending = self.post_receive(shape, dtype, device, what=BACKWARD, micro=_SUM_TAG)
            total = self.wait(pending)
        if self.stage > 0:
            self.send(total, what=BACKWARD, micro=_SUM_TAG)
        self.flush()
        return total.reshape(value.shape)

    def barrier(self) -> None:
        """All stages of the pipeline meet (benchmarks line up their steps with it)."""
        if self._groups:
            self._wait(self._groups[FORWARD].barrier(), None, "pipeline barrier")

    def _wait(self, work: dist.Work, peer: int | None, op: str) -> None:
        if self._watchdog is not None:
            with self._checked(peer, op):
                work.wait()  # the compute stream waits for NCCL's; the host does not
            done = torch.cuda.Event()
            done.record()
            self._watchdog.watch(done, (time.monotonic() + self.timeout_s, peer, op))
            return
        if not self._deadline:
            work.wait()
            return
        try:
            work.wait(dt.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            timed_out = "timed out" in str(err).lower()
            kind = CollectiveTimeoutError if timed_out else PeerLostError
            what = "stopped answering" if timed_out else "was lost"
            raise kind(
                f"pipeline stage {peer} {what} during {op} (stage {self.stage} saw: {err}); "
                f"the deadline is {self.timeout_s:g} s: raise collective_timeout_s "
                "(TrainConfig) if the stages are merely slow",
                peer=peer,
                op=op,
                rank=self.stage,
            ) from err

    @contextlib.contextmanager
    def _checked(self, peer: int | None, op: str):
        """A transfer refused because the link to ``peer`` broke raises ``PeerLostError``:
        gloo refuses one on a pair it closed (the neighbour died, or an earlier transfer
        passed its deadline), NCCL on an aborted communicator, after which the watchdog's
        verdict is raised instead."""
        if self._watchdog is not None:
            self._watchdog.raise_failure()
        try:
            yield
        except RuntimeError as err:
            if self._watchdog is not None:
                self._watchdog.raise_failure()
            raise PeerLostError(
                f"pipeline stage {peer} was lost during {op} (stage {self.stage} saw: {err})",
                peer=peer,
                op=op,
                rank=self.stage,
            ) from err

    def timed_out(self, peer: int | None, op: str) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"pipeline stage {peer} stopped answering during {op}: nothing arrived within "
            f"the deadline of {self.timeout_s:g} s seen by stage {self.stage}; raise "
            "collective_timeout_s (TrainConfig) if the stages are merely slow",
            peer=peer,
            op=op,
            rank=self.stage,
        )

    def _expire(self, item: tuple[float, int | None, str]) -> None:
        """The watchdog's answer to a transfer past its deadline: the verdict, then the abort
        (which can block on the hung kernels: it runs beside the watchdog's exit)."""
        _, peer, op = item
        self._watchdog.failure = self.timed_out(peer, op)
        threading.Thread(target=self.abort, daemon=True).start()

    def abort(self) -> None:
        """End the communicators, so that kernels waiting on a neighbour return."""
        for group in self._groups.values():
            with contextlib.suppress(Exception):  # already failing: best effort
                dist.distributed_c10d._abort_process_group(group)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        self._sends = []
        self._groups = {}


_DIRS = (FORWARD, BACKWARD)
