"""Triton kernels for EXL3 weights: a grouped GEMM that decodes the trellis in registers, a prologue that
rotates its input rows, and the small epilogues that finish the 128-wide output Hadamards.

One grouped GEMM serves dense layers and experts. Its rows come in *chunks* of at most BM rows that share
one weight (a dense layer: consecutive rows; a MoE: the tokens routed to one expert, from a device-side
sort), so each weight tile is decoded once per chunk and applied to all its rows on tensor cores. Every
(chunk, column block, K split) is one program; programs past the device-side chunk count exit at once, so
grids are sized from host-known bounds and the calls capture in CUDA graphs. K splits write fp32 partials
that an epilogue sums in a fixed order (deterministic, no atomics), then rotates by H_128 and scales.

Two decoders. The tiled one (K = 1, 2, 4, 8, the default) loads each tile's words once, the next K step's
while the current one is decoded, and spreads them over the tile by reshape, permute and broadcast; then a
funnel shift and the codebook arithmetic (format/codebook.py) give fp16 weights. The gather one (every K)
loads two words per weight, at offsets and shifts from a 256-entry table per K (format.state_windows).
At decode sizes the product can be taken as W^T a^T (SWAP), the decoded weights being the MMA's wide operand;
at about one row per expert triton_gemv's CUDA-core kernel takes over. For calls where an expert has many rows,
decode_weights writes its weights out once, for a dense matmul.
"""
import triton
import triton.language as tl

from .triton_route import route_small, slot_ranks

MUL1_K_INV: tl.constexpr = tl.constexpr(0.00676727294921875)  # mul1's fp16 FMA: k_inv 0x1EEE, k_bias 0xC931
MUL1_K_BIAS: tl.constexpr = tl.constexpr(-10.3828125)


@triton.jit
def codebook_halves(state, mask, CB: tl.constexpr):
    """3INST (CB 0) and MCG (CB 1): uint32 pairs of fp16 halves whose sum is each state's weight; `mask` is
    0x8FFF8FFF (a kernel argument where ptxas should read it from the constant bank)."""
    if CB == 0:
        x = state * 89226354 + 64248484
    else:
        x = state * 0xCBAC1FED
    return (x & mask) ^ 0x3B603B60


