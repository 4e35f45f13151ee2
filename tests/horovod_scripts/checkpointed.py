"""A Horovod script that keeps its checkpoints through the flow: ``linear_training.train``
(see there) as a file with its own arguments."""

import argparse

from linear_training import train

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--checkpoint-every", type=int, default=5)
parser.add_argument("--step-s", type=float, default=0.0)
args = parser.parse_args()
train(args.steps, args.checkpoint_every, args.step_s)
