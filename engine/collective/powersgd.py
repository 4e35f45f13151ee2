"""PowerSGD (Vogels et al., 2019): each gradient matrix sent as two thin factors.

A bucket's gradients of two or more dimensions, each seen as an n x m matrix M (the first
dimension by the rest), are replaced by a rank-r approximation found with one step of power
iteration, warm-started from the previous step's Q:

    P = M Q          all-reduce P (n x r), orthogonalise its columns
    Q = M^T P        all-reduce Q (m x r)
    M ~ P Q^T

so r (n + m) numbers travel instead of n m. Vectors (biases, norms' weights) and matrices too
small to gain travel whole, in the all-reduce of the P factors. With error feedback, what the
approximation left out of this rank's gradient is added to its next one, so nothing is lost
over time, only delayed. The first ``warmup_steps`` steps are plain all-reduces (the Q
factors need a few steps of gradients to settle, as torch's ``start_powersgd_iter``).

Every rank holds its own error and the same Q factors; both are training state: a commit
keeps them (a rollback restores them bit for bit), and a checkpoint keeps each rank's, so a
resumed run on the same number of workers goes on as if uninterrupted. A run resumed on
another number, or a worker that joins, starts with no error left over (documented as
another membership history: docs/user-guide.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ringflow.engine.collective.base import CollectiveWork
from ringflow.engine.collective.hooks import GradBucket

__all__ = ["PowerSGDState", "powersgd_hook"]


class PowerSGDState:
    """One worker's PowerSGD state: the steps reduced so far, and per bucket its Q factors
    and this rank's error.

    Args:
        rank, world_size: the worker's place in the group.
        matrix_rank: r, the columns of P and Q.
        warmup_steps: steps reduced whole before compression starts.
        seed: seeds the first Q factors, the same on every rank.
    """

    def __init__(
        self, rank: int, world_size: int, *, matrix_rank: int, warmup_steps: int, seed: int = 0
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.matrix_rank, self.warmup_steps, self.seed = matrix_rank, warmup_steps, seed
        self.steps = 0
        self.qs: dict[int, list[torch.Tensor]] = {}
        self.errors: dict[int, torch.Tensor] = {}
        self.sent_bytes = 0
        """Bytes this rank put into all-reduces so far (what a plain all-reduce would have
        sent is each bucket's size): ``bench/compression.py`` reads it."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything the next steps depend on, as CPU tensors by name."""
        state = {"steps": torch.tensor(self.steps, dtype=torch.int64)}
        for bucket, qs in self.qs.items():
            for j, q in enumerate(qs):
                state[f"q/{bucket}/{j}"] = q.detach().cpu().clone()
        for bucket, error in self.errors.items():
            state[f"error/{bucket}"] = error.detach().cpu().clone()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], *, errors: bool = True) -> None:
        """Take ``state`` (:meth:`state_dict`'s), its Q factors on the device of the
        gradients they meet; ``errors=False`` starts with none (a worker joining)."""
        self.steps = int(state["steps"])
        qs: dict[int, dict[int, torch.Tensor]] = {}
        self.errors = {}
        for name, tensor in state.items():
            kind, _, rest = name.partition("/")
            if kind == "q":
                bucket, j = (int(part) for part in rest.split("/"))
                qs.setdefault(bucket, {})[j] = tensor.clone()
            elif kind == "error" and errors:
                self.errors[int(rest)] = tensor.clone()
        self.qs = {b: [found[j] for j in sorted(found)] for b, found in qs.items()}

    def reset_errors(self) -> None:
        self.errors = {}


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> CollectiveWork:
    """The bucket reduced through its rank-r factors (see the module docstring)."""
    collective = bucket.collective
    if state.steps < state.warmup_steps:
        if bucket.last:
            state.steps += 1
        state.sent_bytes += bucket.buffer.numel() * bucket.buffer.element_size()
        return collective.allreduce_async_(bucket.buffer, op=bucket.op)
    buffer = bucket.buffer
    error = state.errors.get(bucket.index)
    if error is not None:
        buffer.add_(error.to(buffer.device))
    matrices, whole, is_matrix = [], [], []
    for grad in bucket.gradients():
        n = grad.shape[0] if grad.dim() >= 2 else 0
        m = grad.numel() // n if n else 0
        compressed = bool(n) and state.matrix_rank * (n + m) < n * m
        (matrices if compressed else whole).append(grad.reshape(n, m) if compressed else grad)
        is_matrix.append(compressed)
    qs = state.qs.get(bucket.index)
    if qs is None or [q.shape[0] for q in qs] != [mat.shape[1] for mat in matrices]:
        qs = [_first_q(state, bucket.index, j, mat) for j, mat in enumerate(matrices)]
    local = buffer.clone()  # this rank's, for the error
    ps = [mat @ q.to(mat.device) for mat, q in zip(matrices, qs, strict=True)]
    first = _flat(ps + whole, buffer)
    state.sent_bytes += first.numel() * first.element_size()
    work = collective.allreduce_async_(first, op=bucket.op)
    return _PowerSGDWork(state, bucket, work, matrices, whole, local, ps, is_matrix)


