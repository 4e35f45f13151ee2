"""One kernel for a whole all-reduce between the GPUs of one host.

The ring over symmetric memory (``_symm``) takes about 25 small launches a collective and
crosses NVLink one neighbour at a time; NCCL runs a collective as one kernel, and so does this
path: a two-shot all-reduce in which every rank *pushes* (NVLink stores are posted and go at
nearly the link's rate, where loads wait a round trip each).

1. reduce-scatter: rank ``r`` stores chunk ``p`` of its tensor into slot ``r`` of rank ``p``'s
   stage, for every other ``p`` at once (its own chunk stays in its tensor);
2. a barrier; rank ``r`` sums its chunk in float32, in rank order, and stores the sum into its
   tensor and into every other rank's stage;
3. a barrier; rank ``r`` copies the sums pushed into its stage into its tensor (not for
   tensors in symmetric memory: there the sums went straight into every rank's).

From 64 MiB a tensor not in symmetric memory goes through the phases in rounds, a barrier
after each, so that one round's sums are copied while the next round's cross the links. Each
block synchronises only with the same block on the other ranks; two barriers per collective
(R + 1 in R rounds) suffice. Collectives larger than the stage go through it piece by piece.
What it is worth against NCCL: docs/benchmarks.md.

Failures. A wait gives up when this rank's ``abort`` word is set, which the watchdog does at
the collective's deadline, or ``timeout`` after the kernel started. A dead peer never takes
the signal it was sent, so the next collective's send would wait for it: that wait ends on the
abort word too, and an aborted kernel skips its remaining phases, so the stream drains at once.
The caller never sees the meaningless data; the watchdog raises the typed error. The sum is the
same on every rank: one rank computes each chunk, and everybody copies it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringflow.engine.config import SymmConfig

__all__ = [
    "FusedAllReduce",
    "SymmetricTensors",
    "allocate",
    "fused_supported",
    "piece_elements",
    "rounds_for",
    "signal_pads",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BARRIERS = 2
_MAX_WORLD = 8
_WARPS = 16
_MAX_BLOCKS = 256
_VECTORS = 2
# The settings' defaults are SymmConfig's: the fastest of those tried on 4 H100s and 2 H200s
# (docs/benchmarks.md), 64 blocks leaving half the SMs to the backward pass it overlaps.


def fused_supported(dtype: torch.dtype, world_size: int) -> bool:
    """Whether the fused kernel can reduce ``dtype`` over ``world_size`` GPUs here."""
    if dtype not in _DTYPES or not 2 <= world_size <= _MAX_WORLD:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def piece_elements(dtype: torch.dtype, elements: int, settings: SymmConfig) -> int:
    """The piece a stage for collectives of ``elements`` takes: a power of two, at most
    ``settings.piece_mb``."""
    largest = (settings.piece_mb << 20) // torch.empty(0, dtype=dtype).element_size()
    return min(1 << max(16, (elements - 1).bit_length()), largest)


def rounds_for(nbytes: int, *, in_place: bool, settings: SymmConfig) -> int:
    """The rounds a piece of ``nbytes`` goes through the kernel in: ``settings.rounds`` from
    ``settings.rounds_from_mb`` on, one below; one in place, where the sums land where they
    belong and there is no copy to hide."""
    return settings.rounds if not in_place and nbytes >= settings.rounds_from_mb << 20 else 1


class FusedAllReduce:
    """A symmetric stage for pieces of ``piece`` ``dtype`` values, and the kernel over it.

    Made on every rank alike (the stage's rendezvous is collective). ``in_place``: tensors in
    symmetric memory (:class:`SymmetricTensors`) will be reduced too. ``settings``: the
    kernel's blocks and rounds (the same on every rank).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        dtype: torch.dtype,
        piece: int,
        *,
        settings: SymmConfig,
        in_place: bool = False,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.piece = dtype, piece
        # Signal slots for every block of every barrier (the pad is sized per allocation).
        need = _BARRIERS * _MAX_BLOCKS * _MAX_WORLD * 4
        if hasattr(symm_mem, "set_signal_pad_size") and symm_mem.get_signal_pad_size() < need:
            symm_mem.set_signal_pad_size(need)
        # Slots: ``world_size`` chunks of ``ceil(piece / (16 world_size)) * 16``, at most
        # ``piece + 16 world_size`` elements; then the finished sums, ``piece`` more.
        self.cap = piece + 16 * _MAX_WORLD
        handle, self.stages = allocate(group, 2 * self.cap, dtype)
        self.handle = handle  # the mappings live as long as it
        self.rank, self.world_size = handle.rank, handle.world_size
        self.mine = self.stages[self.rank]
        words = _pad_words(handle)
        pads = signal_pads(handle)
        self.pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=device)
        self.abort = torch.zeros(1, dtype=torch.int32, device=device)
        """Set by the watchdog's release: every wait of the kernel ends, and it drains."""
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        fits = words // (_BARRIERS * self.world_size)
        self.max_blocks = max(1, min(settings.fused_blocks, _MAX_BLOCKS, sms, fits))
        # Elements a block handles per step: _VECTORS 16-byte vectors a thread.
        self.block = _WARPS * 32 * _VECTORS * (16 // self.mine.element_size())
        self.settings = settings
        # Compiled now, not inside a collective's deadline (``in_place``: that variant too;
        # in rounds only where a piece reaches them).
        probe = torch.zeros(16, dtype=dtype, device=device)
        variants = (None, [probe] * self.world_size) if in_place else (None,)
        largest = piece * self.mine.element_size()
        plain = {1, rounds_for(largest, in_place=False, settings=settings)}
        for average in (False, True):
            for peers in variants:
                for rounds in plain if peers is None else (1,):
                    kwargs = {"average": average, "peers": peers, "blocks": 1, "warmup": True}
                    self._launch(probe, 16, 1 << 40, rounds=rounds, **kwargs)

    def run(
        self,
        flat: torch.Tensor,
        *,
        average: bool,
        timeout_s: float,
        peers: list[torch.Tensor] | None = None,
    ) -> None:
        """All-reduce ``flat`` (contiguous, this stage's dtype) in place, on the current
        stream, a piece at a time. ``peers``: ``flat`` is symmetric memory and these are every
        rank's tensor at the same place (``flat`` among them); the sums then go straight into
        them, not through the stage."""
        timeout_ns = int(timeout_s * 1e9)
        for start in range(0, flat.numel(), self.piece):
            piece = flat[start : start + self.piece]
            theirs = None if peers is None else [p[start : start + self.piece] for p in peers]
            self._launch(piece, piece.numel(), timeout_ns, average=average, peers=theirs)

    def _launch(
        self,
        flat: torch.Tensor,
        n: int,
        timeout_ns: int,
        *,
        average: bool,
        peers: list[torch.Tensor] | None = None,
        blocks: int | None = None,
        rounds: int | None = None,
        warmup: bool = False,
    ) -> None:
        # Chunks of whole 16-element groups: every rank's chunk starts aligned for vectors.
        chunk = -(-n // (self.world_size * 16)) * 16
        if blocks is None:
            blocks = max(1, min(self.max_blocks, -(-chunk // self.block)))
        if rounds is None:
            nbytes = n * self.mine.element_size()
            rounds = rounds_for(nbytes, in_place=peers is not None, settings=self.settings)
        kernel = _kernel()
        pad = _MAX_WORLD - self.world_size
        stages = self.stages + [self.mine] * pad
        outs = [flat] * _MAX_WORLD if peers is None else peers + [flat] * pad
        args = (*stages, *outs, self.pad_ptrs, self.abort, flat, n, chunk, self.cap, timeout_ns)
        options = {
            "RANK": self.rank,
            "WORLD": self.world_size,
            "AVERAGE": average,
            "IN_PLACE": peers is not None,
            "ROUNDS": rounds,
            "BLOCK": self.block,
            "num_warps": _WARPS,
        }
        if warmup:
            kernel.warmup(*args, grid=(blocks,), **options)
        else:
            kernel[(blocks,)](*args, **options)


class SymmetricTensors:
    """Tensors the ring allocated in symmetric memory (gradient buckets): an all-reduce of one
    of them, whole, writes its sums straight into every rank's copy."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self._peers: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
        self._handles: list[object] = []  # the mappings live as long as these

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor of ``numel`` ``dtype`` values in symmetric memory (collective: every
        rank allocates the same tensors in the same order)."""
        # Rounded up to whole 16-byte vectors: the kernel's unmasked steps stay in bounds.
        handle, whole = allocate(self._group, -(-numel // 16) * 16, dtype)
        peers = [t[:numel] for t in whole]
        tensor = peers[handle.rank].zero_()
        self._handles.append(handle)
        self._peers[(tensor.data_ptr(), numel, dtype)] = peers
        return tensor

    def peers(self, flat: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's copy of ``flat`` if the ring allocated it, else ``None``."""
        return self._peers.get((flat.data_ptr(), flat.numel(), flat.dtype))

    def clear(self) -> None:
        self._peers.clear()
        self._handles.clear()


def allocate(
    group: dist.ProcessGroup, numel: int, dtype: torch.dtype
) -> tuple[object, list[torch.Tensor]]:
    """``numel`` ``dtype`` values in symmetric memory (collective: every rank allocates alike):
    the allocation's handle, and every rank's tensor of it, by rank (this rank's its own)."""
    import torch.distributed._symmetric_memory as symm_mem

    device = torch.device("cuda", torch.cuda.current_device())
    mine = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(mine, group.group_name)
    tensors = [handle.get_buffer(p, (numel,), dtype) for p in range(handle.world_size)]
    tensors[handle.rank] = mine
    return handle, tensors


def signal_pads(handle) -> list[torch.Tensor]:
    """Every rank's signal pad of ``handle``'s allocation, as int32 words, by rank."""
    words = _pad_words(handle)
    return [handle.get_signal_pad(p, (words,), torch.int32) for p in range(handle.world_size)]


def _pad_words(handle) -> int:
    size = getattr(handle, "signal_pad_size", None)
    if not isinstance(size, int):
        import torch.distributed._symmetric_memory as symm_mem

        size = symm_mem.get_signal_pad_size()
    return size // 4


def _kernel():
    """The Triton kernel (``_fused_kernel``), imported on first use: Triton costs a second."""
    from ringflow.engine.collective._fused_kernel import push_all_reduce

    return push_all_reduce
