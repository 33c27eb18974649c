"""The tail-biting Viterbi of viterbi.py at K = 2, 3, 4 with its state in registers: a program per tile, fp16
costs in pairs.

Node n (the low 16 - K bits of a state) at position q costs the min over k of err(k<<(16-K) | n, w_q) plus
the cost of node (k<<(16-K) | n) >> K at q-1. Costs are fp16, two adjacent nodes to an int32 word (they share
their predecessors), and the arithmetic is on such pairs in f16x2 PTX: per pair and k a subtract, a fused
multiply-add (whose addend half ptxas selects in the operand), a compare, a min and a select. Each thread
owns the same nodes at every step, so it evaluates the codebook for its 2^16 / threads states once and
keeps the values in registers; per step only the new costs move between threads (the trellis shifts the
node bits by K) and K bits of backpointer per node go to memory. fp16 costs are what exllamav3's encoder
keeps too; its error is matched to five digits (docs/RESULTS.md).

Nodes come in groups of 2^(K+1) (2^K words) that share their predecessor words, one word per choice k. At
K = 2 a group's four words are four tensors (the layout that compiles to the fewest instructions); at K = 3
and 4 the words of a group with one k and one predecessor half are the columns of one tensor.
Pass 1, its traceback, pass 2 and its traceback are four launches per wave of tiles.
Without ASM (the interpreter) each pair op is unpacked to fp32 and rounded back to fp16.
"""
import torch
import triton
import triton.language as tl

from ..format.codebook import CODEBOOKS
from ..kernels.triton_codebook import codebook_fp16

M2 = tl.constexpr(2048)  # groups of eight nodes (four words): 2^14 nodes / 8
INF2 = tl.constexpr(0x7C007C00)


