"""A Horovod script as its users write them: one changed import. Prints each rank's view and
the average of the ranks' numbers; ``--fail-rank R`` makes rank R exit with status 3."""

import argparse
import sys

import torch

import ringflow.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
args = parser.parse_args()

hvd.init()
if hvd.rank() == args.fail_rank:
    print("giving up", flush=True)
    sys.exit(3)
mean = hvd.allreduce(torch.tensor([float(hvd.rank())]))
print(f"rank {hvd.rank()} of {hvd.size()}: mean {mean.item():g}", flush=True)
