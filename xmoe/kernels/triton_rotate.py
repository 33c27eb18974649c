"""The 128-wide Hadamard rotations around the grouped GEMMs: the prologue that rotates each slot's input row by its
expert's suh (rotate_rows; with the routing, route_rotate), and the helpers the epilogues share: H_128 on fp32 rows
and the store of a rotated block as the next GEMM reads it."""
import triton
import triton.language as tl

from .triton_route import route_small, slot_ranks


@triton.jit
def load_had(had_ptr):
    """The (128, 128) ±1 Sylvester matrix, fp16 (exact; the 1/sqrt(128) is applied in fp32)."""
    return tl.load(had_ptr + tl.arange(0, 128)[:, None] * 128 + tl.arange(0, 128)[None, :])


@triton.jit
def rotate_out(acc, had, STORED: tl.constexpr):
    """H_128 acc for fp32 acc (BM, 128), whose result (or what it feeds) is stored as STORED: for fp32, two fp16
    MMAs on the high and low halves keep ~fp32 accuracy; else one, as rounding acc to fp16 before the orthogonal H
    errs about as much as rounding the stored result after it (docs/kernels.md)."""
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
