"""The tail-biting Viterbi of viterbi.py at K = 2 with its state in registers: a program per tile, fp16 costs
in pairs.

Node n (the low 14 bits of a state) at position q costs the min over k of err(k<<14 | n, w_q) plus the cost
of node (k<<14 | n) >> 2 at q-1. Costs are fp16, two adjacent nodes to an int32 word (they share their
predecessors), and the arithmetic is on such pairs in f16x2 PTX: per pair and k a subtract, a fused
multiply-add (whose addend half ptxas selects in the operand), a compare, a min and a select. Each thread
owns the same nodes at every step, so it evaluates the codebook for its 2^16 / threads states once and
keeps the values in registers; per step only the new costs move between threads (the trellis shifts the
node bits by two) and two bits of backpointer per node go to memory. fp16 costs are what exllamav3's
encoder keeps too; its error is matched to within 1e-5 (docs/RESULTS.md).

Pass 1, its traceback, pass 2 and its traceback are four launches per wave of tiles.
Without ASM (the interpreter) each pair op is unpacked to fp32 and rounded back to fp16.
"""
import torch
import triton
import triton.language as tl

from ..format.codebook import CODEBOOKS
from ..kernels.triton_exl3 import codebook_fp16

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
    """Two fp32 values rounded to fp16 and packed into a word, lo in the low half."""
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
    if ASM:  # k * 0x10001 spelled out: the string must be a constant
        return tl.inline_asm_elementwise(
            "{ .reg .b32 m; set.lt.u32.f16x2 m, $3, $2; min.f16x2 $0, $2, $3; lop3.b32 $1, m, "
            + ("0x10001" if k == 1 else "0x20002" if k == 2 else "0x30003") + ", $4, 0xCA; }",
            "=r,=r,r,r,r", [best, c, arg], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    b0, b1 = _halves(best)
    c0, c1 = _halves(c)
    lt0, lt1 = c0 < b0, c1 < b1
    new_arg = tl.where(lt0, k, arg & 0xFFFF) | (tl.where(lt1, k, (arg >> 16) & 0xFFFF) << 16)
    return _pair(tl.where(lt0, c0, b0), tl.where(lt1, c1, b1)), new_arg


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
    lo = codebook_fp16(s, CB).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = codebook_fp16(s + 1, CB).to(tl.int16, bitcast=True).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _codebook(m2, CB: tl.constexpr):
    """16 (M2,) tensors, [4 k + i]: the words of states k<<14 | (8 m2 + 2 i) and the next."""
    s = (m2 * 8).to(tl.uint32)
    return (_word(s, CB), _word(s + 2, CB), _word(s + 4, CB), _word(s + 6, CB),
            _word(s + 16384, CB), _word(s + 16386, CB), _word(s + 16388, CB), _word(s + 16390, CB),
            _word(s + 32768, CB), _word(s + 32770, CB), _word(s + 32772, CB), _word(s + 32774, CB),
            _word(s + 49152, CB), _word(s + 49154, CB), _word(s + 49156, CB), _word(s + 49158, CB))


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
def _forward_kernel(tiles_ptr, ends_ptr, bp_ptr, CB: tl.constexpr, WARMUP: tl.constexpr, PASS: tl.constexpr,
                    ASM: tl.constexpr):
    """PASS 1: free start WARMUP positions before the wrap, 2 WARMUP steps; the backpointers of the last
    WARMUP and the cheapest final node (the lowest on ties) are kept. PASS 2: positions 0..255 from node
    ends[t] at position 255, all backpointers kept."""
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
        e = tl.load(ends_ptr + t)
        wid = tl.arange(0, 8192)
        o = _split4(tl.where(wid * 2 == e, INF2 & -65536, tl.where(wid * 2 + 1 == e, INF2 & 0xFFFF, INF2)))
        first, steps, kept = 0, 256, 256
    n = o
    for i in range(steps):
        w = tl.load(tile + (first + i) % 256).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        n, packed = _step(o, cb, (w & 0xFFFF) | (w << 16), ASM)
        if i >= steps - kept:
            tl.store(bp + (i - (steps - kept)) * M2 + at, packed)
        o = _next(n)
    if PASS == 1:
        least = tl.full([], float("inf"), tl.float32)
        for i in tl.static_range(4):
            lo, hi = _halves(n[i])
            least = tl.minimum(least, tl.minimum(tl.min(lo), tl.min(hi)))
        e = tl.full([], 1 << 14, tl.int32)
        for i in tl.static_range(4):
            lo, hi = _halves(n[i])
            node = m2 * 8 + 2 * i
            e = tl.minimum(e, tl.minimum(tl.min(tl.where(lo == least, node, 1 << 14)),
                                         tl.min(tl.where(hi == least, node + 1, 1 << 14))))
        tl.store(ends_ptr + t, e)


@triton.jit
def _trace_kernel(ends_ptr, bp_ptr, states_ptr, T, STEPS: tl.constexpr, STATES: tl.constexpr,
                  BLOCK: tl.constexpr):
    """From node ends[t] at the last of STEPS kept steps back to the first, BLOCK tiles per program: the
    states of every step (STATES, pass 2), or only the node before the first, back into ends (pass 1)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = t < T
    e = tl.load(ends_ptr + t, mask=live, other=0)
    bp = bp_ptr + t.to(tl.int64) * 256 * M2
    for i in range(STEPS):
        q = STEPS - 1 - i
        word = tl.load(bp + q * M2 + (e >> 3), mask=live, other=0)
        s = (((word >> (((e >> 1) & 3) * 2 + (e & 1) * 16)) & 3) << 14) | e
        if STATES:
            tl.store(states_ptr + t * 256 + q, s, mask=live)
        e = s >> 2
    if not STATES:
        tl.store(ends_ptr + t, e, mask=live)


def viterbi_half_triton(tiles: torch.Tensor, codebook: str, warmup: int = 128, scratch_bytes: int = 4 << 30,
                        num_warps: int = 16) -> torch.Tensor:
    """tiles: float32 (T, 256) -> int64 states (T, 256) of closed paths at K = 2, costs in fp16 pairs.

    Tiles run in waves whose backpointers (2 MB a tile) fit in `scratch_bytes`, a whole number of programs
    per SM so that no wave ends half empty."""
    if tiles.dtype != torch.float32 or tiles.dim() != 2 or tiles.shape[1] != 256:
        raise ValueError(f"tiles must be float32 (T, 256), got {tiles.dtype} {tuple(tiles.shape)}")
    if not 1 <= warmup <= 128:
        raise ValueError(f"warmup must be in 1..128, not {warmup}")
    tiles = tiles.contiguous()
    T = tiles.shape[0]
    states = torch.empty(tiles.shape, dtype=torch.int32, device=tiles.device)
    ends = torch.empty(T, dtype=torch.int32, device=tiles.device)
    sms = torch.cuda.get_device_properties(tiles.device).multi_processor_count if tiles.is_cuda else 1
    wave = max(sms, scratch_bytes // (256 * M2.value * 4) // sms * sms)
    bp = torch.empty((min(wave, T), 256, M2.value), dtype=torch.int32, device=tiles.device)
    cb, asm = CODEBOOKS.index(codebook), tiles.device.type == "cuda"
    for a in range(0, T, wave):
        b = min(a + wave, T)
        for pass_, steps in ((1, warmup), (2, 256)):
            _forward_kernel[(b - a,)](tiles[a:b], ends[a:b], bp, CB=cb, WARMUP=warmup, PASS=pass_, ASM=asm,
                                      num_warps=num_warps)
            _trace_kernel[(triton.cdiv(b - a, 32),)](ends[a:b], bp, states[a:b], b - a, STEPS=steps,
                                                     STATES=pass_ == 2, BLOCK=32)
    return states.to(torch.int64)