@triton.jit
def _halves(x):
    """A word's two fp16 halves, as fp32 (the interpreter's path)."""
    lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((x >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pair(lo, hi):
    """Two values rounded to fp16 (exact for fp16 ones) and packed into a word, lo in the low half."""
    lo = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _cost(v, w, prev, HI: tl.constexpr, ASM: tl.constexpr):
    """(v - w)^2 + p on fp16 pairs, the square and the add fused, where p is the low (HI: the high) half of
    prev in both halves (ptxas folds the spread into the operand)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; .reg .b32 d, p; mov.b32 {l, h}, $3; mov.b32 p, " + ("{h, h}" if HI else "{l, l}")
            + "; sub.rn.f16x2 d, $1, $2; fma.rn.f16x2 $0, d, d, p; }", "=r,r,r,r",
            [v, w, prev], dtype=tl.int32, is_pure=True, pack=1)
    v0, v1 = _halves(v)
    w0, w1 = _halves(w)
    p0, p1 = _halves(prev)
    if HI:
        p0 = p1
    else:
        p1 = p0
    d0 = (v0 - w0).to(tl.float16).to(tl.float32)
    d1 = (v1 - w1).to(tl.float16).to(tl.float32)
    return _pair(d0 * d0 + p0, d1 * d1 + p1)


@triton.jit
def _better(best, arg, c, k: tl.constexpr, ASM: tl.constexpr):
    """Per half: where c < best, take c and choice k (ties keep the earlier, lower k)."""
    if ASM:  # k in both halves: a constant, which ptxas puts into the lop3
        return tl.inline_asm_elementwise(
            "{ .reg .b32 m; set.lt.u32.f16x2 m, $3, $2; min.f16x2 $0, $2, $3; lop3.b32 $1, m, $5, $4, 0xCA; }",
            "=r,=r,r,r,r,r", [best, c, arg, tl.full(best.shape, k * 0x10001, tl.int32)], dtype=(tl.int32, tl.int32),
            is_pure=True, pack=1)
    b0, b1 = _halves(best)
    c0, c1 = _halves(c)
    lt0, lt1 = c0 < b0, c1 < b1
    new_arg = tl.where(lt0, k, arg & 0xFFFF) | (tl.where(lt1, k, (arg >> 16) & 0xFFFF) << 16)
    return _pair(tl.where(lt0, c0, b0), tl.where(lt1, c1, b1)), new_arg


@triton.jit
def _weight(tile, q):
    """Position q's weight of the tile as an fp16 pair (both halves)."""
    w = tl.load(tile + q)
    return _pair(w, w)


@triton.jit
def _split4(flat):
    """Flat words (8192,) -> four (M2,) tensors: choice k's predecessors, words k * M2 + m2."""
    x = tl.reshape(tl.permute(tl.reshape(flat, (4, 2048)), (1, 0)), (2048, 2, 2))
    x0, x1 = tl.split(x)
    o0, o2 = tl.split(x0)
    o1, o3 = tl.split(x1)
    return o0, o1, o2, o3


@triton.jit
def _word(s, CB: tl.constexpr):
    """Words of the values of states s (low half) and s + 1 (high half)."""
    return _pair(codebook_fp16(s, CB), codebook_fp16(s + 1, CB))


@triton.jit
def _codebook(m2, CB: tl.constexpr):
    """16 (M2,) tensors, [4 k + i]: the words of states k<<14 | (8 m2 + 2 i) and the next."""
    cb = ()
    for i in tl.static_range(16):
        cb = cb + (_word(((i // 4) * 16384 + m2 * 8 + (i % 4) * 2).to(tl.uint32), CB),)
    return cb


@triton.jit
def _word_step(o, c0, c1, c2, c3, w2, HI: tl.constexpr, ASM: tl.constexpr):
    """One word of new costs from its predecessors' words o (by k; the low or, with HI, the high node) and
    its four candidates' values."""
    best = _cost(c0, w2, o[0], HI, ASM)
    arg = tl.zeros_like(best)
    best, arg = _better(best, arg, _cost(c1, w2, o[1], HI, ASM), 1, ASM)
    best, arg = _better(best, arg, _cost(c2, w2, o[2], HI, ASM), 2, ASM)
    return _better(best, arg, _cost(c3, w2, o[3], HI, ASM), 3, ASM)


@triton.jit
def _step(o, cb, w2, ASM: tl.constexpr):
    """Costs o (four (M2,) words, by k) -> the four new words of each group of eight nodes, and the packed
    backpointers: two bits per node, word i's low node at bit 2i, its high node at bit 16 + 2i.
    Words i = 0, 1 continue the low node of their predecessor word, i = 2, 3 the high one."""
    n0, a0 = _word_step(o, cb[0], cb[4], cb[8], cb[12], w2, False, ASM)
    n1, a1 = _word_step(o, cb[1], cb[5], cb[9], cb[13], w2, False, ASM)
    n2, a2 = _word_step(o, cb[2], cb[6], cb[10], cb[14], w2, True, ASM)
    n3, a3 = _word_step(o, cb[3], cb[7], cb[11], cb[15], w2, True, ASM)
    return (n0, n1, n2, n3), a0 + a1 * 4 + a2 * 16 + a3 * 64


@triton.jit
def _next(n):
    """The four new words of each group (word 4 m2 + i) as next step's predecessors by k. This is where the
    trellis moves costs between threads (Triton converts the layout through shared memory)."""
    return _split4(tl.reshape(tl.join(tl.join(n[0], n[2]), tl.join(n[1], n[3])), (8192,)))


@triton.jit
def _closed(e, W: tl.constexpr):
    """Flat words of pass 2's first costs: 0 at node e, inf at every other node."""
    wid = tl.arange(0, W)
    return tl.where(wid * 2 == e, INF2 & -65536, tl.where(wid * 2 + 1 == e, INF2 & 0xFFFF, INF2))


@triton.jit
def _cheapest(n, nodes):
    """The node of least cost (the lowest on ties) among words n[i], whose low nodes are nodes[i]."""
    least = tl.full([], float("inf"), tl.float32)
    for i in tl.static_range(len(n)):
        lo, hi = _halves(n[i])
        least = tl.minimum(least, tl.minimum(tl.min(lo), tl.min(hi)))
    e = tl.full([], 1 << 16, tl.int32)
    for i in tl.static_range(len(n)):
        lo, hi = _halves(n[i])
        e = tl.minimum(e, tl.minimum(tl.min(tl.where(lo == least, nodes[i], 1 << 16)),
                                     tl.min(tl.where(hi == least, nodes[i] + 1, 1 << 16))))
    return e


@triton.jit
def _forward_kernel(tiles_ptr, ends_ptr, bp_ptr, CB: tl.constexpr, WARMUP: tl.constexpr, PASS: tl.constexpr,
                    ASM: tl.constexpr):
    """K = 2. PASS 1: free start WARMUP positions before the wrap, 2 WARMUP steps; the backpointers of the
    last WARMUP and the cheapest final node are kept. PASS 2: positions 0..255 from node ends[t] at position
    255, all backpointers kept."""
    t = tl.program_id(0).to(tl.int64)
    tile = tiles_ptr + t * 256
    bp = bp_ptr + t * 256 * M2
    m2 = tl.arange(0, 2048)
    at = tl.max_contiguous(m2, 1)  # keeps the stores in the layout of the costs, not one made for them
    cb = _codebook(m2, CB)
    if PASS == 1:
        z = tl.zeros([2048], tl.int32)
        o = (z, z, z, z)
        first, steps, kept = 256 - WARMUP, 2 * WARMUP, WARMUP
    else:
        o = _split4(_closed(tl.load(ends_ptr + t), 8192))
        first, steps, kept = 0, 256, 256
    n = o
    for i in range(steps):
        n, packed = _step(o, cb, _weight(tile, (first + i) % 256), ASM)
        if i >= steps - kept:
            tl.store(bp + (i - (steps - kept)) * M2 + at, packed)
        o = _next(n)
    if PASS == 1:
        tl.store(ends_ptr + t, _cheapest(n, (m2 * 8, m2 * 8 + 2, m2 * 8 + 4, m2 * 8 + 6)))


@triton.jit
def _trace_kernel(ends_ptr, bp_ptr, states_ptr, T, K: tl.constexpr, STEPS: tl.constexpr, STATES: tl.constexpr,
                  BLOCK: tl.constexpr):
    """From node ends[t] at the last of STEPS kept steps back to the first, BLOCK tiles per program: the
    states of every step (STATES, pass 2), or only the node before the first, back into ends (pass 1)."""
    G: tl.constexpr = 1 << K
    E: tl.constexpr = M2 if K == 2 else (1 << (16 - K)) // 4  # backpointer elements per step
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = t < T
    e = tl.load(ends_ptr + t, mask=live, other=0)
    bp = bp_ptr + t.to(tl.int64) * 256 * E
    for i in range(STEPS):
        q = STEPS - 1 - i
        if K == 2:  # an int32 per eight nodes
            x = tl.load(bp + q * E + (e >> 3), mask=live, other=0)
            off = ((e >> 1) & 3) * 2 + (e & 1) * 16
        else:  # an int16 per (m2, j2)
            x = tl.load(bp + q * E + (e >> (K + 1)) * (G // 2) + ((e & (G - 1)) >> 1), mask=live, other=0)
            x = x.to(tl.int32) & 0xFFFF
            off = (((e >> K) & 1) * 2 + (e & 1)) * K
        s = (((x >> off) & (G - 1)) << (16 - K)) | e
        if STATES:
            tl.store(states_ptr + t * 256 + q, s, mask=live)
        e = s >> K
    if not STATES:
        tl.store(ends_ptr + t, e, mask=live)


@triton.jit
def _codebook_k(K: tl.constexpr, CB: tl.constexpr):
    """K = 3, 4: 2^(K+1) (M2, J2) tensors, [2 k + a][m2, j2] the word of states k<<(16-K) | ((2 m2 + a) 2^K
    + 2 j2) and the next."""
    G: tl.constexpr = 1 << K
    base = tl.arange(0, (1 << (16 - K)) // (2 * G))[:, None] * (2 * G) + tl.arange(0, G // 2)[None, :] * 2
    cb = ()
    for i in tl.static_range(2 * G):
        cb = cb + (_word((((i // 2) << (16 - K)) + base + (i % 2) * G).to(tl.uint32), CB),)
    return cb


@triton.jit
def _split_k(flat, K: tl.constexpr):
    """Flat words -> 2^K (M2,) tensors by k: words k * M2 + m2 (split one bit of k at a time)."""
    G: tl.constexpr = 1 << K
    M2: tl.constexpr = (1 << (16 - K)) // (2 * G)
    x = tl.permute(tl.reshape(flat, (G, M2)), (1, 0))
    x = tl.reshape(x, (M2, 2, 2, 2)) if K == 3 else tl.reshape(x, (M2, 2, 2, 2, 2))
    parts = (x,)
    for level in tl.static_range(K):
        lows = ()
        highs = ()
        for i in tl.static_range(1 << level):
            p0, p1 = tl.split(parts[i])
            lows = lows + (p0,)
            highs = highs + (p1,)
        parts = lows + highs
    return parts


@triton.jit
def _step_k(o, cb, w2, K: tl.constexpr, ASM: tl.constexpr):
    """Costs o (2^K (M2,) words, by k) -> new words (two (M2, J2) tensors, by a) and the packed backpointers,
    an int16 per (m2, j2): word (a, j2)'s low node at bit 2 a K, its high node at bit (2 a + 1) K."""
    news = ()
    packed = tl.zeros_like(cb[0])
    for a in tl.static_range(2):
        best = _cost(cb[a], w2, o[0][:, None], a == 1, ASM)
        arg = tl.zeros_like(best)
        for k in tl.static_range(1, 1 << K):
            best, arg = _better(best, arg, _cost(cb[2 * k + a], w2, o[k][:, None], a == 1, ASM), k, ASM)
        news = news + (best,)
        packed = packed | ((arg & 0xFFFF) << (2 * a * K)) | (((arg >> 16) & 0xFFFF) << ((2 * a + 1) * K))
    return news, packed.to(tl.int16)


@triton.jit
def _forward_kernel_k(tiles_ptr, ends_ptr, bp_ptr, K: tl.constexpr, CB: tl.constexpr, WARMUP: tl.constexpr,
                      PASS: tl.constexpr, ASM: tl.constexpr):
    """_forward_kernel at K = 3, 4."""
    G: tl.constexpr = 1 << K
    M2: tl.constexpr = (1 << (16 - K)) // (2 * G)
    W: tl.constexpr = (1 << (16 - K)) // 2  # words
    t = tl.program_id(0).to(tl.int64)
    tile = tiles_ptr + t * 256
    bp = bp_ptr + t * 256 * (M2 * G // 2)
    at = tl.max_contiguous(tl.arange(0, M2)[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :], [1, 1])
    cb = _codebook_k(K, CB)
    if PASS == 1:
        o = _split_k(tl.zeros([W], tl.int32), K)
        first, steps, kept = 256 - WARMUP, 2 * WARMUP, WARMUP
    else:
        o = _split_k(_closed(tl.load(ends_ptr + t), W), K)
        first, steps, kept = 0, 256, 256
    z = tl.zeros([M2, G // 2], tl.int32)
    n = (z, z)
    for i in range(steps):
        n, packed = _step_k(o, cb, _weight(tile, (first + i) % 256), K, ASM)
        if i >= steps - kept:
            tl.store(bp + (i - (steps - kept)) * (M2 * G // 2) + at, packed)
        o = _split_k(tl.reshape(tl.permute(tl.join(n[0], n[1]), (0, 2, 1)), (W,)), K)  # [m2, a, j2] order
    if PASS == 1:
        base = tl.arange(0, M2)[:, None] * (2 * G) + tl.arange(0, G // 2)[None, :] * 2
        tl.store(ends_ptr + t, _cheapest(n, (base, base + G)))


def check_tiles(tiles: torch.Tensor, warmup: int) -> None:
    """The Viterbi launchers' argument checks: float32 (T, 256) tiles, warmup 1..128."""
    if tiles.dtype != torch.float32 or tiles.dim() != 2 or tiles.shape[1] != 256:
        raise ValueError(f"tiles must be float32 (T, 256), got {tiles.dtype} {tuple(tiles.shape)}")
    if not 1 <= warmup <= 128:
        raise ValueError(f"warmup must be in 1..128, not {warmup}")


def viterbi_half_triton(tiles: torch.Tensor, K: int, codebook: str, warmup: int = 128,
                        scratch_bytes: int = 4 << 30, num_warps: int = 16) -> torch.Tensor:
    """tiles: float32 (T, 256) -> int64 states (T, 256) of closed paths at K = 2, 3 or 4, fp16 costs in pairs.

    Tiles run in waves whose backpointers (2, 1 or 0.5 MB a tile) fit in `scratch_bytes`, a whole number of
    programs per SM so that no wave ends half empty."""
    if K not in (2, 3, 4):
        raise ValueError(f"the fp16-pair Viterbi handles K = 2, 3, 4, not {K}")
    check_tiles(tiles, warmup)
    tiles = tiles.contiguous()
    T = tiles.shape[0]
    states = torch.empty(tiles.shape, dtype=torch.int32, device=tiles.device)
    ends = torch.empty(T, dtype=torch.int32, device=tiles.device)
    per_step, dtype = (M2.value, torch.int32) if K == 2 else ((1 << (16 - K)) // 4, torch.int16)
    sms = torch.cuda.get_device_properties(tiles.device).multi_processor_count if tiles.is_cuda else 1
    wave = max(sms, scratch_bytes // (256 * per_step * dtype.itemsize) // sms * sms)
    bp = torch.empty((min(wave, T), 256, per_step), dtype=dtype, device=tiles.device)
    cb, asm = CODEBOOKS.index(codebook), tiles.device.type == "cuda"
    forward = _forward_kernel if K == 2 else _forward_kernel_k
    for a in range(0, T, wave):
        b = min(a + wave, T)
        for pass_, steps in ((1, warmup), (2, 256)):
            args = dict(CB=cb, WARMUP=warmup, PASS=pass_, ASM=asm, num_warps=num_warps)
            forward[(b - a,)](tiles[a:b], ends[a:b], bp, **(args if K == 2 else dict(args, K=K)))
            _trace_kernel[(triton.cdiv(b - a, 32),)](ends[a:b], bp, states[a:b], b - a, K=K, STEPS=steps,
                                                     STATES=pass_ == 2, BLOCK=32)
    return states.to(torch.int64)