@triton.jit
def codebook_fp16(state, CB: tl.constexpr):
    """fp16 weights of uint32 states 0..65535 (CB: 0 3inst, 1 mcg, 2 mul1), bit-exact with the format."""
    if CB == 2:
        x = state * 0x83DCD12D
        b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        v = (b.to(tl.float32) * 0.00676727294921875 - 3.453125).to(tl.float16)
    else:
        x = codebook_halves(state, 0x8FFF8FFF, CB)
        v = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True) + \
            (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return v


# mul1's h = 1024 + the byte sum of $1 (the state times 0x83DCD12D), as fp16 bits, in one dp4a (inline PTX)
MUL1_H_PTX = tl.constexpr("{ .reg .b32 m, z; mov.b32 m, 0x01010101; mov.b32 z, 0x6400; dp4a.u32.u32 $0, $1, m, z; }")


@triton.jit
def codebook_operand(state, CB: tl.constexpr, MUL1_H: tl.constexpr, ASM: tl.constexpr):
    """codebook_fp16, except that with MUL1_H mul1 gives h = 1024 + its byte sum, the value before the format's
    fp16 FMA, which mul1_affine applies to the products (ASM: the byte sum in one dp4a, inline PTX: not under
    the interpreter)."""
    if CB == 2 and MUL1_H:
        x = state * 0x83DCD12D
        if ASM:
            h = tl.inline_asm_elementwise(MUL1_H_PTX, "=r,r", [x], dtype=tl.uint32, is_pure=True, pack=1)
            return h.to(tl.uint16).to(tl.float16, bitcast=True)
        return ((x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24) + 1024).to(tl.float16)
    return codebook_fp16(state, CB)


@triton.jit
def decode_block(words, lo_off, hi_off, shift, CB: tl.constexpr, MUL1_H: tl.constexpr, ASM: tl.constexpr):
    """Decode weights whose state ends in word lo_off, continuing word hi_off, `shift` bits up
    (codebook_operand)."""
    lo = tl.load(words + lo_off).to(tl.uint32, bitcast=True)
    hi = tl.load(words + hi_off).to(tl.uint32, bitcast=True)
    state = ((lo >> shift) | ((hi << 1) << (31 - shift))) & 0xFFFF  # two shifts: shift may be 0
    return codebook_operand(state, CB, MUL1_H, ASM)


@triton.jit
def spread_words(words, KLOG: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """(BK/16, BN/16, W) tile words -> (BK, BN): each weight gets the word holding its state's last bit.

    For K = 2^KLOG that word is position p >> (5 - KLOG), and p's bits are, from the top, c2 c1 c0 r2 r1 c3
    r3 r0 (tile row r, column c): the word index is a few of r's and c's bits, so the words only need
    their index bits spread onto the (r, c) grid: reshape, permute and broadcast, no gather.
    """
    TK: tl.constexpr = BK // 16
    TN: tl.constexpr = BN // 16
    if KLOG == 0:  # bits c2 c1 c0
        x = tl.reshape(words, (TK, 1, 1, 1, 1, TN, 1, 2, 2, 2))
    elif KLOG == 1:  # c2 c1 c0 r2
        x = tl.permute(tl.reshape(words, (TK, TN, 2, 2, 2, 2)), (0, 5, 1, 2, 3, 4))
        x = tl.reshape(x, (TK, 1, 2, 1, 1, TN, 1, 2, 2, 2))
    elif KLOG == 2:  # c2 c1 c0 r2 r1
        x = tl.permute(tl.reshape(words, (TK, TN, 2, 2, 2, 2, 2)), (0, 5, 6, 1, 2, 3, 4))
        x = tl.reshape(x, (TK, 1, 2, 2, 1, TN, 1, 2, 2, 2))
    else:  # c2 c1 c0 r2 r1 c3
        x = tl.permute(tl.reshape(words, (TK, TN, 2, 2, 2, 2, 2, 2)), (0, 5, 6, 1, 7, 2, 3, 4))
        x = tl.reshape(x, (TK, 1, 2, 2, 1, TN, 2, 2, 2, 2))
    return tl.reshape(tl.broadcast_to(x, (TK, 2, 2, 2, 2, TN, 2, 2, 2, 2)), (BK, BN))


@triton.jit
def tile_offsets(pid_n, n, W: tl.constexpr, KLOG: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """For the tiled decoder: the (BK/16, BN/16, W) word offsets of a block, relative to its first k-tile row,
    the offsets of the words their states continue into, and each (BK, BN) weight's shift."""
    tk = tl.arange(0, BK // 16)[:, None, None]
    tn = tl.arange(0, BN // 16)[None, :, None]
    word = tl.arange(0, W)[None, None, :]
    tile = tk * ((n // 16) * W) + (pid_n * (BN // 16) + tn) * W
    rr = tl.arange(0, BK)[:, None] % 16
    cc = tl.arange(0, BN)[None, :] % 16
    p = 32 * (cc & 7) + 8 * ((rr >> 1) & 3) + 4 * (cc >> 3) + 2 * (rr >> 3) + (rr & 1)
    shift = (32 - (1 << KLOG) * ((p & ((1 << (5 - KLOG)) - 1)) + 1)).to(tl.uint32)
    return tile + word, tile + (word + W - 1) % W, shift


@triton.jit
def gather_offsets(table_ptr, pid_n, n, W: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """For the gather decoder: each (BK, BN) weight's word offset relative to its block's first k-tile row, the
    word its state continues into, and its shift, from the 256-entry table of its K (format.state_windows)."""
    r = tl.arange(0, BK)[:, None]
    c = tl.arange(0, BN)[None, :]
    entry = tl.load(table_ptr + (r % 16) * 16 + c % 16)
    tile = (r // 16) * ((n // 16) * W) + (pid_n * (BN // 16) + c // 16) * W
    return tile + (entry & 0xFF), tile + ((entry >> 8) & 0xFF), (entry >> 16).to(tl.uint32)


@triton.jit
def load_words(base, lo_off, hi_off):
    """The (BK/16, BN/16, W) words of a block and, for each, the word its states continue into."""
    return tl.load(base + lo_off), tl.load(base + hi_off)


@triton.jit
def tile_states(lo, hi, shift, KLOG: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """The (BK, BN) states of a block for K = 1, 2, 4, 8 from its (BK/16, BN/16, W) words, each loaded once."""
    lo = spread_words(lo, KLOG, BK, BN).to(tl.uint32, bitcast=True)
    hi = spread_words(hi, KLOG, BK, BN).to(tl.uint32, bitcast=True)
    return ((lo >> shift) | ((hi << 1) << (31 - shift))) & 0xFFFF


@triton.jit
def decode_tiles(lo, hi, shift, CB: tl.constexpr, KLOG: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                 MUL1_H: tl.constexpr, ASM: tl.constexpr):
    """decode_block for K = 1, 2, 4, 8 from the (BK/16, BN/16, W) words of a block, each loaded once."""
    return codebook_operand(tile_states(lo, hi, shift, KLOG, BK, BN), CB, MUL1_H, ASM)


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
def load_had(had_ptr):
    """The (128, 128) ±1 Sylvester matrix, fp16 (exact; the 1/sqrt(128) is applied in fp32)."""
    return tl.load(had_ptr + tl.arange(0, 128)[:, None] * 128 + tl.arange(0, 128)[None, :])


@triton.jit
def rotate_out(acc, had, STORED: tl.constexpr):
    """H_128 acc for fp32 acc (BM, 128), whose result (or what it feeds) is stored as STORED: for fp32, two fp16
    MMAs on the high and low halves keep ~fp32 accuracy; else one, as rounding acc to fp16 before the orthogonal H
    errs as much as rounding the stored result after it (the epilogues' outputs: on a CPU MoE case the rms error
    against the fp32 reference rose from 5.5e-4 to 6.5-6.9e-4, fp16 rounding alone being 2.1e-4)."""
    hi = acc.to(tl.float16)
    y = tl.dot(hi, had)
    if STORED == tl.float32:
        y += tl.dot((acc - hi.to(tl.float32)).to(tl.float16), had)
    return y * 0.08838834764831845


@triton.jit
def as_operand(y, dtype: tl.constexpr):
    """y stored as the next GEMM reads it: in `dtype`, where int32 means fp16 doubled (y in both halves, each
    value as the two K rows of grouped_mma's operand)."""
    if dtype == tl.int32:
        h = y.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (h | (h << 16)).to(tl.int32, bitcast=True)
    return y.to(dtype)


@triton.jit
def store_operand(y, out_ptr, sums_ptr, pos, live, width, SUMS: tl.constexpr):
    """Block (pos, 128 columns, program axis 1) of y stored in a (rows, width) operand as the next GEMM reads it
    (as_operand); SUMS: also each row's sum of the stored values (fp32, or fp16 in any other form) in
    sums[pos, block], which mul1_affine reads."""
    block = tl.program_id(1)
    cols = block * 128 + tl.arange(0, 128)
    tl.store(out_ptr + pos.to(tl.int64)[:, None] * width + cols[None, :], as_operand(y, out_ptr.dtype.element_ty),
             mask=live[:, None])
    if SUMS:
        stored = y if out_ptr.dtype.element_ty == tl.float32 else y.to(tl.float16).to(tl.float32)
        total = tl.sum(stored, axis=1)
        tl.store(sums_ptr + pos.to(tl.int64) * (width // 128) + block, total, mask=live)


@triton.jit
def mul1_affine(acc, sums_ptr, pos, live, KB):
    """mul1 products over a whole K as the grouped GEMMs leave them (sums of h x, h = 1024 + a state's byte sum,
    the value before the format's fp16 FMA) made the weights' products: weight = h k_inv + k_bias, so sum w x =
    k_inv sum h x + k_bias sum x, sum x from the row's KB block sums (store_operand). Unrounded, the weights
    differ from the format's fp16 ones by that rounding."""
    total = tl.zeros(pos.shape, tl.float32)
    for b in range(0, KB, 16):
        blocks = b + tl.arange(0, 16)
        total += tl.sum(tl.load(sums_ptr + pos.to(tl.int64)[:, None] * KB + blocks[None, :],
                                mask=live[:, None] & (blocks < KB)[None, :], other=0.0), axis=1)
    return acc * MUL1_K_INV + MUL1_K_BIAS * total[:, None]


@triton.jit
def rotate_block(x_ptr, stride_x, pos, row, e, live, read, s0_ptr, s1_ptr, out0_ptr, out1_ptr, sums0_ptr, sums1_ptr,
                 had_ptr, k, stride_se, DUAL: tl.constexpr, SUMS: tl.constexpr):
    """out[pos] = H_128 (x[row] * suh[e]) for the live positions pos, in the 128 columns of program axis 1
    (DUAL: a second suh into out1; SUMS: the block sums, store_operand). x is read where `read` (at least the
    live rows: a mask that waits on no other load lets the rows' loads go first)."""
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = live[:, None]
    x = tl.load(x_ptr + row.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=read[:, None],
                other=0.0).to(tl.float32)
    had = load_had(had_ptr)
    vec = e.to(tl.int64)[:, None] * stride_se + cols[None, :]
    dtype: tl.constexpr = out0_ptr.dtype.element_ty
    y = rotate_out(x * tl.load(s0_ptr + vec, mask=mask, other=0.0).to(tl.float32), had, dtype)
    store_operand(y, out0_ptr, sums0_ptr, pos, live, k, SUMS)
    if DUAL:
        y = rotate_out(x * tl.load(s1_ptr + vec, mask=mask, other=0.0).to(tl.float32), had, dtype)
        store_operand(y, out1_ptr, sums1_ptr, pos, live, k, SUMS)


@triton.jit
def rotate_rows(x_ptr, stride_x, rows_ptr, expert_ptr, s0_ptr, s1_ptr, out0_ptr, out1_ptr, sums0_ptr, sums1_ptr,
                had_ptr, P, k, E, stride_se, DUAL: tl.constexpr, SUMS: tl.constexpr, BM: tl.constexpr):
    """out[pos] = H_128 (x[rows[pos]] * suh[expert[pos]]) in out's dtype, per 128-column block: the rotated
    input of the grouped GEMM (rotate_block). Other ranks' experts' positions are skipped."""
    pos = tl.program_id(0) * BM + tl.arange(0, BM)
    e = tl.load(expert_ptr + pos, mask=pos < P, other=E)
    row = tl.load(rows_ptr + pos, mask=pos < P, other=0)
    live = (pos < P) & (e < E)
    rotate_block(x_ptr, stride_x, pos, row, e, live, live, s0_ptr, s1_ptr, out0_ptr, out1_ptr, sums0_ptr,
                 sums1_ptr, had_ptr, k, stride_se, DUAL, SUMS)


@triton.jit
def route_rotate(ids_ptr, emap_ptr, rows_ptr, sorted_expert_ptr, slot_pos_ptr, slot_expert_ptr, table_ptr, count_ptr,
                 P, E, stride_table, x_ptr, stride_x, s0_ptr, s1_ptr, out0_ptr, out1_ptr, sums0_ptr, sums1_ptr,
                 had_ptr, k, stride_se, TOPK: tl.constexpr, BM: tl.constexpr, PB: tl.constexpr,
                 HAS_MAP: tl.constexpr, DUAL: tl.constexpr, SUMS: tl.constexpr, ROWS: tl.constexpr):
    """route_small and rotate_rows in one launch, for decode sizes: the last row of programs routes (its first
    program, route_small's work; BM the chunks' rows), every other program rotates ROWS slots, its tokens' rows
    loaded at once and stored at the slots' sorted positions, which it finds itself (slot_ranks), so no program
    waits for another."""
    if tl.program_id(0) == tl.num_programs(0) - 1:
        if tl.program_id(1) == 0:
            route_small(ids_ptr, emap_ptr, rows_ptr, sorted_expert_ptr, slot_pos_ptr, slot_expert_ptr, table_ptr,
                        count_ptr, P, E, stride_table, TOPK, BM, PB, HAS_MAP)
    else:
        slot = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        pos, e = slot_ranks(ids_ptr, emap_ptr, slot, P, E, PB, HAS_MAP)
        rotate_block(x_ptr, stride_x, pos, slot // TOPK, e, e < E, slot < P, s0_ptr, s1_ptr, out0_ptr, out1_ptr,
                     sums0_ptr, sums1_ptr, had_ptr, k, stride_se, DUAL, SUMS)


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
def _split_sum(p_ptr, pos, cols, mask, P, n, SPLIT: tl.constexpr):
    """sum over the K splits s of p[s, pos, cols], (BM, 128) for BM positions. Up to 16 rows each split is
    loaded as (1, BM, 128) and summed over that unit axis, which keeps the adds in the loads' layout: loaded as
    (BM, 128), every split went into the MMA operand's layout through shared memory (act_epilogue at 16 rows
    and 16 splits, Triton 3.6: 1,056 shared-memory loads, 83 barriers, spills; this way 48, 21, none).
    Prefill's 64 rows, mostly one split, load them plainly: there the unit axis held more registers."""
    if pos.shape[0] <= 16:
        acc = tl.sum(tl.load(p_ptr + pos.to(tl.int64)[None, :, None] * n + cols[None, None, :],
                             mask=mask[None, :, :], other=0.0), axis=0)
        for s in tl.static_range(1, SPLIT):
            at = (s * P + pos).to(tl.int64)[None, :, None] * n + cols[None, None, :]
            acc += tl.sum(tl.load(p_ptr + at, mask=mask[None, :, :], other=0.0), axis=0)
        return acc
    acc = tl.load(p_ptr + pos.to(tl.int64)[:, None] * n + cols[None, :], mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + (s * P + pos).to(tl.int64)[:, None] * n + cols[None, :], mask=mask, other=0.0)
    return acc


@triton.jit
def _products(p_ptr, sums_ptr, pos, cols, live, P, n, KB, SPLIT: tl.constexpr, MUL1_H: tl.constexpr):
    """The GEMM's products at positions pos: the sum of its K splits, through mul1_affine where they are of
    mul1's h."""
    acc = _split_sum(p_ptr, pos, cols, live[:, None], P, n, SPLIT)
    if MUL1_H:
        acc = mul1_affine(acc, sums_ptr, pos, live, KB)
    return acc


@triton.jit
def linear_epilogue(p_ptr, sums_ptr, svh_ptr, bias_ptr, out_ptr, had_ptr, P, n, n_out, KB, per_slice, stride_out,
                    HAS_BIAS: tl.constexpr, MUL1_H: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr):
    """out[pos, :n_out] = (H_128 sum_split p[:, pos]) * svh (+ bias), in out's dtype (MUL1_H: _products). Positions
    come in slices of per_slice rows (ops.exl3_linear_slices; one slice for a layer): slice s takes svh[s] and
    writes its rows' columns s n .. of out, whose rows are stride_out apart."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    had = load_had(had_ptr)
    live = rows < P
    mask = live[:, None]
    piece = (rows // per_slice)[:, None] * n
    y = rotate_out(_products(p_ptr, sums_ptr, rows, cols, live, P, n, KB, SPLIT, MUL1_H), had,
                   out_ptr.dtype.element_ty)
    y = y * tl.load(svh_ptr + piece + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < n_out, other=0.0).to(tl.float32)[None, :]
    at = (rows % per_slice).to(tl.int64)[:, None] * stride_out + piece + cols[None, :]
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask & (cols < n_out)[None, :])


@triton.jit
def act_epilogue(pg_ptr, pu_ptr, sums_g_ptr, sums_u_ptr, expert_ptr, svh_g_ptr, svh_u_ptr, suh_d_ptr, had_ptr,
                 out_ptr, sums_ptr, P, n, n_real, E, limit, KB, HAS_LIMIT: tl.constexpr, MUL1_H: tl.constexpr,
                 SUMS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr):
    """The middle of a MoE expert, per sorted slot: g, u = H(gate), H(up) scaled by svh (MUL1_H: _products); a =
    SiLU(g) u (SwiGLU-clamped with a limit); out = H(a * suh_down) in out's dtype, the down projection's rotated
    input (SUMS: and its block sums). Both sums of K splits come before the Hadamard matrix is loaded (8 rows
    of 12-16 splits: 138-151 registers a thread, 176 with the matrix loaded first; Triton 3.6, sm_90)."""
    pos = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    e = tl.load(expert_ptr + pos, mask=pos < P, other=E).to(tl.int64)
    live = (pos < P) & (e < E)
    mask = live[:, None]
    g = _products(pg_ptr, sums_g_ptr, pos, cols, live, P, n, KB, SPLIT, MUL1_H)
    u = _products(pu_ptr, sums_u_ptr, pos, cols, live, P, n, KB, SPLIT, MUL1_H)
    had = load_had(had_ptr)
    vec = e[:, None] * n + cols[None, :]
    stored: tl.constexpr = out_ptr.dtype.element_ty
    g = rotate_out(g, had, stored) * tl.load(svh_g_ptr + vec, mask=mask, other=0.0).to(tl.float32)
    u = rotate_out(u, had, stored) * tl.load(svh_u_ptr + vec, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    a = g / (1.0 + tl.exp(-g)) * u
    a = tl.where((cols < n_real)[None, :], a, 0.0)  # padded intermediate columns feed the down projection as 0
    a = a * tl.load(suh_d_ptr + vec, mask=mask, other=0.0).to(tl.float32)
    store_operand(rotate_out(a, had, stored), out_ptr, sums_ptr, pos, live, n, SUMS)


@triton.jit
def combine_epilogue(pd_ptr, sums_ptr, slot_pos_ptr, slot_expert_ptr, weight_ptr, svh_ptr, had_ptr, out_ptr,
                     M, P, n, n_out, KB, TOPK: tl.constexpr, MUL1_H: tl.constexpr, SPLIT: tl.constexpr,
                     BM: tl.constexpr):
    """out[t] = sum over t's slots j, in order, of w[t, j] * H(down products of the slot) * svh_down[e]
    (MUL1_H: _products)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    had = load_had(had_ptr)
    acc = tl.zeros((BM, 128), tl.float32)
    for j in tl.range(TOPK, num_stages=1):  # unrolled, every slot's loads were hoisted and spilled; pipelined, wrong
        slot = rows * TOPK + j
        e = tl.load(slot_expert_ptr + slot, mask=rows < M, other=-1).to(tl.int64)
        live = (rows < M) & (e >= 0)
        pos = tl.load(slot_pos_ptr + slot, mask=live, other=0)
        w = tl.load(weight_ptr + slot, mask=live, other=0.0).to(tl.float32)
        y = rotate_out(_products(pd_ptr, sums_ptr, pos, cols, live, P, n, KB, SPLIT, MUL1_H), had,
                       out_ptr.dtype.element_ty)
        y = y * tl.load(svh_ptr + e[:, None] * n + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        acc += y * w[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < n_out)[None, :])


@triton.jit
def combine_stacked(pd_ptr, sums_ptr, slot_pos_ptr, slot_expert_ptr, weight_ptr, svh_ptr, had_ptr, out_ptr, M, P, n,
                    n_out, KB, TOPK: tl.constexpr, MUL1_H: tl.constexpr, TP: tl.constexpr, SPLIT: tl.constexpr,
                    BT: tl.constexpr):
    """combine_epilogue for a few tokens: BT tokens a program, their slots (TOPK of them, padded to TP, a power of
    two) stacked into the rows of one product, so the call has many small programs instead of a few long ones."""
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    had = load_had(had_ptr)
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]
    j = tl.arange(0, TP)[None, :]
    slot = tokens * TOPK + j
    e = tl.load(slot_expert_ptr + slot, mask=(tokens < M) & (j < TOPK), other=-1).to(tl.int64)
    live = e >= 0
    pos = tl.load(slot_pos_ptr + slot, mask=live, other=0)
    w = tl.load(weight_ptr + slot, mask=live, other=0.0).to(tl.float32)
    x = _products(pd_ptr, sums_ptr, tl.reshape(pos, (BT * TP,)), cols, tl.reshape(live, (BT * TP,)), P, n, KB, SPLIT,
                  MUL1_H)
    y = tl.reshape(rotate_out(x, had, out_ptr.dtype.element_ty), (BT, TP, 128))
    y *= tl.load(svh_ptr + e[:, :, None] * n + cols[None, None, :], mask=live[:, :, None], other=0.0).to(tl.float32)
    out = tl.sum(y * w[:, :, None], axis=1)
    tl.store(out_ptr + tokens.to(tl.int64) * n_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(tokens < M) & (cols < n_out)[None, :])


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


@triton.jit
def _dense_store(acc, p_ptr, chunk_pos_ptr, chunk_len_ptr, pid_c, pid_n, P, n, SPLIT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
    """p[0, pos] = acc for the chunk's live rows and columns, and p[1:, pos] = 0 (the K splits the grouped
    kernels would have written)."""
    pos = (tl.load(chunk_pos_ptr + pid_c) + tl.arange(0, BM)).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (tl.arange(0, BM) < tl.load(chunk_len_ptr + pid_c))[:, None] & (cols < n)[None, :]
    tl.store(p_ptr + pos[:, None] * n + cols[None, :], acc, mask=mask)
    for s in tl.static_range(1, SPLIT):
        tl.store(p_ptr + (s * P + pos)[:, None] * n + cols[None, :], tl.zeros_like(acc), mask=mask)


@triton.jit
def dense_gemm(a_ptr, w_ptr, chunk_pos_ptr, chunk_len_ptr, chunk_slot_ptr, p_ptr, P, k, n, SPLIT: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """p[0, pos] = a[pos] @ w[j] in fp32, and p[1:, pos] = 0, for the rows of one chunk (positions pos0 ..
    pos0+len-1 that share the decoded weights w[j], (k, n) fp16, from decode_weights): a group of hot experts
    in one launch. Chunks vary fastest, so the chunks of one expert read each weight block while it is in L2."""
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    live = tl.arange(0, BM) < tl.load(chunk_len_ptr + pid_c)
    pos = (tl.load(chunk_pos_ptr + pid_c) + tl.arange(0, BM)).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    inside = cols < n  # n is a multiple of 128, BN may not divide it
    kr = tl.arange(0, BK)
    a_off = pos[:, None] * k + kr[None, :]
    w_off = tl.load(chunk_slot_ptr + pid_c).to(tl.int64) * k * n + kr[:, None] * n + cols[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    for step in range(0, k // BK):
        a = tl.load(a_ptr + a_off + step * BK, mask=live[:, None], other=0.0).to(tl.float16)
        acc = tl.dot(a, tl.load(w_ptr + w_off + step * BK * n, mask=inside[None, :], other=0.0), acc)
    _dense_store(acc, p_ptr, chunk_pos_ptr, chunk_len_ptr, pid_c, pid_n, P, n, SPLIT, BM, BN)


@triton.jit
def dense_gemm_tma(a_desc, w_desc, chunk_pos_ptr, chunk_len_ptr, chunk_slot_ptr, p_ptr, P, k, n,
                   SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """dense_gemm with the rows and weights read by tensor descriptors (a (P, k); w (experts * k, n)): on Hopper
    and later the copy engine (TMA) moves the tiles, out-of-range rows and columns read as 0."""
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    pos0 = tl.load(chunk_pos_ptr + pid_c)
    row0 = tl.load(chunk_slot_ptr + pid_c) * k
    acc = tl.zeros((BM, BN), tl.float32)
    for step in range(0, k // BK):
        a = a_desc.load([pos0, step * BK]).to(tl.float16)
        acc = tl.dot(a, w_desc.load([row0 + step * BK, pid_n * BN]), acc)
    _dense_store(acc, p_ptr, chunk_pos_ptr, chunk_len_ptr, pid_c, pid_n, P, n, SPLIT, BM, BN)
