"""An Elastic Horovod script as its users write them (``hvd.elastic.TorchState``,
``ElasticSampler``, ``@hvd.elastic.run``): a linear model on a fixed dataset, a global batch
of 8 split over however many ranks there are, a commit after every step. Prints
``step N of M ranks`` after each step, sleeping ``--step-s`` first (so a test can kill a rank
mid-run); with ``--wait-for-ranks N``, fewer ranks wait at each commit (up to 2 minutes) for
a worker to join. Rank 0 saves the final weights to ``--out``."""

import argparse
import time

import torch

import ringflow.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--step-s", type=float, default=0.0)
parser.add_argument("--wait-for-ranks", type=int, default=1)
args = parser.parse_args()

GLOBAL_BATCH = 8
hvd.init()
torch.manual_seed(0)
inputs = torch.randn(64, 5)
dataset = torch.utils.data.TensorDataset(inputs, inputs @ torch.randn(5, 1) + 0.1)
model = torch.nn.Linear(5, 1)
optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        local = GLOBAL_BATCH // hvd.size()
        loader = torch.utils.data.DataLoader(dataset, batch_size=local, sampler=state.sampler)
        for batch_idx, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            state.sampler.record_batch(batch_idx, local)
            state.step += 1
            time.sleep(args.step_s)
            print(f"step {state.step} of {hvd.size()} ranks", flush=True)
            state.commit()
            deadline = time.monotonic() + 120
            while hvd.size() < args.wait_for_ranks and time.monotonic() < deadline:
                time.sleep(0.1)
                state.check_host_updates()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
train(state)
if hvd.rank() == 0:
    torch.save({"weights": model.state_dict(), "steps": state.step}, args.out)
print(f"done after {state.step} steps", flush=True)
