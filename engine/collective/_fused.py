"""One kernel for a whole all-reduce between the GPUs of one host: the small collectives' path.

The ring over symmetric memory (``_symm``) launches about 25 small kernels a collective on 4
GPUs (copies, signal puts and waits, additions); each costs a few microseconds however few
bytes it moves, so below 64 MiB the launches, not NVLink, set the time (0.46 of NCCL's
all-reduce at 16 MiB on 4 H100s, docs/benchmarks.md). NCCL runs a collective as one kernel.
So does this path, a two-shot all-reduce:

1. the caller's tensor is copied into this rank's symmetric buffer (one local copy);
2. one Triton kernel, in blocks that each own the same slices on every rank:
   - a barrier: every rank's copy has landed;
   - reduce-scatter: rank ``r`` reads chunk ``r`` from every rank's buffer over NVLink, adds
     in float32 in rank order, and writes the sum into its own buffer and its output;
   - a barrier: every rank's finished chunk is in its buffer;
   - all-gather: rank ``r`` reads chunk ``p`` from rank ``p``'s buffer into its output;
   - a barrier: nobody reads this rank's buffer any more, so the next collective may write it.

Each block synchronises only with the same block on the other ranks (it reads only what they
wrote), through its own signal slots per barrier, so a signal is never sent into a slot that
still holds an unconsumed one. A wait gives up ``timeout`` after the kernel started: a peer that
died leaves the kernel to finish with meaningless data, which the caller never sees, since the
watchdog raises the typed error by the deadline (and releases the waits earlier by filling
this rank's signal pad, as for the ring). The sum is the same on every rank: one rank computes
each chunk, and everybody copies it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["FusedAllReduce", "fused_supported"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BARRIERS = 3
_MAX_WORLD = 8
_WARPS = 16
_MAX_BLOCKS = 128
"""Blocks of the kernel at most: each keeps a few 16-byte NVLink loads in flight per thread,
and 32 blocks left large collectives at half of NVLink's bandwidth."""


def fused_supported(dtype: torch.dtype, world_size: int) -> bool:
    """Whether the fused kernel can reduce ``dtype`` over ``world_size`` GPUs here."""
    if dtype not in _DTYPES or not 2 <= world_size <= _MAX_WORLD:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class FusedAllReduce:
    """A symmetric buffer of ``elements`` ``dtype`` values and the kernel over it.

    Made on every rank alike (the buffer's rendezvous is collective).
    """

    def __init__(self, group: dist.ProcessGroup, dtype: torch.dtype, elements: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.elements = dtype, elements
        # Signal slots for every block of every barrier (the pad is sized per allocation).
        need = _BARRIERS * _MAX_BLOCKS * _MAX_WORLD * 4
        if hasattr(symm_mem, "set_signal_pad_size") and symm_mem.get_signal_pad_size() < need:
            symm_mem.set_signal_pad_size(need)
        self.mine = symm_mem.empty(elements, dtype=dtype, device=device)
        self.handle = handle = symm_mem.rendezvous(self.mine, group.group_name)
        self.rank, self.world_size = handle.rank, handle.world_size
        self.buffers = [handle.get_buffer(p, (elements,), dtype) for p in range(self.world_size)]
        words = _pad_words(handle)
        pads = [handle.get_signal_pad(p, (words,), torch.int32) for p in range(self.world_size)]
        self.pad = pads[self.rank]
        self.pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=device)
        self.max_blocks = max(1, min(_MAX_BLOCKS, words // (_BARRIERS * self.world_size)))
        # Elements a block handles per step: 16 bytes a thread, one vector load.
        self.block = _WARPS * 32 * (16 // self.mine.element_size())
        for average in (False, True):  # compiled now, not inside a collective's deadline
            self._launch(self.mine, 16, 16, 1 << 40, average=average, blocks=1, warmup=True)

    def run(self, flat: torch.Tensor, *, average: bool, timeout_s: float) -> None:
        """All-reduce ``flat`` (contiguous, this buffer's dtype, at most ``elements`` long) in
        place, on the current stream."""
        n = flat.numel()
        if n == 0:
            return
        # Chunks of whole 16-element groups: every rank's chunk starts aligned for vector loads.
        chunk = -(-n // (self.world_size * 16)) * 16
        blocks = max(1, min(self.max_blocks, -(-chunk // self.block)))
        self.mine[:n].copy_(flat)
        self._launch(flat, n, chunk, int(timeout_s * 1e9), average=average, blocks=blocks)

    def _launch(
        self,
        out: torch.Tensor,
        n: int,
        chunk: int,
        timeout_ns: int,
        *,
        average: bool,
        blocks: int,
        warmup: bool = False,
    ) -> None:
        kernel = _kernel()
        peers = self.buffers + [self.mine] * (_MAX_WORLD - self.world_size)
        args = (*peers, self.pad_ptrs, out, n, chunk, timeout_ns)
        options = {
            "RANK": self.rank,
            "WORLD": self.world_size,
            "AVERAGE": average,
            "BLOCK": self.block,
            "num_warps": _WARPS,
        }
        if warmup:
            kernel.warmup(*args, grid=(blocks,), **options)
        else:
            kernel[(blocks,)](*args, **options)


def _pad_words(handle) -> int:
    size = getattr(handle, "signal_pad_size", None)
    if not isinstance(size, int):
        import torch.distributed._symmetric_memory as symm_mem

        size = symm_mem.get_signal_pad_size()
    return size // 4


def _kernel():
    """The Triton kernel (``_fused_kernel``), imported on first use: Triton costs a second."""
    from ringflow.engine.collective._fused_kernel import two_shot

    return two_shot
