"""A Horovod script that keeps its checkpoints through the flow (``hvd.checkpoint``): a
linear model trained for ``--steps`` global batches of 16 split over the ranks, each drawn
from its step's seed, a checkpoint every ``--checkpoint-every`` steps and at the end. It
resumes from the run's newest checkpoint, so a restarted run ends as an uninterrupted one,
bit for bit. Sleeps ``--step-s`` a step (for a test to kill it mid-run)."""

import argparse
import time

import torch

import ringflow.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--checkpoint-every", type=int, default=5)
parser.add_argument("--step-s", type=float, default=0.0)
args = parser.parse_args()

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
for step in range(start, args.steps):
    batch = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=batch)
    y = x.sum(dim=1, keepdim=True).sin()
    share = slice(hvd.rank(), None, hvd.size())
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x[share]), y[share]).backward()
    optimizer.step()
    time.sleep(args.step_s)
    if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
        hvd.checkpoint.save(step + 1, model, optimizer)
        if hvd.rank() == 0:
            print(f"checkpoint at step {step + 1}", flush=True)
print(f"rank {hvd.rank()}: done", flush=True)