class _PowerSGDWork(CollectiveWork):
    """The rest of a bucket's PowerSGD once its P factors (and whole tensors) are summed."""

    def __init__(
        self,
        state: PowerSGDState,
        bucket: GradBucket,
        work: CollectiveWork,
        matrices: list[torch.Tensor],
        whole: list[torch.Tensor],
        local: torch.Tensor,
        ps: list[torch.Tensor],
        is_matrix: list[bool],
    ) -> None:
        self._state, self._bucket, self._work = state, bucket, work
        self._matrices, self._whole, self._local, self._ps = matrices, whole, local, ps
        self._is_matrix = is_matrix
        self._done = False

    def wait(self) -> torch.Tensor:
        if self._done:
            return self._bucket.buffer
        state, bucket = self._state, self._bucket
        first = self._work.wait()
        pieces = _unflat(first, [*self._ps, *self._whole])
        ps, sums = pieces[: len(self._ps)], pieces[len(self._ps) :]
        for grad, reduced in zip(self._whole, sums, strict=True):
            grad.copy_(reduced)
        ps = [_orthogonalised(p) for p in ps]
        qs = [mat.t() @ p for mat, p in zip(self._matrices, ps, strict=True)]
        if qs:
            second = _flat(qs, bucket.buffer)
            state.sent_bytes += second.numel() * second.element_size()
            qs = _unflat(bucket.collective.allreduce_(second, op=bucket.op), qs)
        for mat, p, q in zip(self._matrices, ps, qs, strict=True):
            torch.matmul(p, q.t(), out=mat)
        if self._matrices:
            # What this rank's gradient lost: its own, less its share of the approximation
            # over the ranks (all of it under avg; under sum each share was weighted already).
            share = 1.0 if bucket.op == "avg" else 1.0 / bucket.collective.world_size
            error = self._local.sub_(bucket.buffer, alpha=share)
            start = 0
            for grad, compressed in zip(bucket.params, self._is_matrix, strict=True):
                if not compressed:  # travelled whole: nothing left out
                    error[start : start + grad.numel()].zero_()
                start += grad.numel()
            state.errors[bucket.index] = error
        state.qs[bucket.index] = qs
        if bucket.last:
            state.steps += 1
        self._done = True
        return bucket.buffer

    def is_completed(self) -> bool:
        return self._done


def _first_q(state: PowerSGDState, bucket: int, j: int, mat: torch.Tensor) -> torch.Tensor:
    """A seeded standard-normal m x r start, the same on every rank."""
    generator = torch.Generator().manual_seed((state.seed * 1_000_003 + bucket) * 1_009 + j)
    q = torch.randn(mat.shape[1], state.matrix_rank, generator=generator, dtype=torch.float32)
    return q.to(device=mat.device, dtype=mat.dtype)


def _orthogonalised(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt over ``p``'s columns (as torch's PowerSGD: the same on every rank)."""
    p = p.clone()
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col.div_(col.norm() + eps)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))
    return p


def _flat(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not tensors:
        return like.new_zeros(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, shapes: list[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for tensor in shapes:
        out.append(flat[start : start + tensor.numel()].view_as(tensor))
        start += tensor.numel()
    return out


def state_for(config: Any, rank: int, world_size: int) -> PowerSGDState:
    """The state ``TrainConfig`` asks for: ``powersgd_rank``, ``powersgd_warmup_steps``."""
    return PowerSGDState(
        rank,
        world_size,
        matrix_rank=config.powersgd_rank,
        warmup_steps=config.powersgd_warmup_steps,
        seed=config.seed,
    )
