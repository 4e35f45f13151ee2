"""The optimizer step in two parts (``Optimization.step_in_two``): the parameters whose
averaged gradients are in step while the last bucket still reduces, then the rest."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from ringflow.engine.module import Optimization


class _Net(L.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim > 1]
        rest = [p for p in self.parameters() if p.ndim <= 1]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
        optimizer = torch.optim.AdamW(groups, lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def _train(optimizer: str, *, in_two: bool) -> dict[str, torch.Tensor]:
    module = _Net(optimizer)
    optimization = Optimization(module)
    last = list(module.net[0].parameters())  # the first layer: the bucket reduced last
    ready = [p for p in module.parameters() if all(p is not q for q in last)]
    waited = []
    for step in range(5):
        module.zero_grad(set_to_none=False)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        module.net(x).square().sum().backward()
        if in_two:
            optimization.step_in_two(step, last=False, ready=ready, wait=lambda: waited.append(1))
        else:
            optimization.step(step, last=False, clip_val=None, clip_algorithm="norm")
    assert len(waited) == (5 if in_two else 0)
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_two_parts_step_bit_for_bit_as_one_with_groups_and_a_scheduler(optimizer):
    one, two = _train(optimizer, in_two=False), _train(optimizer, in_two=True)
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_the_last_bucket_steps_only_after_its_wait():
    """Before ``wait`` returns only the ready parameters moved: the rest's sums are not in."""
    module = _Net()
    optimization = Optimization(module)
    first_layer = module.net[0].weight
    before = first_layer.detach().clone()
    seen = []
    module.net(torch.randn(4, 6)).square().sum().backward()
    ready = [p for p in module.parameters() if p is not first_layer and p is not module.net[0].bias]
    optimization.step_in_two(
        0, last=False, ready=ready, wait=lambda: seen.append(torch.equal(first_layer, before))
    )
    assert seen == [True]
    assert not torch.equal(first_layer, before)


class _Clipping(_Net):
    def on_before_optimizer_step(self, optimizer) -> None:
        return None


class _MyAdamW(torch.optim.AdamW):
    """A user's optimizer: its step may read every parameter."""


def test_steps_in_two_only_where_nothing_reads_every_gradient_before_the_step():
    assert Optimization(_Net()).steps_in_two(clip_val=None)
    assert not Optimization(_Net()).steps_in_two(clip_val=1.0)  # clipping needs every gradient
    assert not Optimization(_Clipping()).steps_in_two(clip_val=None)  # the module's own hook
    own = _Net()
    own.configure_optimizers = lambda: _MyAdamW(own.parameters(), lr=0.01)
    assert not Optimization(own).steps_in_two(clip_val=None)
    hooked = Optimization(_Net())
    hooked.optimizer.register_step_post_hook(lambda *args: None)
    assert not hooked.steps_in_two(clip_val=None)


def test_a_worker_of_two_steps_in_two_parts_when_it_has_several_buckets(digits):
    """A data-parallel worker (here rank 0 of 2, its peer's sums faked equal to its own)
    steps its optimizer twice a batch: the ready buckets' parameters, then the last's."""
    from ringflow.engine import TrainConfig
    from ringflow.engine.collective import Collective
    from ringflow.engine.collective.base import CompletedWork
    from ringflow.engine.data_parallel import WholeModel
    from ringflow.engine.worker import Worker
    from ringflow.models.digits import DigitsClassifier

    class Mirror(Collective):  # a peer with the same gradients: the mean is one's own
        def allreduce_async_(self, tensor, *, op="sum"):
            assert op == "avg"  # the batch splits evenly: the all-reduce averages
            return CompletedWork(tensor)

        def broadcast_(self, tensor, *, src=0):
            return tensor

        def all_gather(self, tensor):
            return [tensor, tensor.clone()]

    config = TrainConfig(workers=1, epochs=1, batch_size=64, seed=0, bucket_mb=0.001)
    hparams = {"hidden": 32}
    worker = Worker(
        DigitsClassifier, hparams=hparams, data=digits, config=config, rank=0, plan=WholeModel()
    )
    worker.world_size, worker.step.collective = 2, Mirror(rank=0, world_size=2)
    worker.step.prepare_buckets()
    assert len(worker.step.buckets.bucket_sizes) > 1
    steps = []
    step = worker.optimizer.step
    worker.optimizer.step = lambda *args, **kwargs: steps.append(1) or step(*args, **kwargs)
    worker.train_steps(0, 0, 3)
    assert len(steps) == 2 * 3
