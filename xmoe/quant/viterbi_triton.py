"""The tail-biting Viterbi of viterbi.py as one Triton kernel: one program per tile, integer K.

Costs are kept per node (the low 16 - K bits of a state, all its successor sees of it): after position q
the cost of node n is the min over the K high bits k of err(k|n, w_q) + the cost of node (k|n) >> K.
Each thread holds runs of 2^LG consecutive nodes, which share that predecessor for every k: one load
feeds them all and the min over k stays in registers, so a candidate costs its codebook value (evaluated,
or read from a table), a squared error and a compare. Costs (fp32) ping-pong through a small per-tile
scratch that stays in L2; backpointers are one byte per (step, node).
"""
import torch
import triton
import triton.language as tl

from ..format.codebook import CODEBOOKS, codebook_table
from ..kernels.triton_codebook import codebook_fp16
from .viterbi_half import check_tiles, viterbi_half_triton

# Launch settings per K: (nodes per chunk, warps, codebook from a table), swept on an H200 (docs/RESULTS.md).
TUNED = {2: (1024, 8, False), 3: (1024, 8, True), 4: (1024, 8, True)}
DEFAULT = (2048, 8, False)
HALF = (2, 3, 4)  # K where viterbi_half's kernels are the default


@triton.jit
def _forward(tile, cost, bp, table, first_q, n_steps, bp_from, K: tl.constexpr, CB: tl.constexpr, EB: tl.constexpr,
             TABLE: tl.constexpr):
    """Steps q = first_q .. first_q+n_steps-1 over positions q % 256; costs start in slot 0."""
    NODES: tl.constexpr = 1 << (16 - K)
    ROWS: tl.constexpr = NODES >> K
    LG: tl.constexpr = 2 if K >= 2 else 1  # 2^LG consecutive nodes per thread share one predecessor load
    eo = tl.arange(0, EB)
    row = tl.arange(0, EB >> LG) >> (K - LG)  # predecessor offset of each group of 2^LG nodes
    for i in range(n_steps):
        w = tl.load(tile + (first_q + i) % 256)
        src = cost + (i % 2) * NODES
        dst = cost + ((i + 1) % 2) * NODES
        for e0 in range(0, NODES, EB):
            first = tl.multiple_of(e0, EB)  # lets the loads and stores below be vectorized
            node = first + eo
            best = tl.full([EB], float("inf"), tl.float32)
            arg = tl.zeros([EB], tl.int32)
            for k in range(1 << K):
                s = (k << (16 - K)) + node
                if TABLE:
                    v = tl.load(table + s)
                else:
                    v = codebook_fp16(s.to(tl.uint32), CB).to(tl.float32)
                # nodes that differ only in their low K bits share the predecessor: one load per
                # 2^LG of them, repeated in registers
                prev = tl.load(src + k * ROWS + (first >> K) + row)
                for _ in tl.static_range(LG):
                    prev = tl.interleave(prev, prev)
                c = (v - w) * (v - w) + prev
                better = c < best  # strict: ties keep the lowest k, as torch's min does
                best = tl.where(better, c, best)
                arg = tl.where(better, k, arg)
            tl.store(dst + node, best)
            if i >= bp_from:
                tl.store(bp + (i - bp_from) * NODES + node, arg.to(tl.uint8))
        tl.debug_barrier()


