"""The grouped EXL3 GEMM on tensor cores (tl.dot), decoding the trellis in registers, and the dense path's decoder.

One grouped GEMM serves dense layers and experts. Its rows come in *chunks* of at most BM rows that share one
weight (a dense layer: consecutive rows; a MoE: the tokens routed to one expert, from a device-side sort), so each
weight tile is decoded once per chunk and applied to all its rows. Every (chunk, column block, K split) is one
program; programs past the device-side chunk count exit at once, so grids are sized from host-known bounds and the
calls capture in CUDA graphs. K splits write fp32 partials that an epilogue sums in a fixed order (deterministic, no
atomics), then rotates by H_128 and scales (triton_epilogues). At decode sizes the product can be taken as W^T a^T
(SWAP), the decoded weights being the MMA's wide operand.
"""
import triton
import triton.language as tl

from .triton_decode import decode_block, decode_tiles, gather_offsets, load_words, tile_offsets


@triton.jit
def mma(a, w, acc, SWAP: tl.constexpr):
    """acc + a @ w; SWAP keeps acc transposed and multiplies w^T a^T, so the decoded weights are the MMA's
    first operand (M = BN rows) and the few token rows its narrow second one."""
    if SWAP:
        acc = tl.dot(tl.trans(w), tl.trans(a), acc)
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def grouped_gemm(a0_ptr, a1_ptr, chunk_pos_ptr, chunk_len_ptr, chunk_expert_ptr, n_chunks_ptr,
                 t0_ptr, t1_ptr, table_ptr, p0_ptr, p1_ptr, P, k, n, stride_te,
                 W: tl.constexpr, CB: tl.constexpr, DUAL: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                 TILED: tl.constexpr = False, KLOG: tl.constexpr = 1, SWAP: tl.constexpr = False,
                 ASM: tl.constexpr = False):
    """Partial products p[split, pos, n] = a[pos] @ W-hat[e] over this split's K range, for the rows of one
    chunk (consecutive positions pos0 .. pos0+len-1 that share expert e); at mul1 of h (codebook_operand).

    a (P, k) fp16, already rotated; trellis as int32 words (E, k/16, n/16, W); p (SPLIT, P, n) fp32.
    DUAL decodes a second weight (up) against its own rotated rows a1. TILED (K = 2^KLOG only) loads each
    tile's words once and spreads them (decode_tiles) instead of gathering two words per weight.
    """
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if pid_c >= tl.load(n_chunks_ptr):
        return
    pos0 = tl.load(chunk_pos_ptr + pid_c)
    count = tl.load(chunk_len_ptr + pid_c)
    e = tl.load(chunk_expert_ptr + pid_c).to(tl.int64)
    m = tl.arange(0, BM)
    live = m < count
    pos = (pos0 + m).to(tl.int64)
    kr = tl.arange(0, BK)
    cols = pid_n * BN + tl.arange(0, BN)

    # Word offsets, relative to the block's first k-tile row: per tile word (TILED), or per weight (gather).
    n_tiles = n // 16
    if TILED:
        lo_off, hi_off, shift = tile_offsets(pid_n, n, W, KLOG, BK, BN)
    else:
        lo_off, hi_off, shift = gather_offsets(table_ptr, pid_n, n, W, BK, BN)

    steps = k // BK
    per = tl.cdiv(steps, SPLIT)
    first = pid_s * per
    last = tl.minimum(steps, first + per)
    if SWAP:
        acc0 = tl.zeros((BN, BM), tl.float32)
        acc1 = tl.zeros((BN, BM), tl.float32)
    else:
        acc0 = tl.zeros((BM, BN), tl.float32)
        acc1 = tl.zeros((BM, BN), tl.float32)
    w0_base = t0_ptr + e * stride_te
    w1_base = t1_ptr + e * stride_te
    stride_step = (BK // 16) * n_tiles * W  # words per K step, within one expert: fits int32
    a_off = pos[:, None] * k + kr[None, :]
    if TILED:  # the next step's words are loaded before this step is decoded, to hide their latency
        block = first * stride_step
        lo0, hi0 = load_words(w0_base + block, lo_off, hi_off)
        lo1, hi1 = lo0, hi0
        if DUAL:
            lo1, hi1 = load_words(w1_base + block, lo_off, hi_off)
        for step in range(first, last):
            block = tl.minimum(step + 1, last - 1) * stride_step
            next_lo0, next_hi0 = load_words(w0_base + block, lo_off, hi_off)
            next_lo1, next_hi1 = next_lo0, next_hi0
            if DUAL:
                next_lo1, next_hi1 = load_words(w1_base + block, lo_off, hi_off)
            a = tl.load(a0_ptr + a_off + step * BK, mask=live[:, None], other=0.0)
            acc0 = mma(a, decode_tiles(lo0, hi0, shift, CB, KLOG, BK, BN, True, ASM), acc0, SWAP)
            if DUAL:
                a = tl.load(a1_ptr + a_off + step * BK, mask=live[:, None], other=0.0)
                acc1 = mma(a, decode_tiles(lo1, hi1, shift, CB, KLOG, BK, BN, True, ASM), acc1, SWAP)
            lo0, hi0, lo1, hi1 = next_lo0, next_hi0, next_lo1, next_hi1
    else:
        for step in range(first, last):
            block = step * stride_step
            a = tl.load(a0_ptr + a_off + step * BK, mask=live[:, None], other=0.0)
            acc0 = tl.dot(a, decode_block(w0_base + block, lo_off, hi_off, shift, CB, True, ASM), acc0)
            if DUAL:
                a = tl.load(a1_ptr + a_off + step * BK, mask=live[:, None], other=0.0)
                acc1 = tl.dot(a, decode_block(w1_base + block, lo_off, hi_off, shift, CB, True, ASM), acc1)
    if SWAP:
        acc0, acc1 = tl.trans(acc0), tl.trans(acc1)
    out = (pid_s * P + pos)[:, None] * n + cols[None, :]
    tl.store(p0_ptr + out, acc0, mask=live[:, None])
    if DUAL:
        tl.store(p1_ptr + out, acc1, mask=live[:, None])


@triton.jit
def decode_weights(t_ptr, expert_ptr, table_ptr, out_ptr, k, n, stride_te, W: tl.constexpr, CB: tl.constexpr,
                   BK: tl.constexpr, BN: tl.constexpr, TILED: tl.constexpr, KLOG: tl.constexpr,
                   MUL1_H: tl.constexpr, ASM: tl.constexpr):
    """out[i] = W-hat of expert expert[i] (program axis 2) as (k, n) fp16, one (BK, BN) block per program: the
    weights of the experts many rows use, decoded once for a dense matmul (codebook_operand). Decoders as in
    grouped_gemm."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    i = tl.program_id(2)
    e = tl.load(expert_ptr + i).to(tl.int64)
    base = t_ptr + e * stride_te + pid_k * ((BK // 16) * (n // 16) * W)
    if TILED:
        lo_off, hi_off, shift = tile_offsets(pid_n, n, W, KLOG, BK, BN)
        lo, hi = load_words(base, lo_off, hi_off)
        w = decode_tiles(lo, hi, shift, CB, KLOG, BK, BN, MUL1_H, ASM)
    else:
        lo_off, hi_off, shift = gather_offsets(table_ptr, pid_n, n, W, BK, BN)
        w = decode_block(base, lo_off, hi_off, shift, CB, MUL1_H, ASM)
    rows = (pid_k * BK + tl.arange(0, BK)).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(out_ptr + i.to(tl.int64) * k * n + rows[:, None] * n + cols[None, :], w)
