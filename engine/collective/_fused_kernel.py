"""The Triton kernel of ``_fused``: a two-shot all-reduce over symmetric memory.

Imported only where Triton is (CUDA hosts), and only when a fused collective first runs.
"""

import triton
import triton.language as tl


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.uint64, is_pure=False, pack=1
    )


@triton.jit
def _thread():
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _sync_block():
    tl.inline_asm_elementwise("bar.sync 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier(pad_ptrs, which, give_up, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Block ``program_id`` of every rank meets here, and what each wrote before is visible
    to all after. Slot ``(which, block, sender)`` of the receiver's pad carries the signal, so
    a signal never lands in a slot that still holds one; a wait gives up at ``give_up``."""
    block = tl.program_id(0)
    slot = (which * tl.num_programs(0) + block) * WORLD
    ranks = tl.arange(0, WORLD)
    pad_ptrs = pad_ptrs.to(tl.pointer_type(tl.uint64))
    theirs = tl.load(pad_ptrs + ranks).to(tl.pointer_type(tl.uint32)) + slot + RANK
    own = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.uint32)) + slot
    waits = own + ranks
    limit = give_up + tl.zeros([WORLD], dtype=tl.uint64)
    _sync_block()
    if _thread() < WORLD:
        # Thread q signals rank q, then waits for rank q's signal (its own included).
        tl.inline_asm_elementwise(
            """
            {
                .reg .u32 %old;
                .reg .u64 %t;
                .reg .pred %ok;
                fence.acq_rel.sys;
            send:
                atom.global.release.sys.cas.b32 %old, [$1], 0, 1;
                setp.eq.u32 %ok, %old, 0;
                @%ok bra sent;
                mov.u64 %t, %globaltimer;
                setp.lt.u64 %ok, %t, $3;
                @%ok bra send;
            sent:
                atom.global.sys.cas.b32 %old, [$2], 1, 0;
                setp.eq.u32 %ok, %old, 1;
                @%ok bra done;
                mov.u64 %t, %globaltimer;
                setp.lt.u64 %ok, %t, $3;
                @%ok bra sent;
            done:
                mov.u32 $0, 0;
            }
            """,
            "=r,l,l,l",
            [theirs, waits, limit],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    _sync_block()
    for q in tl.static_range(WORLD):
        tl.inline_asm_elementwise(
            "ld.acquire.sys.global.u32 $0, [$1];",
            "=r,l",
            [own + q],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _pick(p: tl.constexpr, b0, b1, b2, b3, b4, b5, b6, b7):
    if p == 0:  # noqa: SIM116 - a Triton function: no dictionaries
        return b0
    elif p == 1:
        return b1
    elif p == 2:
        return b2
    elif p == 3:
        return b3
    elif p == 4:
        return b4
    elif p == 5:
        return b5
    elif p == 6:
        return b6
    else:
        return b7


@triton.jit
def _reduce(
    b0,
    b1,
    b2,
    b3,
    b4,
    b5,
    b6,
    b7,
    own,
    out,
    index,
    keep,
    MASKED: tl.constexpr,
    WORLD: tl.constexpr,
    AVERAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        source = _pick(p, b0, b1, b2, b3, b4, b5, b6, b7)
        if MASKED:
            total += tl.load(source + index, mask=keep).to(tl.float32)
        else:
            total += tl.load(source + index).to(tl.float32)
    if AVERAGE:
        total = total / WORLD
    value = total.to(out.dtype.element_ty)
    if MASKED:
        tl.store(own + index, value, mask=keep)
        tl.store(out + index, value, mask=keep)
    else:
        tl.store(own + index, value)
        tl.store(out + index, value)


@triton.jit(do_not_specialize=["n", "timeout_ns"])
def two_shot(
    b0,
    b1,
    b2,
    b3,
    b4,
    b5,
    b6,
    b7,
    pad_ptrs,
    out,
    n,
    chunk,
    timeout_ns,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    AVERAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """All-reduce ``n`` elements: rank ``r`` sums chunk ``r`` (``chunk`` elements, a multiple
    of 16) of every rank's buffer ``b<p>`` into its own buffer and ``out``, then copies the
    other chunks from their owners' buffers into ``out``."""
    give_up = _now_ns() + timeout_ns.to(tl.uint64)
    block = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    lanes = tl.arange(0, BLOCK)
    _barrier(pad_ptrs, 0, give_up, RANK, WORLD)
    own = _pick(RANK, b0, b1, b2, b3, b4, b5, b6, b7)
    start = RANK * chunk
    end = tl.minimum(start + chunk, n)
    whole = start + tl.maximum(end - start, 0) // BLOCK * BLOCK
    for at in range(start + block * BLOCK, whole, stride):
        index = tl.multiple_of(at, 16) + lanes
        _reduce(
            b0,
            b1,
            b2,
            b3,
            b4,
            b5,
            b6,
            b7,
            own,
            out,
            index,
            index < end,
            False,
            WORLD,
            AVERAGE,
            BLOCK,
        )
    for at in range(whole + block * BLOCK, end, stride):
        index = at + lanes
        _reduce(
            b0,
            b1,
            b2,
            b3,
            b4,
            b5,
            b6,
            b7,
            own,
            out,
            index,
            index < end,
            True,
            WORLD,
            AVERAGE,
            BLOCK,
        )
    _barrier(pad_ptrs, 1, give_up, RANK, WORLD)
    for p in tl.static_range(WORLD):
        if p != RANK:
            source = _pick(p, b0, b1, b2, b3, b4, b5, b6, b7)
            first = p * chunk
            last = tl.minimum(first + chunk, n)
            full = first + tl.maximum(last - first, 0) // BLOCK * BLOCK
            for at in range(first + block * BLOCK, full, stride):
                index = tl.multiple_of(at, 16) + lanes
                tl.store(out + index, tl.load(source + index))
            for at in range(full + block * BLOCK, last, stride):
                index = at + lanes
                keep = index < last
                tl.store(out + index, tl.load(source + index, mask=keep), mask=keep)
    _barrier(pad_ptrs, 2, give_up, RANK, WORLD)
