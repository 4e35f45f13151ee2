"""How a run's steps fall into epochs: each epoch's global batch, and from it the epoch's
steps and where it starts in the run.

The driver counts steps (global batches) from the run's start. With a fixed global batch
every epoch has the same number of steps and an epoch is ``step // steps``. Under weak
scaling with elastic workers (``TrainConfig.per_worker_batch_size`` with ``min_workers``
below ``workers``) the global batch of an epoch is the batch per worker times the workers
that start it, so epochs differ in length; :class:`Epochs` holds the batch of every epoch
decided so far and answers both ways (step -> epoch and step in it; epoch -> first step).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Epochs"]


@dataclass(frozen=True)
class Epochs:
    """The epochs of a run over ``samples`` training samples: epoch ``e``'s global batch is
    ``batches[e]``, and every epoch after the last decided one takes the last's.

    ``accumulate`` (``accumulate_grad_batches``) counts optimizer steps: windows start at
    each epoch's start, as under Lightning.
    """

    samples: int
    batches: tuple[int, ...]
    accumulate: int = 1

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"every epoch needs a global batch of 1 or more: {self.batches}")

    def batch(self, epoch: int) -> int:
        """Epoch ``epoch``'s global batch."""
        return self.batches[min(epoch, len(self.batches) - 1)]

    def steps(self, epoch: int) -> int:
        """Steps (global batches) in epoch ``epoch``."""
        return -(-self.samples // self.batch(epoch))

    def optimizer_steps(self, epoch: int) -> int:
        """Optimizer steps in epoch ``epoch``."""
        return -(-self.steps(epoch) // self.accumulate)

    def start(self, epoch: int) -> int:
        """The run's step at which epoch ``epoch`` starts."""
        decided = min(epoch, len(self.batches))
        return sum(self.steps(e) for e in range(decided)) + (epoch - decided) * self.steps(epoch)

    def optimizer_start(self, epoch: int) -> int:
        """The optimizer steps taken before epoch ``epoch``."""
        decided = min(epoch, len(self.batches))
        before = sum(self.optimizer_steps(e) for e in range(decided))
        return before + (epoch - decided) * self.optimizer_steps(epoch)

    def locate(self, step: int) -> tuple[int, int]:
        """The epoch the run's step ``step`` is in, and its place in that epoch."""
        start = 0
        for epoch in range(len(self.batches)):
            steps = self.steps(epoch)
            if step < start + steps:
                return epoch, step - start
            start += steps
        last = len(self.batches)
        done, first = divmod(step - start, self.steps(last))
        return last + done, first

    def decided(self, epoch: int, batch: int) -> Epochs:
        """These epochs with epoch ``epoch`` (and those after it) at global batch ``batch``;
        a later epoch decided before (a rollback to an epoch's start) is decided again."""
        before = tuple(self.batch(e) for e in range(epoch))
        return Epochs(self.samples, (*before, batch), self.accumulate)

    @property
    def fixed(self) -> bool:
        """Whether every epoch has the same global batch."""
        return len(set(self.batches)) == 1
