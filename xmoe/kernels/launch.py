"""Launchers: thin wrappers that allocate a kernel's buffers, compute its grid and launch it as a plan says. The
Triton kernels are imported where they launch, so that the torch backend runs without Triton."""
from functools import lru_cache

import torch

from ..format.codebook import HALVES_MASK
from ..format.hadamard import hadamard_128
from ..format.trellis import state_windows
from .plan import Launch, is_tiled, wide_mma
from .routing import small_route
from .tuning import Tuning
from .weights import Exl3Weight

CODEBOOK_ID = {"3inst": 0, "mcg": 1, "mul1": 2}
MASK = HALVES_MASK - (1 << 32)  # the codebooks' mask as an int32 argument (read from the constant bank)
_ROW_CHUNKS: dict = {}


@lru_cache(maxsize=None)
def had(device: str) -> torch.Tensor:
    """H_128 as exact ±1 fp16 (the 1/sqrt(128) is applied in fp32)."""
    return (hadamard_128() * 128 ** 0.5).round().to(device=device, dtype=torch.float16)


@lru_cache(maxsize=None)
def windows(K: float, device: str) -> torch.Tensor:
    return state_windows(K).to(device)


def eager_tables(weights: tuple, device: torch.device) -> None:
    """Makes the tables that the gather decoder reads (windows) outside any CUDA-graph capture: a capture may take
    that path where the eager calls before it did not (inside graphs there is no dense path), and a host table
    cannot be copied to the GPU while a capture runs."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    for w in weights:
        windows(w.K, str(device))


def padded_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    if x.shape[-1] < k:
        x = torch.nn.functional.pad(x, (0, k - x.shape[-1]))
    return x if x.stride(-1) == 1 else x.contiguous()


def row_chunks(M: int, BM: int, device: torch.device, slices: int = 1) -> tuple:
    """A dense layer's routing: its M rows in chunks of BM, all on "expert" 0, or for `slices` slices
    (exl3_linear_slices) each slice's copy of the rows (positions s M ..) on expert s; (chunks, rows, experts) as
    gemm and rotate take them. Kept per shape, since building them is six small kernels, more than the layer's
    own at one row; not kept when made inside a CUDA-graph capture, where they are filled only when the graph
    runs."""
    key = (M, BM, slices, str(device))
    if key in _ROW_CHUNKS:
        return _ROW_CHUNKS[key]
    starts = torch.arange(0, M, BM, device=device, dtype=torch.int32)
    pos = (torch.arange(slices, device=device, dtype=torch.int32)[:, None] * M + starts).reshape(-1)
    length = (M - starts).clamp(max=BM).repeat(slices)
    expert = torch.arange(slices, device=device, dtype=torch.int32).repeat_interleave(len(starts))
    count = torch.full((1,), len(pos), device=device, dtype=torch.int32)
    rows = torch.arange(M, device=device, dtype=torch.int32).repeat(slices)
    at = torch.arange(slices, device=device, dtype=torch.int32).repeat_interleave(M)  # an int: no sync in captures
    made = (pos, length, expert, count, len(pos)), rows, at
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        if len(_ROW_CHUNKS) >= 256:
            _ROW_CHUNKS.clear()
        _ROW_CHUNKS[key] = made
    return made


def mul1_h(w: Exl3Weight) -> bool:
    """Whether w's products come from the GEMM kernels as sums of mul1's h, the value before the codebook's fp16
    FMA, which the epilogues apply (triton_epilogues.mul1_affine): at mul1 all of them leave it out (in
    grouped_mma a sixth of the instructions a weight, in the tensor-core decoders a byte sum of seven and a
    conversion)."""
    return w.codebook == "mul1"


def act_buffer(P: int, cols: int, launch: Launch, device: torch.device) -> torch.Tensor:
    """(P, cols) activations for the launch's GEMM: fp16 for tensor cores, fp32 for grouped_gemv (no conversion in
    its inner loop), int32 for grouped_mma (fp16 doubled, each value already the pair of K rows its MMA reads; it
    reads no row past a chunk's last, its MMA's spare rows reading that row again)."""
    dtype = torch.float32 if launch.gemv else torch.int32 if launch.mma else torch.float16
    return torch.empty(P, cols, device=device, dtype=dtype)


def sums(P: int, cols: int, w: Exl3Weight, device: torch.device) -> torch.Tensor:
    """The block sums of (P, cols) activations that mul1's epilogues read (fp32, one per row and 128 columns);
    one unread element where none are needed."""
    return torch.empty((P, cols // 128) if mul1_h(w) else (1,), device=device, dtype=torch.float32)


def _rotation_buffers(P: int, w: Exl3Weight, second: Exl3Weight | None, launch: Launch,
                      device: torch.device) -> tuple:
    """The rotation's outputs (a0, a1, s0, s1): w's rotated rows and, with `second`, its own; their block sums."""
    a0 = act_buffer(P, w.k, launch, device)
    a1 = act_buffer(P, w.k, launch, device) if second is not None else a0
    s0 = sums(P, w.k, w, device)
    s1 = sums(P, w.k, w, device) if second is not None else s0
    return a0, a1, s0, s1


def rotate(x, rows, expert, w: Exl3Weight, second: Exl3Weight | None, P: int, launch: Launch, programs: tuple):
    """Rotated inputs (P, k): H_128 (x[rows[pos]] * suh[expert[pos]]), and the same with second's suh, as the
    launch's GEMM reads them; and their block sums. programs: (rows, warps) a program."""
    from .triton_rotate import rotate_rows
    a0, a1, s0, s1 = out = _rotation_buffers(P, w, second, launch, x.device)
    stride_se = w.suh.shape[-1] if w.experts else 0
    BM, warps = programs
    rotate_rows[(-(-P // BM), w.k // 128)](x, x.stride(0), rows, expert, w.suh, (second or w).suh, a0, a1, s0, s1,
                                           had(str(x.device)), P, w.k, max(w.experts, 1), stride_se,
                                           DUAL=second is not None, SUMS=mul1_h(w), BM=BM, num_warps=warps)
    return out


def route_rotate(x, topk_ids, expert_map, w: Exl3Weight, second: Exl3Weight, launch: Launch, programs: tuple):
    """route() and rotate() in one launch (triton_rotate.route_rotate), for decode sizes: the Routing, and the
    rotated rows of w and second with their block sums. A launch fewer in the decode call, whose small kernels
    are latency chains."""
    from .triton_rotate import route_rotate as kernel
    P = topk_ids.numel()
    r, args, meta = small_route(topk_ids, w.experts, launch.BM, expert_map)
    a0, a1, s0, s1 = out = _rotation_buffers(P, w, second, launch, x.device)
    ROWS, warps = programs
    kernel[(-(-P // ROWS) + 1, w.k // 128)](*args, x, x.stride(0), w.suh, second.suh, a0, a1, s0, s1,
                                            had(str(x.device)), w.k, w.suh.shape[-1], **meta, DUAL=True,
                                            SUMS=mul1_h(w), ROWS=ROWS, num_warps=warps)
    return r, out


def gemm(a0, a1, chunks, w: Exl3Weight, p0, p1, second: Exl3Weight | None, launch: Launch, tuning: Tuning):
    """Launch the launch's grouped GEMM over `chunks` = (pos, len, expert, count, bound) into partials p0 (and,
    with `second`, p1 from a1)."""
    pos, length, expert, count, bound = chunks
    words = w.trellis.view(torch.int32)
    stride_te = words[0].numel() if w.experts else 0
    other = (second if second is not None else w).trellis.view(torch.int32)
    grid = (bound, w.n // launch.BN, launch.split)
    tiled = launch.tiled and is_tiled(w.K, tuning)
    common = (pos, length, expert, count)
    if launch.mma:
        return _grouped_mma(a0, a1, common, words, other, w, p0, p1, second is not None, stride_te, grid, launch,
                            tuning)
    if tiled and launch.gemv:
        from .triton_gemv import grouped_gemv
        grouped_gemv[grid](a0, a1, *common, words, other, p0, p1 if p1 is not None else p0, p0.shape[1], w.k, w.n,
                           stride_te, MASK, W=words.shape[-1], CB=CODEBOOK_ID[w.codebook], DUAL=second is not None,
                           BN=launch.BN, BK=launch.BK, SPLIT=launch.split, KLOG=_klog(w.K, True),
                           ASM=a0.device.type == "cuda", ROWS=launch.BM, num_warps=launch.warps,
                           num_stages=launch.stages)
        return
    from .triton_gemm import grouped_gemm
    grouped_gemm[grid](a0, a1, *common, words, other, windows(w.K, str(a0.device)), p0, p1 if p1 is not None else p0,
                       p0.shape[1], w.k, w.n, stride_te, W=words.shape[-1], CB=CODEBOOK_ID[w.codebook],
                       DUAL=second is not None, BM=launch.BM, BN=launch.BN, BK=launch.BK, SPLIT=launch.split,
                       TILED=tiled, KLOG=_klog(w.K, tiled), SWAP=tiled and launch.swap, ASM=a0.device.type == "cuda",
                       num_warps=launch.warps, num_stages=launch.stages)


def _klog(K: float, tiled: bool) -> int:
    """The kernels' KLOG argument: log2 K for the tiled decoder, unused by the gather one."""
    return int(K).bit_length() - 1 if tiled else 1


def _grouped_mma(a0, a1, common, words, other, w, p0, p1, two: bool, stride_te, grid, launch: Launch,
                 tuning: Tuning) -> None:
    """grouped_mma: gate and up (`two`) in one launch at decode sizes, one after the other in wider chunks; one
    projection alone or, `launch.pair`, two column blocks a program. Registers and unroll per the tuning."""
    from .gluon_mma import grouped_mma
    if launch.BM % 8:
        raise ValueError(f"grouped_mma takes chunks of a multiple of 8 rows, the launch has {launch.BM}")
    wide = wide_mma(launch, tuning)
    dual = two and not wide
    pair = launch.pair and not two
    one = not two and not pair  # one stream of decoding: down alone
    registers = tuning.mma_registers_wide if wide else tuning.mma_registers_one if one else tuning.mma_registers_two
    unroll = 1 if wide else tuning.mma_unroll_one if one else tuning.mma_unroll_two
    idp = 0 if wide else tuning.idp(words.shape[-1], w.codebook)
    for a, t, p in [(a0, words, p0)] + ([(a1, other, p1)] if two and wide else []):
        grouped_mma[grid[0], grid[1] // (1 + pair), grid[2]](
            a, a1 if dual else a, *common, t, other if dual else t, p, p1 if dual else p, p0.shape[1], w.k, w.n,
            stride_te, MASK, W=words.shape[-1], CB=CODEBOOK_ID[w.codebook], DUAL=dual, BN=launch.BN, BK=launch.BK,
            SPLIT=launch.split, ROWS=launch.BM, UNROLL=unroll, PAIR=pair, IDP=idp, num_warps=launch.warps,
            **({"maxnreg": registers} if registers else {}))


def linear_epilogue(part, s, svh, bias, out, per_slice: int, w: Exl3Weight, programs: tuple) -> None:
    """out = the rotated, scaled sums of the K splits of `part` (split, P, n) (+ bias): positions in slices of
    per_slice rows, slice s written to out's columns s n .. (triton_epilogues.linear_epilogue)."""
    from .triton_epilogues import linear_epilogue as kernel
    P, n = part.shape[1:]
    BM, warps = programs
    kernel[(-(-P // BM), n // 128)](part, s, svh, bias if bias is not None else svh, out, had(str(out.device)), P, n,
                                    min(n, out.shape[1]), w.k // 128, max(per_slice, 1), out.stride(0),
                                    HAS_BIAS=bias is not None, MUL1_H=mul1_h(w), SPLIT=part.shape[0], BM=BM,
                                    num_warps=warps)


def act_epilogue(pg, pu, s0, s1, r, experts, mid, mid_sums, limit, split: int, programs: tuple) -> None:
    """mid = the down projection's rotated input from gate's and up's partials (triton_epilogues.act_epilogue)."""
    from .triton_epilogues import act_epilogue as kernel
    g, d = experts.gate, experts.down
    P = pg.shape[1]
    BM, warps = programs
    kernel[(-(-P // BM), g.n // 128)](pg, pu, s0, s1, r.sorted_expert, g.svh, experts.up.svh, d.suh,
                                      had(str(pg.device)), mid, mid_sums, P, g.n, experts.intermediate,
                                      experts.count, float(limit or 0.0), g.k // 128, HAS_LIMIT=limit is not None,
                                      MUL1_H=mul1_h(g), SUMS=mul1_h(d), SPLIT=split, BM=BM, num_warps=warps)


def combine(pd, mid_sums, r, topk_weights, d: Exl3Weight, out, top_k: int, combine_plan: tuple) -> None:
    """out[t] = the weighted sum of token t's slots of the down projection: combine_stacked (a few tokens' slots
    stacked into one product a program, `rows` tokens a program) or combine_epilogue (`rows` tokens a program)."""
    from .triton_epilogues import combine_epilogue, combine_stacked
    kernel, rows, warps = combine_plan
    M, P = out.shape[0], pd.shape[1]
    args = (pd, mid_sums, r.slot_pos, r.slot_expert, topk_weights.reshape(-1), d.svh, had(str(out.device)), out, M, P,
            d.n, out.shape[1], d.k // 128)
    grid = (-(-M // rows), d.n // 128)
    if kernel == "combine_stacked":
        combine_stacked[grid](*args, TOPK=top_k, MUL1_H=mul1_h(d), TP=1 << (top_k - 1).bit_length(),
                              SPLIT=pd.shape[0], BT=rows, num_warps=warps)
    else:
        combine_epilogue[grid](*args, TOPK=top_k, MUL1_H=mul1_h(d), SPLIT=pd.shape[0], BM=rows, num_warps=warps)
