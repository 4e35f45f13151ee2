"""A Horovod-style training function that keeps its checkpoints through the flow
(``hvd.checkpoint``): a linear model trained for ``steps`` global batches of 16 split over
the ranks, each drawn from its step's seed, a checkpoint every ``checkpoint_every`` steps and
at the end. It resumes from the run's newest checkpoint, so a restarted run ends as an
uninterrupted one, bit for bit. Sleeps ``step_s`` a step (for a test to kill it mid-run).

``checkpointed.py`` is its script form; ``horovod-train --function
linear_training:train`` calls it on each rank."""

import time

import torch

import ringflow.horovod as hvd


def train(steps: int = 40, checkpoint_every: int = 5, step_s: float = 0.0) -> None:
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    resumed = hvd.checkpoint.load(model, optimizer)
    start = 0 if resumed is None else resumed["step"]
    if resumed is None:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    print(f"rank {hvd.rank()} of {hvd.size()}: starting at step {start}", flush=True)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for step in range(start, steps):
        batch = torch.Generator().manual_seed(step)
        x = torch.randn(16, 6, generator=batch)
        y = x.sum(dim=1, keepdim=True).sin()
        share = slice(hvd.rank(), None, hvd.size())
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[share]), y[share]).backward()
        optimizer.step()
        time.sleep(step_s)
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            hvd.checkpoint.save(step + 1, model, optimizer)
            if hvd.rank() == 0:
                print(f"checkpoint at step {step + 1}", flush=True)
    print(f"rank {hvd.rank()}: done", flush=True)
