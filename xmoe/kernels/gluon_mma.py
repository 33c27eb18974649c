"""The decode-size grouped EXL3 GEMM on tensor cores without shared memory, in Gluon (sm_80+).

The format gives lane L of a warp the eight weights at trellis positions 8L..8L+7 of each 16x16 tile, which are
the registers of an mma.sync fragment. Written in Gluon, where layouts are explicit, each lane decodes exactly
those weights into the registers of the MMA's A operand (the weights as W^T, the rows as B), so nothing passes
through shared memory. Each weight enters the MMA as its codebook word's two fp16 halves on two K rows, against
the activation doubled, so the tensor cores add the halves: per weight only the state's extraction (two shifts,
or one byte permute) and the codebook's IMAD and LOP3 remain, shared between the integer and FMA pipes. A chunk
carries up to ROWS rows of one expert (the MMA's N), each decoded weight serving all of them; mul1 enters as
its byte-sum word h beside a zero, the codebook's fp16 FMA left to the epilogue (codewords). 3INST, MCG and
mul1 at K = 1, 2, 3, 4, mul1 at 1.5, 2.5, 3.5 (W = 8 K words a tile, bits a lane); K > 4 takes triton_gemv or
triton_gemm. decode_weights decodes the same way for the dense path (experts with many rows, decoded once to
fp16).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .triton_codebook import HALVES_XOR, INST3_ADD, INST3_MULT, MCG_MULT, MUL1_H_PTX, MUL1_MULT

# tile_layout's axes in (row, column) order: kt, j, t, r0 (input row 16 kt + 8 j + 2 t + r0), then nt, c3, g
TILE_ORDER = gl.constexpr((3, 4, 6, 5, 0, 1, 2))


@gluon.constexpr_function
def tile_layout(TN, TK, warps):
    """Decoded weights as (nt, c3, g, kt, j, r0, t): output column 16 nt + 8 c3 + g, MMA slot 16 kt + 8 j + 4 r0 + t
    (input row 16 kt + 8 j + 2 t + r0), so lane 4 g + t holds the 8 weights (c3, j, r0) of its trellis positions
    and, reshaped to (BN, BK) and paired with halves, the layout is the mma.sync A operand's (warps along N)."""
    return gl.BlockedLayout([1, 2, 1, TK, 2, 2, 1], [1, 1, 8, 1, 1, 1, 4], [warps, 1, 1, 1, 1, 1, 1],
                            [1, 5, 4, 3, 6, 2, 0])


@gluon.constexpr_function
def act_layout(BK, warps):
    """Activations as (J, t, r0, m): input row 8 J + 2 t + r0 of row m of the chunk, every warp a copy (the warps
    lie along t, which the lanes already cover), row m in lane m % 8 (the MMA's n tiles, repeated); permuted to
    slot order (J, r0, t, m) and doubled, the mma.sync B operand's layout."""
    return gl.BlockedLayout([BK // 8, 1, 2, 1], [1, 4, 1, 8], [1, warps, 1, 1], [2, 0, 1, 3])


@gluon.constexpr_function
def along(layout, rank, dim):
    """The 1-D layout of `layout`'s axis `dim`: every other axis sliced off."""
    for d in reversed(range(rank)):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.jit
def axis(size: gl.constexpr, dim: gl.constexpr, rank: gl.constexpr, layout: gl.constexpr):
    """0..size-1 along axis `dim` of a rank-`rank` tensor of `layout`, size 1 on the other axes."""
    x = gl.arange(0, size, layout=along(layout, rank, dim))
    for d in gl.static_range(rank):
        if d != dim:
            x = gl.expand_dims(x, d)
    return x


@gluon.jit
def funnel(lo, hi, shift):
    """The low 32 bits of hi:lo >> shift (0..31), in one instruction."""
    return gl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, shift],
                                     dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def from_lane(x, src):
    """Each lane's x from lane `src` of its warp (every lane takes part)."""
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r", [x, src],
                                     dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def byte_pair(x, sel):
    """Two bytes of x, picked by `sel` (0x4410: bytes 0-1, 0x4421: bytes 1-2), zero above, in one instruction."""
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, $2;", "=r,r,r", [x, sel], dtype=gl.uint32, is_pure=True,
                                     pack=1)


