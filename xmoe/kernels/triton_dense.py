"""The dense path's GEMM: experts with many rows in a call, decoded once to fp16 (decode_weights), multiplied by a
plain tiled GEMM per group of experts, into the partials the epilogues read."""
import triton
import triton.language as tl


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
