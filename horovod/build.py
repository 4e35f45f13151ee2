"""Horovod's build queries (``hvd.nccl_built()``, ``hvd.gloo_enabled()``, ...), answered for
ringflow.horovod: what a script asks to pick its code path, as Horovod's own tests do.

ringflow's ring runs over gloo and shared memory on CPUs and over NCCL on GPUs; it has no MPI,
oneCCL, DDL or ROCm path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "ccl_built",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rocm_built",
]


def nccl_built() -> int:
    """NCCL's version code (``2.21.5`` is 22105, Horovod's ``NCCL_VERSION_CODE``) where the
    ring can use NCCL here (a CUDA device and torch's NCCL), else 0."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * 10000 + minor * 100 + patch


def gloo_built() -> bool:
    """The ring's CPU transports are gloo's and shared memory: always there."""
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return gloo_built()


def cuda_built() -> bool:
    """Whether torch was built with CUDA (ringflow.horovod has no build of its own)."""
    return torch.backends.cuda.is_built()


def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """Raises as Horovod's does where MPI is not enabled.

    Raises:
        ValueError: always (there is no MPI here).
    """
    raise ValueError("Horovod MPI is not enabled: ringflow.horovod runs without MPI")
