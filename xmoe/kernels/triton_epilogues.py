"""The epilogues of the grouped GEMMs: each sums a projection's K-split partials in a fixed order, applies mul1's
codebook FMA where the GEMM left it out, rotates by H_128 and scales by svh; then a dense layer adds its bias
(linear_epilogue), a MoE's gate and up make the down projection's rotated input (act_epilogue), and its down
projection's slots are summed per token by their routing weights (combine_epilogue, combine_stacked)."""
import triton
import triton.language as tl

from .triton_codebook import MUL1_K_BIAS, MUL1_K_INV
from .triton_rotate import load_had, rotate_out, store_operand


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
def _split_sum(p_ptr, pos, cols, mask, P, n, SPLIT: tl.constexpr):
    """sum over the K splits s of p[s, pos, cols], (BM, 128) for BM positions. Up to 16 rows each split is
    loaded as (1, BM, 128) and summed over that unit axis, which keeps the adds in the loads' layout: loaded as
    (BM, 128), every split went into the MMA operand's layout through shared memory (docs/kernels.md). Prefill's
    64 rows, mostly one split, load them plainly: there the unit axis held more registers."""
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
    come in slices of per_slice rows (exl3_linear_slices; one slice for a layer): slice s takes svh[s] and
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
    input (SUMS: and its block sums). Both sums of K splits come before the Hadamard matrix is loaded, which
    takes fewer registers (docs/kernels.md)."""
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