@triton.jit
def _viterbi_kernel(tiles_ptr, states_ptr, cost_ptr, bp_ptr, table, K: tl.constexpr, CB: tl.constexpr,
                    WARMUP: tl.constexpr, EB: tl.constexpr, TABLE: tl.constexpr):
    """One program per tile: pass 1 (free start, traced to the node of s_255), pass 2 (closed), traceback."""
    NODES: tl.constexpr = 1 << (16 - K)
    t = tl.program_id(0).to(tl.int64)
    tile = tiles_ptr + t * 256
    cost = cost_ptr + t * 2 * NODES
    bp = bp_ptr + t * 256 * NODES
    eo = tl.arange(0, EB)
    inf = float("inf")

    # Pass 1: free start WARMUP positions before the wrap; traced back to the node of s_255.
    for e0 in range(0, NODES, EB):
        tl.store(cost + e0 + eo, tl.zeros([EB], tl.float32))
    tl.debug_barrier()
    _forward(tile, cost, bp, table, 256 - WARMUP, 2 * WARMUP, WARMUP, K, CB, EB, TABLE)
    best_v = tl.full([EB], inf, tl.float32)
    best_i = tl.zeros([EB], tl.int32)
    for e0 in range(0, NODES, EB):  # 2*WARMUP steps is even: final costs are in slot 0
        v = tl.load(cost + e0 + eo)
        better = v < best_v
        best_v = tl.where(better, v, best_v)
        best_i = tl.where(better, e0 + eo, best_i)
    e = tl.min(tl.where(best_v == tl.min(best_v, axis=0), best_i, NODES), axis=0)
    for i in range(WARMUP):
        s = (tl.load(bp + (WARMUP - 1 - i) * NODES + e).to(tl.int32) << (16 - K)) | e
        e = s >> K
    tl.debug_barrier()

    # Pass 2: positions 0..255, starting and ending on node e so that the path closes.
    for e0 in range(0, NODES, EB):
        tl.store(cost + e0 + eo, tl.where(e0 + eo == e, 0.0, inf))
    tl.debug_barrier()
    _forward(tile, cost, bp, table, 0, 256, 0, K, CB, EB, TABLE)
    for i in range(256):
        q = 255 - i
        s = (tl.load(bp + q * NODES + e).to(tl.int32) << (16 - K)) | e
        tl.store(states_ptr + t * 256 + q, s)
        e = s >> K


def viterbi_triton(tiles: torch.Tensor, K: int, codebook: str, warmup: int = 128,
                   scratch_bytes: int = 4 << 30, nodes: int | None = None, num_warps: int | None = None,
                   table: bool | None = None, half: bool | None = None) -> torch.Tensor:
    """tiles: float32 (T, 256) -> int64 states (T, 256); same algorithm as viterbi.viterbi_torch.

    `half` (the default at K in HALF) runs viterbi_half's kernels instead: fp16 costs in pairs, the codebook
    in registers (2.0-2.5x exllamav3's encoder on an H200). Otherwise programs take `nodes` nodes per chunk (a
    power of two; four or more per thread keeps every load and store in the thread's own layout, no shuffle
    through shared memory); tiles run in waves whose backpointers fit in `scratch_bytes` (256 bytes per node
    per tile). With `table` the codebook is read from a 256 KB fp32 table instead of evaluated in registers.
    Unset settings come from TUNED."""
    if not float(K).is_integer() or not 1 <= K <= 8:
        raise ValueError(f"the Triton Viterbi handles integer K 1..8, not {K}")
    check_tiles(tiles, warmup)
    K = int(K)
    if half is None:
        half = K in HALF
    if half:
        return viterbi_half_triton(tiles, K, codebook, warmup, scratch_bytes)
    tuned = TUNED.get(K, DEFAULT)
    nodes, num_warps, table = (tuned[i] if v is None else v for i, v in enumerate((nodes, num_warps, table)))
    all_nodes = 1 << (16 - K)
    eb = min(max(1 << K, 4, nodes), all_nodes)  # a chunk holds whole rows of 2^K nodes
    tiles = tiles.contiguous()
    states = torch.empty(tiles.shape, dtype=torch.int32, device=tiles.device)
    wave = max(1, scratch_bytes // ((256 + 8) * all_nodes))
    values = codebook_table(codebook, tiles.device).float()
    for a in range(0, tiles.shape[0], wave):
        b = min(a + wave, tiles.shape[0])
        cost = torch.empty((b - a, 2, all_nodes), dtype=torch.float32, device=tiles.device)
        bp = torch.empty((b - a, 256, all_nodes), dtype=torch.uint8, device=tiles.device)
        _viterbi_kernel[(b - a,)](tiles[a:b], states[a:b], cost, bp, values, K=K, CB=CODEBOOKS.index(codebook),
                                  WARMUP=warmup, EB=eb, TABLE=table, num_warps=num_warps)
    return states.to(torch.int64)
