"""The Triton kernel of ``_fused``: a two-shot all-reduce that pushes over symmetric memory.

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
def _aborted(abort):
    """Whether this rank's watchdog gave up on the collective (its own memory, read fresh)."""
    return tl.load(abort, volatile=True) != 0


@triton.jit
def _barrier(pad_ptrs, abort, which, give_up, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Block ``program_id`` of every rank meets here, and what each wrote before is visible
    to all after. Slot ``(which, block, sender)`` of the receiver's pad carries the signal, so
    a signal never lands in a slot that still holds one. Every wait ends when this rank's
    ``abort`` word is set (the watchdog's release) or at ``give_up``: a dead peer never takes
    the signal it was sent, nor sends its own."""
    block = tl.program_id(0)
    slot = (which * tl.num_programs(0) + block) * WORLD
    ranks = tl.arange(0, 8)  # a power of two; ranks past WORLD do nothing
    pad_ptrs = pad_ptrs.to(tl.pointer_type(tl.uint64))
    pads = tl.load(pad_ptrs + ranks, mask=ranks < WORLD, other=0)
    theirs = pads.to(tl.pointer_type(tl.uint32)) + slot + RANK
    own = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.uint32)) + slot
    waits = own + ranks
    limit = give_up + tl.zeros([8], dtype=tl.uint64)
    stop = abort.to(tl.pointer_type(tl.uint32)) + tl.zeros([8], dtype=tl.int32)
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
                ld.volatile.global.u32 %old, [$4];
                setp.ne.u32 %ok, %old, 0;
                @%ok bra done;
                mov.u64 %t, %globaltimer;
                setp.lt.u64 %ok, %t, $3;
                @%ok bra send;
            sent:
                atom.global.sys.cas.b32 %old, [$2], 1, 0;
                setp.eq.u32 %ok, %old, 1;
                @%ok bra done;
                ld.volatile.global.u32 %old, [$4];
                setp.ne.u32 %ok, %old, 0;
                @%ok bra done;
                mov.u64 %t, %globaltimer;
                setp.lt.u64 %ok, %t, $3;
                @%ok bra sent;
            done:
                mov.u32 $0, 0;
            }
            """,
            "=r,l,l,l,l",
            [theirs, waits, limit, stop],
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
def _round(whole, j: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    """Round ``j`` of ``ROUNDS`` of this block's unmasked steps: the steps ``[first, last)``,
    step ``i`` at offset ``block * BLOCK + i * stride``; the masked tail goes in the last round."""
    block = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    steps = (tl.maximum(whole - block * BLOCK, 0) + stride - 1) // stride
    return steps * j // ROUNDS, steps * (j + 1) // ROUNDS


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
def _get(pointers, keep, MASKED: tl.constexpr):
    """Load at ``pointers``: masked by ``keep``, or else whole."""
    if MASKED:
        return tl.load(pointers, mask=keep)
    return tl.load(pointers)


@triton.jit
def _put(pointers, value, keep, MASKED: tl.constexpr):
    """Store ``value``: masked by ``keep``, or else as whole 16-byte vectors (a picked pointer
    loses that in Triton's analysis, and stores would go word by word)."""
    if MASKED:
        tl.store(pointers, value, mask=keep)
    else:
        tl.store(tl.multiple_of(pointers, 16), value)


@triton.jit
def _sum_slots(
    own, mine, o, keep, chunk, RANK: tl.constexpr, MASKED: tl.constexpr, WORLD: tl.constexpr
):
    """The sum in float32, in rank order, at ``o``: of the other ranks' slots of ``own``, and
    of this rank's own chunk ``mine`` where it lies (it never went through the stage)."""
    total = tl.zeros(o.shape, dtype=tl.float32)
    for q in tl.static_range(WORLD):
        if q == RANK:
            total += _get(mine + o, keep, MASKED).to(tl.float32)
        else:
            total += _get(own + q * chunk + o, keep, MASKED).to(tl.float32)
    return total


@triton.jit
def _push_slots(
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    s6,
    s7,
    flat,
    n,
    chunk,
    whole,
    j: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Phase 1 of round ``j``: chunk p of the tensor into slot RANK of rank p's stage, every
    other p in one step (this rank's own chunk stays where it is); whole blocks unmasked, then
    (last round) the tail masked."""
    block = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    lanes = tl.arange(0, BLOCK)
    first, last = _round(whole, j, ROUNDS, BLOCK)
    for i in range(first, last):
        o = tl.multiple_of(block * BLOCK + i * stride, 16) + lanes
        _push_step(s0, s1, s2, s3, s4, s5, s6, s7, flat, o, n, chunk, RANK, WORLD, False)
    if j == ROUNDS - 1:
        for off in range(whole + block * BLOCK, chunk, stride):
            o = off + lanes
            _push_step(s0, s1, s2, s3, s4, s5, s6, s7, flat, o, n, chunk, RANK, WORLD, True)


@triton.jit
def _push_step(
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    s6,
    s7,
    flat,
    o,
    n,
    chunk,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    MASKED: tl.constexpr,
):
    for k in tl.static_range(1, WORLD):
        p = (RANK + k) % WORLD
        keep = (o < chunk) & (p * chunk + o < n)
        value = _get(flat + p * chunk + o, keep, MASKED)
        peer = _pick(p, s0, s1, s2, s3, s4, s5, s6, s7)
        _put(peer + RANK * chunk + o, value, keep, MASKED)


@triton.jit
def _reduce_step(
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    s6,
    s7,
    f0,
    f1,
    f2,
    f3,
    f4,
    f5,
    f6,
    f7,
    flat,
    o,
    n,
    chunk,
    cap,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    AVERAGE: tl.constexpr,
    IN_PLACE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Phase 2 at offsets ``o`` of chunk RANK: the sum of the slots and of the tensor's own
    chunk into the tensor and every peer's stage (or, ``IN_PLACE``, straight into every
    peer's tensor ``f<p>``). No peer writes this chunk of the tensor: each block reads its
    offsets before it writes them."""
    own = _pick(RANK, s0, s1, s2, s3, s4, s5, s6, s7)
    start = RANK * chunk
    keep = (o < chunk) & (start + o < n)
    total = _sum_slots(own, flat + start, o, keep, chunk, RANK, MASKED, WORLD)
    if AVERAGE:
        total = total / WORLD
    value = total.to(flat.dtype.element_ty)
    _put(flat + start + o, value, keep, MASKED)
    for k in tl.static_range(1, WORLD):
        if IN_PLACE:
            peer = _pick((RANK + k) % WORLD, f0, f1, f2, f3, f4, f5, f6, f7)
            _put(peer + start + o, value, keep, MASKED)
        else:
            peer = _pick((RANK + k) % WORLD, s0, s1, s2, s3, s4, s5, s6, s7)
            _put(peer + cap + start + o, value, keep, MASKED)


@triton.jit
def _reduce_chunk(
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    s6,
    s7,
    f0,
    f1,
    f2,
    f3,
    f4,
    f5,
    f6,
    f7,
    flat,
    n,
    chunk,
    cap,
    whole,
    j: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    AVERAGE: tl.constexpr,
    IN_PLACE: tl.constexpr,
    ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Phase 2 of round ``j``: whole blocks unmasked, then (last round) the tail masked."""
    block = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    lanes = tl.arange(0, BLOCK)
    first, last = _round(whole, j, ROUNDS, BLOCK)
    for i in range(first, last):
        o = tl.multiple_of(block * BLOCK + i * stride, 16) + lanes
        _reduce_step(
            s0,
            s1,
            s2,
            s3,
            s4,
            s5,
            s6,
            s7,
            f0,
            f1,
            f2,
            f3,
            f4,
            f5,
            f6,
            f7,
            flat,
            o,
            n,
            chunk,
            cap,
            RANK,
            WORLD,
            AVERAGE,
            IN_PLACE,
            False,
        )
    if j == ROUNDS - 1:
        for off in range(whole + block * BLOCK, chunk, stride):
            o = off + lanes
            _reduce_step(
                s0,
                s1,
                s2,
                s3,
                s4,
                s5,
                s6,
                s7,
                f0,
                f1,
                f2,
                f3,
                f4,
                f5,
                f6,
                f7,
                flat,
                o,
                n,
                chunk,
                cap,
                RANK,
                WORLD,
                AVERAGE,
                IN_PLACE,
                True,
            )


@triton.jit
def _copy_sums(
    own,
    flat,
    n,
    chunk,
    cap,
    whole,
    j: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Phase 3 of round ``j``: the other ranks' sums, pushed into this rank's stage, into the
    tensor."""
    block = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    lanes = tl.arange(0, BLOCK)
    first, last = _round(whole, j, ROUNDS, BLOCK)
    for i in range(first, last):
        o = tl.multiple_of(block * BLOCK + i * stride, 16) + lanes
        _copy_step(own, flat, o, n, chunk, cap, RANK, WORLD, False)
    if j == ROUNDS - 1:
        for off in range(whole + block * BLOCK, chunk, stride):
            _copy_step(own, flat, off + lanes, n, chunk, cap, RANK, WORLD, True)


@triton.jit
def _copy_step(
    own, flat, o, n, chunk, cap, RANK: tl.constexpr, WORLD: tl.constexpr, MASKED: tl.constexpr
):
    for k in tl.static_range(1, WORLD):
        i = ((RANK + k) % WORLD) * chunk + o
        keep = (o < chunk) & (i < n)
        _put(flat + i, _get(own + cap + i, keep, MASKED), keep, MASKED)


@triton.jit(do_not_specialize=["n", "timeout_ns"])
def push_all_reduce(
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    s6,
    s7,
    f0,
    f1,
    f2,
    f3,
    f4,
    f5,
    f6,
    f7,
    pad_ptrs,
    abort,
    flat,
    n,
    chunk,
    cap,
    timeout_ns,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    AVERAGE: tl.constexpr,
    IN_PLACE: tl.constexpr,
    ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """All-reduce the ``n`` elements of ``flat`` in place. Stage ``s<p>`` of rank ``p``: slots
    ``[q * chunk, (q + 1) * chunk)`` take rank ``q``'s chunk ``p``; ``[cap, cap + n)`` takes the
    finished sums. Chunks are ``chunk`` elements (a multiple of 16), the last one shorter.

    ``IN_PLACE``: ``flat`` is symmetric itself, ``f<p>`` rank ``p``'s: the sums go straight
    into every rank's tensor, and the third phase (copying them out of the stage) is not run.

    ``ROUNDS``: each block's offsets go through the phases in that many rounds, one barrier
    after each. After round ``j``'s sums are reduced and pushed, the sums of round ``j - 1``
    (in since the last barrier) are copied into the tensor and round ``j + 1``'s chunks are
    pushed: the local copy runs beside stores over the links instead of after all of them
    (``ROUNDS + 1`` barriers, their signal slots alternating).

    Offsets below ``whole`` lie in every rank's chunk and in whole blocks: no masks there, so
    loads and stores go 16 bytes at a time.
    """
    give_up = _now_ns() + timeout_ns.to(tl.uint64)
    whole = tl.maximum(n - (WORLD - 1) * chunk, 0) // BLOCK * BLOCK
    own = _pick(RANK, s0, s1, s2, s3, s4, s5, s6, s7)
    _push_slots(
        s0, s1, s2, s3, s4, s5, s6, s7, flat, n, chunk, whole, 0, RANK, WORLD, ROUNDS, BLOCK
    )
    _barrier(pad_ptrs, abort, 0, give_up, RANK, WORLD)
    for j in tl.static_range(ROUNDS):
        if not _aborted(abort):
            _reduce_chunk(
                s0,
                s1,
                s2,
                s3,
                s4,
                s5,
                s6,
                s7,
                f0,
                f1,
                f2,
                f3,
                f4,
                f5,
                f6,
                f7,
                flat,
                n,
                chunk,
                cap,
                whole,
                j,
                RANK,
                WORLD,
                AVERAGE,
                IN_PLACE,
                ROUNDS,
                BLOCK,
            )
            if j > 0 and not IN_PLACE:
                # Round j - 1's sums came in before the last barrier: copied out while this
                # round's go over the links.
                _copy_sums(own, flat, n, chunk, cap, whole, j - 1, RANK, WORLD, ROUNDS, BLOCK)
            if j + 1 < ROUNDS:
                _push_slots(
                    s0,
                    s1,
                    s2,
                    s3,
                    s4,
                    s5,
                    s6,
                    s7,
                    flat,
                    n,
                    chunk,
                    whole,
                    j + 1,
                    RANK,
                    WORLD,
                    ROUNDS,
                    BLOCK,
                )
        _barrier(pad_ptrs, abort, (j + 1) % 2, give_up, RANK, WORLD)
    if not IN_PLACE:  # noqa: SIM102 - Triton: a constexpr test, then a runtime one
        if not _aborted(abort):
            _copy_sums(own, flat, n, chunk, cap, whole, ROUNDS - 1, RANK, WORLD, ROUNDS, BLOCK)
