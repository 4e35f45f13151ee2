"""A model class that storage names but ringflow must never import.

Importing this module leaves a mark, a file named after the importing process's id in
:data:`tests.support.trust.MARKS`, in whichever process imported it: a Serve replica, a
task, the test itself.
"""

import os

import torch

from tests.support.trust import MARKS

os.makedirs(MARKS, exist_ok=True)
with open(os.path.join(MARKS, str(os.getpid())), "w") as _mark:
    _mark.write(__name__)


class Planted(torch.nn.Module):
    """Any module a writer of the bucket would like instantiated with hparams of its choice."""

    def __init__(self, **hparams) -> None:
        super().__init__()
        self.hparams = hparams
