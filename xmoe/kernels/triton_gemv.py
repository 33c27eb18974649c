"""The CUDA-core path of the grouped EXL3 GEMM, for chunks of one or two rows (decode sizes): decoded weights go
from the codebook straight into FMAs instead of through shared memory to the tensor cores."""
import triton
import triton.language as tl

from .triton_codebook import codebook_halves, codebook_operand
from .triton_decode import load_words, tile_offsets, tile_states


@triton.jit
def codebook_fp32(state, mask, CB: tl.constexpr, ASM: tl.constexpr):
    """codebook_fp16's values in fp32, for CUDA-core products; at mul1 h (codebook_operand), the FMA left to the
    epilogue. `mask` is HALVES_MASK passed as an argument, so ptxas reads it from the constant bank rather than
    re-materialising it for every weight; ASM adds the two fp16 halves of a register in one instruction and
    widens the sum, or takes mul1's byte sum in one dp4a (inline PTX: not under the interpreter)."""
    if CB == 2:
        return codebook_operand(state, CB, True, ASM).to(tl.float32)
    x = codebook_halves(state, mask, CB)
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $1; add.rn.f16 l, l, h; cvt.f32.f16 $0, l; }",
            "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return ((x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True) +
            (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)).to(tl.float32)


@triton.jit
def grouped_gemv(a0_ptr, a1_ptr, chunk_pos_ptr, chunk_len_ptr, chunk_expert_ptr, n_chunks_ptr, t0_ptr, t1_ptr,
                 p0_ptr, p1_ptr, P, k, n, stride_te, mask, W: tl.constexpr, CB: tl.constexpr, DUAL: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, KLOG: tl.constexpr, ASM: tl.constexpr,
                 ROWS: tl.constexpr):
    """grouped_gemm on CUDA cores for chunks of one or two rows (ROWS = 2: tokens routed to one expert in pairs):
    each weight is decoded once per chunk and multiplied into fp32 products with its rows, so decoded weights
    go from the codebook straight into FMAs, never through shared memory. Each thread keeps one product per
    weight and row until the end of its K range; a chunk of two rows halves the K step to stay within the
    registers of one row, since registers are allotted per kernel and more for one branch would slow every
    chunk. The tiled decoder only (K = 1, 2, 4, 8)."""
    tl.static_assert(ROWS == 1 or ROWS == 2)
    pid_c = tl.program_id(0)
    if pid_c >= tl.load(n_chunks_ptr):
        return
    length = tl.load(chunk_len_ptr + pid_c)
    pos = tl.load(chunk_pos_ptr + pid_c).to(tl.int64)
    e = tl.load(chunk_expert_ptr + pid_c).to(tl.int64)
    w0, w1 = t0_ptr + e * stride_te, t1_ptr + e * stride_te
    if ROWS == 1 or length == 1:
        gemv_rows(a0_ptr, a1_ptr, w0, w1, p0_ptr, p1_ptr, pos, P, k, n, mask, W, CB, DUAL, BN, BK, SPLIT, KLOG,
                  ASM, 1)
    else:
        gemv_rows(a0_ptr, a1_ptr, w0, w1, p0_ptr, p1_ptr, pos, P, k, n, mask, W, CB, DUAL, BN, BK // 2, SPLIT,
                  KLOG, ASM, 2)


@triton.jit
def gemv_rows(a0_ptr, a1_ptr, w0_base, w1_base, p0_ptr, p1_ptr, pos, P, k, n, mask, W: tl.constexpr,
              CB: tl.constexpr, DUAL: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
              KLOG: tl.constexpr, ASM: tl.constexpr, R: tl.constexpr):
    """One chunk's column block and K split for R (1 or 2) rows from `pos`: the (BK, BN) products of row r and
    projection p (1: up, DUAL) are acc[2 * r + p]."""
    tl.static_assert(BK >= 16)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    lo_off, hi_off, shift = tile_offsets(pid_n, n, W, KLOG, BK, BN)
    steps = k // BK
    per = tl.cdiv(steps, SPLIT)
    first = pid_s * per
    last = tl.minimum(steps, first + per)
    acc0 = tl.zeros((BK, BN), tl.float32)
    acc1 = tl.zeros((BK, BN), tl.float32)
    acc2 = tl.zeros((BK, BN), tl.float32)
    acc3 = tl.zeros((BK, BN), tl.float32)
    stride_step = (BK // 16) * (n // 16) * W
    a_off = pos * k + tl.arange(0, BK)
    block = first * stride_step
    lo0, hi0 = load_words(w0_base + block, lo_off, hi_off)
    lo1, hi1 = lo0, hi0
    if DUAL:
        lo1, hi1 = load_words(w1_base + block, lo_off, hi_off)
    for step in range(first, last):  # the next step's words are loaded before this step is decoded
        block = tl.minimum(step + 1, last - 1) * stride_step
        next_lo0, next_hi0 = load_words(w0_base + block, lo_off, hi_off)
        next_lo1, next_hi1 = next_lo0, next_hi0
        if DUAL:
            next_lo1, next_hi1 = load_words(w1_base + block, lo_off, hi_off)
        off = a_off + step * BK
        w = codebook_fp32(tile_states(lo0, hi0, shift, KLOG, BK, BN), mask, CB, ASM)
        acc0 += w * tl.load(a0_ptr + off).to(tl.float32)[:, None]
        if R > 1:
            acc2 += w * tl.load(a0_ptr + off + k).to(tl.float32)[:, None]
        if DUAL:
            w = codebook_fp32(tile_states(lo1, hi1, shift, KLOG, BK, BN), mask, CB, ASM)
            acc1 += w * tl.load(a1_ptr + off).to(tl.float32)[:, None]
            if R > 1:
                acc3 += w * tl.load(a1_ptr + off + k).to(tl.float32)[:, None]
        lo0, hi0, lo1, hi1 = next_lo0, next_hi0, next_lo1, next_hi1
    out = (pid_s * P + pos) * n + pid_n * BN + tl.arange(0, BN)
    tl.store(p0_ptr + out, sum_rows(acc0, BK, BN))
    if R > 1:
        tl.store(p0_ptr + out + n, sum_rows(acc2, BK, BN))
    if DUAL:
        tl.store(p1_ptr + out, sum_rows(acc1, BK, BN))
        if R > 1:
            tl.store(p1_ptr + out + n, sum_rows(acc3, BK, BN))


@triton.jit
def sum_rows(acc, BK: tl.constexpr, BN: tl.constexpr):
    """(BN,) sums over the K axis of (BK, BN), within each 16-row tile first. Summing the decoder's layout in
    one step miscompiles under Triton 3.6 (wrong sums on an H200); this order is correct there."""
    return tl.sum(tl.sum(tl.reshape(acc, (BK // 16, 16, BN)), axis=1), axis=0)