@gluon.jit
def half(x, TOP: gl.constexpr):
    """x's top (TOP) or bottom 16 bits, zero-extended, by dp2a: an IDP on the FMA pipe, which takes it at IMAD's
    rate, where a PRMT, shift or AND would take the integer pipe."""
    if TOP:
        return gl.inline_asm_elementwise("dp2a.lo.u32.u32 $0, $1, 256, 0;", "=r,r", [x], dtype=gl.uint32,
                                         is_pure=True, pack=1)
    return gl.inline_asm_elementwise("dp2a.lo.u32.u32 $0, $1, 1, 0;", "=r,r", [x], dtype=gl.uint32, is_pure=True,
                                     pack=1)


@gluon.jit
def lane_states(lo, src, shift, lane, t, q, W: gl.constexpr, IDP: gl.constexpr):
    """The 16-bit states of each lane's 8 weights q (positions 8 lane + q, W = 8 K bits a lane) from its word lo
    and the word before it (lane src's). At K = 1, 2, 4 all 8 end in lo. At K = 2 they lie in one 30-bit window
    (hi:lo >> 16 for even lanes, lo for odd ones), state q ending 14 - 2 q bits up. Shifted up by 2, 4 or 6 bits
    (three IMAD.SHL: the FMA pipe, as the integer pipe carries the PRMTs and the codebook's LOP3), or not at all,
    every state starts on a byte: one PRMT each.
    Other K (1.5, 2.5, 3, 3.5) span up to 41 bits: q < 4 lie in the 32 bits ending where state 3 ends, q >= 4 in
    the 32 ending where state 7 does, each window one funnel shift of lo and the word before, or of the word after
    (another lane's, where the second window ends a word later) and lo; each state a constant shift of its window.
    IDP: a bit mask of the states q that sit in a top or bottom half and are taken from it by dp2a (`half`)
    rather than by the integer pipe, to balance the two pipes (Tuning.mma_idp)."""
    idp = ((IDP >> q) & 1) == 1
    hi = from_lane(lo, src)
    if W != 8 and W != 16 and W != 32:
        KA: gl.constexpr = W // 8  # K rounded down; half-integer K (W % 8 = 4): odd positions add a bit more
        H: gl.constexpr = W % 8 // 4
        first = (W * lane + 4 * KA + 2 * H - 1) // 32  # the word lo: where state 3 ends
        second = (W * lane + W - 1) // 32  # where state 7 ends, lo's word or the next
        later = from_lane(lo, (32 * second + W - 4 * KA - 2 * H) // W)
        window = funnel(gl.where(q < 4, lo, later), gl.where((q < 4) | (second == first), hi, lo), shift)
        up = (3 - q % 4) * KA + H * (2 - (q % 4 + 1) // 2)  # bits from state q's end to its window's
        top = gl.inline_asm_elementwise("mul.lo.u32 $0, $1, $2;", "=r,r,r", [window, (65536 >> up).to(gl.uint32)],
                                        dtype=gl.uint32, is_pure=True, pack=1)  # << 16 - up, as a multiply
        return gl.where(q % 4 == 3, gl.where(idp, half(window, False), window & 0xFFFF),
                        gl.where(idp, half(top, True), top >> 16))
    if W == 16:
        window = funnel(lo, hi, (16 - 16 * (t & 1)).to(gl.uint32))
        up = 2 * ((q + 1) % 4)  # state q moved up to bit 16 (q < 3), 8 (q < 7) or left at 0: 2, 4, 6 or 0 bits
        moved = gl.inline_asm_elementwise("mul.lo.u32 $0, $1, $2;", "=r,r,r", [window, (1 << up).to(gl.uint32)],
                                          dtype=gl.uint32, is_pure=True, pack=1)
        picked = byte_pair(moved, gl.where(q < 3, 0x4432, gl.where(q < 7, 0x4421, 0x4410)).to(gl.uint32))
        return gl.where(idp & (q < 3), half(moved, True), gl.where(idp & (q == 7), half(moved, False), picked))
    window = funnel(lo, hi, shift)
    return gl.where(idp, half(window, False), window & 0xFFFF)


@gluon.jit
def lane_words(lane, q, W: gl.constexpr):
    """The word each lane loads (the one its states end in; for K other than 1, 2, 4 the one its first window
    ends in), the shifts of its states (of their windows) and a lane that loads the word before. Format: the state
    of position p ends at stream bit S(p), the bits positions 0..p add: K each, or at half-integer K one more at
    odd positions."""
    if W != 8 and W != 16 and W != 32:
        KA: gl.constexpr = W // 8
        H: gl.constexpr = W % 8 // 4
        FIRST: gl.constexpr = 4 * KA + 2 * H  # state 3's end, past the lane's first bit; state 7's is W
        word = (W * lane + FIRST - 1) // 32
        end = W * lane + FIRST + (W - FIRST) * (q // 4)
        shift = 32 * ((end - 1) // 32 + 1) - end
        src = (32 * ((word + W - 1) % W) + W - FIRST) // W  # the first lane whose word is j: (32 j + W - FIRST) // W
    else:  # K = 1, 2, 4: all 8 states of a lane end in one word
        word = (W * lane) // 32
        shift = 32 * (word + 1) - W * lane - W // 8 * (q + 1)
        src = (lane + 32 - 32 // W) % 32
    return word, shift.to(gl.uint32), src


@gluon.jit
def codewords(state, mask, CB: gl.constexpr, MUL1_H: gl.constexpr):
    """Each state's codebook word, a pair of fp16 halves whose sum is its weight: for 3INST (CB 0) and MCG (CB 1)
    the format's halves; for mul1 (CB 2) the weight itself and a zero, by the format's arithmetic: dp4a gives the
    fp16 bits of h = 1024 + the product's byte sum, one fp16 FMA (k_inv 0x1EEE, k_bias 0xC931) the weight. With
    MUL1_H, mul1's word is h and a zero: the weight is h k_inv + k_bias, which the epilogue applies to the
    products (triton_epilogues.mul1_affine)."""
    if CB == 2:
        if MUL1_H:
            return gl.inline_asm_elementwise(MUL1_H_PTX, "=r,r", [state * MUL1_MULT], dtype=gl.uint32, is_pure=True,
                                             pack=1)
        return gl.inline_asm_elementwise(
            "{ .reg .b32 m, z, h, k, c; mov.b32 m, 0x01010101; mov.b32 z, 0x6400; dp4a.u32.u32 h, $1, m, z; "
            "mov.b32 k, 0x1EEE1EEE; mov.b32 c, 0x0000C931; fma.rn.f16x2 $0, h, k, c; }", "=r,r",
            [state * MUL1_MULT], dtype=gl.uint32, is_pure=True, pack=1)
    if CB == 0:
        x = state * INST3_MULT + INST3_ADD
    else:
        x = state * MCG_MULT
    return (x & mask) ^ HALVES_XOR


@gluon.jit
def decode_operand(state, mask, CB: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, A: gl.constexpr):
    """The (BN, 2 BK) fp16 A operand of a block from its states: each weight's codebook word split in halves."""
    low, high = halves(gl.reshape(codewords(state, mask, CB, True), [BN, BK]))
    return gl.convert_layout(gl.reshape(gl.join(low, high), [BN, 2 * BK]), A, assert_trivial=True)


@gluon.jit
def halves(x):
    """uint32 words as their (low, high) fp16 halves."""
    return ((x & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True),
            (x >> 16).to(gl.uint16).to(gl.float16, bitcast=True))


@gluon.jit
def act_operand(x, BK: gl.constexpr, ROWS: gl.constexpr, B: gl.constexpr):
    """The (2 BK, ROWS) B operand from (BK/8, 4, 2, ROWS) doubled activations (int32: an fp16 value in both
    halves): slot order, each value on two K rows."""
    low, high = halves(gl.reshape(gl.permute(x, [0, 2, 1, 3]), [BK, ROWS]).to(gl.uint32, bitcast=True))
    x = gl.reshape(gl.permute(gl.join(low, high), [0, 2, 1]), [2 * BK, ROWS])
    return gl.convert_layout(x, B, assert_trivial=True)


@gluon.jit
def load_words(words, step, stride_step, lo_off):
    """One K step's trellis words (the one each lane's states end in)."""
    return gl.load(words + step * stride_step + lo_off).to(gl.uint32, bitcast=True)


@gluon.jit
def load_both(w0, w1, a0_ptr, a1_ptr, step, stride_step, lo_off, a_off, BK: gl.constexpr, DUAL: gl.constexpr,
              PAIR: gl.constexpr):
    """One K step's words and activations (the chunk's rows, its last row again in the MMA's rows past its
    length, which are never stored) for the first projection and, with DUAL, the second (PAIR: its words only, the
    rows are the first's)."""
    lo0 = load_words(w0, step, stride_step, lo_off)
    x0 = gl.load(a0_ptr + a_off + step * BK)
    lo1, x1 = lo0, x0
    if DUAL:
        lo1 = load_words(w1, step, stride_step, lo_off)
        if not PAIR:
            x1 = gl.load(a1_ptr + a_off + step * BK)
    return lo0, x0, lo1, x1


@gluon.jit
def products(lo0, x0, lo1, x1, acc0, acc1, src, shift, lane, t, q, mask, W: gl.constexpr, CB: gl.constexpr,
             BN: gl.constexpr, BK: gl.constexpr, ROWS: gl.constexpr, DUAL: gl.constexpr, A: gl.constexpr,
             B: gl.constexpr, PAIR: gl.constexpr, IDP: gl.constexpr):
    """One K step: the words decoded into the A operand, multiplied by the rows, added to the accumulators
    (PAIR: both projections by the same rows)."""
    w = decode_operand(lane_states(lo0, src, shift, lane, t, q, W, IDP), mask, CB, BN, BK, A)
    rows = act_operand(x0, BK, ROWS, B)
    acc0 = mma_v2(w, rows, acc0)
    if DUAL:
        w = decode_operand(lane_states(lo1, src, shift, lane, t, q, W, IDP), mask, CB, BN, BK, A)
        if not PAIR:
            rows = act_operand(x1, BK, ROWS, B)
        acc1 = mma_v2(w, rows, acc1)
    return acc0, acc1


@gluon.jit
def grouped_mma(a0_ptr, a1_ptr, chunk_pos_ptr, chunk_len_ptr, chunk_expert_ptr, n_chunks_ptr, t0_ptr, t1_ptr,
                p0_ptr, p1_ptr, P, k, n: gl.constexpr, stride_te, mask, W: gl.constexpr, CB: gl.constexpr,
                DUAL: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, SPLIT: gl.constexpr, ROWS: gl.constexpr,
                UNROLL: gl.constexpr, PAIR: gl.constexpr, IDP: gl.constexpr):
    """grouped_gemv's contract (rotated rows as doubled fp16, triton_rotate.as_operand; chunks of up to ROWS
    rows, a multiple of 8: the MMA's N; fp32 partials per K split) on mma.sync. In each (chunk, column block,
    K split) program, warp w takes the 16 columns from 16 w of every 16 * warps. n is a constexpr, so the tiles'
    offsets within a K step are the loads' immediates (one address a projection and step, not one a row of tiles).
    UNROLL: K steps a loop iteration (1 or 2). PAIR: one projection, each program taking two column blocks, pid_n's
    and the one n / 2 columns on, as DUAL takes gate and up: two streams of decoding to interleave, one set of
    rows (grid axis 1: n / 2 BN blocks)."""
    warps: gl.constexpr = gl.num_warps()
    TN: gl.constexpr = BN // 16
    TK: gl.constexpr = BK // 16
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    TILE: gl.constexpr = tile_layout(TN, TK, warps)
    ACT: gl.constexpr = act_layout(BK, warps)
    pid_c = gl.program_id(0)
    if pid_c >= gl.load(n_chunks_ptr):
        return
    pid_n = gl.program_id(1)
    pid_s = gl.program_id(2)
    length = gl.load(chunk_len_ptr + pid_c)
    pos = gl.load(chunk_pos_ptr + pid_c).to(gl.int64)
    e = gl.load(chunk_expert_ptr + pid_c).to(gl.int64)
    w0 = t0_ptr + e * stride_te
    w1 = t1_ptr + e * stride_te
    p1 = p1_ptr
    if PAIR:
        w1 = w0 + (n // 32) * W  # (n / 2) / 16 tiles of W words on
        p1 = p0_ptr + n // 2
    TWO: gl.constexpr = DUAL or PAIR

    # each lane's words and shifts
    t = axis(4, 6, 7, TILE)
    lane = 4 * axis(8, 2, 7, TILE) + t
    q = 4 * axis(2, 1, 7, TILE) + 2 * axis(2, 4, 7, TILE) + axis(2, 5, 7, TILE)
    word, shift, src = lane_words(lane, q, W)
    tile = axis(TK, 3, 7, TILE) * ((n // 16) * W) + (pid_n * TN + axis(TN, 0, 7, TILE)) * W
    lo_off = tile + word

    # the MMA's rows past the chunk's length read its last row: the lanes of a load then share its addresses, so
    # a one-row chunk takes one L1 sector a load where eight rows took eight
    rows = gl.minimum(axis(ROWS, 3, 4, ACT), length - 1)
    a_off = (pos + rows) * k + 8 * axis(BK // 8, 0, 4, ACT) + 2 * axis(4, 1, 4, ACT) + axis(2, 2, 4, ACT)
    steps = k // BK
    per = gl.cdiv(steps, SPLIT)
    first = pid_s * per
    last = gl.minimum(steps, first + per)
    stride_step = TK * (n // 16) * W
    acc0 = gl.zeros([BN, ROWS], gl.float32, MMA)
    acc1 = gl.zeros([BN, ROWS], gl.float32, MMA)
    # the next step's words and rows are loaded before a step is decoded; UNROLL = 2: two steps an iteration, each
    # buffer used in turn, so no copies between iterations, and an odd count's last step after the loop, from the
    # buffer the last prefetch filled (taken first, it cost more than its share: docs/kernels.md, mma_unroll)
    lo0, x0, lo1, x1 = load_both(w0, w1, a0_ptr, a1_ptr, first, stride_step, lo_off, a_off, BK, TWO, PAIR)
    if UNROLL == 1:
        for step in range(first, last):
            n_lo0, n_x0, n_lo1, n_x1 = load_both(w0, w1, a0_ptr, a1_ptr, gl.minimum(step + 1, last - 1),
                                                 stride_step, lo_off, a_off, BK, TWO, PAIR)
            acc0, acc1 = products(lo0, x0, lo1, x1, acc0, acc1, src, shift, lane, t, q, mask, W, CB, BN, BK, ROWS,
                                  TWO, A, B, PAIR, IDP)
            lo0, x0, lo1, x1 = n_lo0, n_x0, n_lo1, n_x1
    else:
        for step in range(first, last - 1, 2):
            n_lo0, n_x0, n_lo1, n_x1 = load_both(w0, w1, a0_ptr, a1_ptr, step + 1, stride_step, lo_off, a_off, BK,
                                                 TWO, PAIR)
            acc0, acc1 = products(lo0, x0, lo1, x1, acc0, acc1, src, shift, lane, t, q, mask, W, CB, BN, BK, ROWS,
                                  TWO, A, B, PAIR, IDP)
            lo0, x0, lo1, x1 = load_both(w0, w1, a0_ptr, a1_ptr, gl.minimum(step + 2, last - 1), stride_step,
                                         lo_off, a_off, BK, TWO, PAIR)
            acc0, acc1 = products(n_lo0, n_x0, n_lo1, n_x1, acc0, acc1, src, shift, lane, t, q, mask, W, CB, BN, BK,
                                  ROWS, TWO, A, B, PAIR, IDP)
        if (last - first) % 2 == 1:
            acc0, acc1 = products(lo0, x0, lo1, x1, acc0, acc1, src, shift, lane, t, q, mask, W, CB, BN, BK, ROWS,
                                  TWO, A, B, PAIR, IDP)

    cols = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, MMA)), 1)
    out_rows = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA)), 0)
    out = (pid_s * P + pos + out_rows) * n + pid_n * BN + cols
    out_mask = out_rows < length
    gl.store(p0_ptr + out, acc0, mask=out_mask)
    if TWO:
        gl.store(p1 + out, acc1, mask=out_mask)


@gluon.jit
def decode_weights(t_ptr, expert_ptr, out_ptr, k, n, stride_te, mask, W: gl.constexpr, CB: gl.constexpr,
                   BN: gl.constexpr, BK: gl.constexpr, STEPS: gl.constexpr, MUL1_H: gl.constexpr):
    """triton_gemm.decode_weights for grouped_mma's cases: out[i] = W-hat of expert expert[i] (program axis 2) as
    (k, n) fp16, STEPS blocks of (BK, BN) a program, each lane decoding its 8 weights of a tile as grouped_mma
    does (a weight: the sum of its codebook word's halves, in fp16 as the format has it; MUL1_H: mul1's h),
    stored through shared memory as rows of 16 bytes a thread (2-byte stores from the lanes' registers were
    slower: docs/kernels.md)."""
    warps: gl.constexpr = gl.num_warps()
    TN: gl.constexpr = BN // 16
    TK: gl.constexpr = BK // 16
    TILE: gl.constexpr = tile_layout(TN, TK, warps)
    ROWS: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [warps, 1], [1, 0])  # 16-byte stores
    e = gl.load(expert_ptr + gl.program_id(2)).to(gl.int64)
    t = axis(4, 6, 7, TILE)
    lane = 4 * axis(8, 2, 7, TILE) + t
    q = 4 * axis(2, 1, 7, TILE) + 2 * axis(2, 4, 7, TILE) + axis(2, 5, 7, TILE)
    word, shift, src = lane_words(lane, q, W)
    lo_off = axis(TK, 3, 7, TILE) * ((n // 16) * W) + (gl.program_id(1) * TN + axis(TN, 0, 7, TILE)) * W + word
    rows = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(1, ROWS)), 1)
    cols = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, ROWS)), 0)
    out = out_ptr + gl.program_id(2).to(gl.int64) * k * n + rows * n + gl.program_id(1) * BN + cols
    stride_step = TK * (n // 16) * W
    first = gl.program_id(0) * STEPS
    for step in range(first, gl.minimum(k // BK, first + STEPS)):
        lo = gl.load(t_ptr + e * stride_te + step * stride_step + lo_off).to(gl.uint32, bitcast=True)
        low, high = halves(codewords(lane_states(lo, src, shift, lane, t, q, W, 0), mask, CB, MUL1_H))
        w = gl.reshape(gl.permute(low + high, TILE_ORDER.value), [BK, BN])
        gl.store(out + step * BK * n, gl.convert_layout(w, ROWS))
