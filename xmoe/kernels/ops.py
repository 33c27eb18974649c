"""The one import surface of xmoe.kernels: EXL3 linear layers and fused MoE, torch reference or Triton.

Backends are chosen explicitly: "torch" (the reference, any device), "triton" (CUDA GPUs, or the CPU under
TRITON_INTERPRET=1), or "auto", which takes Triton where it can run, says so once, and otherwise the torch
reference. Asking for Triton where it cannot run is an error that says why; nothing falls back silently.

Every launch setting the benchmarks sweep and the tests override (TUNED, FILL, DENSE_*) is a module attribute
here, read at call time, so the code that launches with them stays in this file too (over 400 lines).
"""
import logging
import os
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from ..format.hadamard import hadamard_128
from ..format.trellis import state_windows
from .reference import exl3_linear_ref, exl3_slices_ref, fused_moe_ref
from .routing import ROUTE_SLOTS, Routing, chunk_bound, expected_experts, route, small_route
from .weights import Exl3Experts, Exl3Slices, Exl3Weight

BACKENDS = ("auto", "triton", "torch")
log = logging.getLogger(__name__)


@lru_cache(maxsize=None)  # fixed for the process: checked once per device, not on every call of the ops
def triton_refusal(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on this device, or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install 'xmoe[gpu]')"
    if device.type == "cpu":
        return None if os.environ.get("TRITON_INTERPRET") == "1" else \
            "tensors are on the CPU (the Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 to emulate one)"
    if device.type != "cuda":
        return f"device {device} is not a CUDA GPU"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"{torch.cuda.get_device_name(device)} is older than sm_80 (the kernels need fp16 tensor-core MMA)"
    return None


@lru_cache(maxsize=None)
def _announce(device: str, backend: str, reason: str) -> None:
    log.info("xmoe kernels on %s: %s (%s)", device, backend, reason)


def pick_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    refusal = triton_refusal(device)
    if backend == "triton" and refusal:
        raise RuntimeError(f"the Triton EXL3 kernels cannot run here: {refusal}")
    if backend == "auto":
        backend = "torch" if refusal else "triton"
        _announce(str(device), backend, refusal or "Triton kernels available")
    return backend


@dataclass(frozen=True)
class Launch:
    """Tile sizes of one grouped-GEMM launch: rows per chunk, columns per program, K splits, warps, and
    pipeline stages (the gathered trellis words are staged per element, so stages cost shared memory)."""
    BM: int
    BN: int
    split: int
    BK: int = 32
    warps: int = 4
    stages: int = 2
    tiled: bool = False  # decode_tiles (K = 1, 2, 4, 8: each tile's words loaded once), else per-weight gathers
    swap: bool = False  # tiled only: W^T a^T, the decoded weights as the MMA's wide first operand
    gemv: bool = False  # tiled only, BM 1 or 2: grouped_gemv, products on CUDA cores instead of tensor cores
    mma: bool = False  # gluon_mma's grouped_mma, weights decoded into mma.sync registers (CUDA, K <= 4): BM 8, or
    # a multiple of 8 for prefill (regime "rows")
    pair: bool = False  # mma, one projection: two column blocks a program (MMA_PAIR)


# (BM, BK, BN, warps, stages) per row regime and decoder, from timed sweeps on an H200 at DeepSeek-V4.1 shapes
# (benchmarks/moe_kernel.py --sweep). The tiled decoder (K = 1, 2, 4, 8) is the default; DECODER = "gather"
# takes per-weight gathers everywhere (every K).
DECODER = "tiled"
# Regimes whose tiled launches multiply W^T a^T (on Hopper a wgmma with M = BN; see Launch.swap): faster by
# 5-15% at 6-48 tokens on the H200, slower for prefill.
SWAP_AB = {"decode"}
# Expected rows per chunk (uniform routing) up to which tiled launches take grouped_gemv: chunks of up to 2 rows
# (its BM) on CUDA cores, so no decoded weight passes through shared memory on its way to an MMA, but an expert
# with more rows is decoded again for every 2. On the H200 at V4.1 shapes (two runs): up to 12 tokens, where it
# is 1.4x the tensor cores on uniform routing and 0.9x on skewed; from 24 tokens it loses 1.7x and more on skewed.
GEMV_ROWS = 1.12
# Expected rows per chunk up to which grouped_mma (chunks of 8 rows on mma.sync, gluon_mma) takes the call where
# it can run; 0 turns it off.
MMA_ROWS = 8
# Beyond that, up to this many expected rows per chunk, grouped_mma still takes the call, in chunks of 32 rows (the
# "rows" regime: four n tiles of the MMA, each decoded weight serving all 32 rows; gate and up in two launches, as
# both together would spill); 0 turns it off. A prefill call with experts for the dense path (_find_hot) takes the
# tl.dot launches instead, over the same chunks, as the dense product reads fp16 rows, not grouped_mma's doubled ones.
# On the H200 at V4.1 shapes, 1,542 uniform tokens (24 rows an expert): K = 2 MCG 5.2 against 6.4 ms, K = 3 mul1 5.7
# against 11.7; at 4,096 (64 rows, two chunks an expert) 12.6 against 9.9 and 13.0 against 11.3, hence 32.
ROWS_MMA = 32
# Where the tiled decoder can take the call, its tl.dot "decode" launches keep chunks of up to this many expected
# rows: dense layers of 16 rows took as long or less that way (5120 x 2304, K = 2: 22.3 against 29.3 us), while at
# K = 3 the "rows" regime took half the gather decoder's time from 16 rows on.
ROWS_MMA_TILED = 16
# Dense layers (and merged ones, exl3_linear_slices) of more rows than MMA_ROWS up to this many take grouped_mma in
# chunks of 16 ("mid", the "rows" regime's kernel): on the H200, 16 layers in one graph at 9, 12 and 16 rows, K = 2
# and 3, six shapes, 3-30% faster than the tl.dot or 32-row launches in 35 of 36 cases and 3% slower in one
# (docs/data/linear_kernel_h200_twentieth_mid.txt). MoE calls keep their regimes (not timed this way).
MID_ROWS = 16
TUNED = {("decode", False): (16, 64, 32, 4, 1), ("prefill", False): (64, 16, 32, 4, 1),
         ("mma", True): (8, 32, 128, 4, 1), ("gemv", True): (2, 64, 64, 4, 1), ("decode", True): (16, 64, 64, 4, 2),
         ("prefill", True): (64, 64, 128, 4, 1), ("rows", True): (32, 16, 256, 4, 1),
         ("mid", True): (16, 32, 128, 4, 1)}


# An expert with at least this many rows in one call (prefill) is decoded to fp16 once and multiplied by dense_gemm
# (a dense layer: by the torch matmul), instead of being decoded again for every chunk of rows; DENSE_GROUP experts
# are decoded per launch.
DENSE_ROWS = 128
# The same for the experts of a call whose grouped kernels would gather every weight's words (K = 3 and the
# half-integer K: no tiled decoder) while gluon_mma decodes them densely: on the H200 at K = 3, 1,542 uniform
# tokens took 11.3 ms this way against 20.0-20.5 grouped (stock 12.4), 4,096 uniform 11.0 against 31.7 (stock
# 27.2).
DENSE_ROWS_UNTILED = 16
DENSE_GROUP = 32  # 377 MB of decoded weights per launch at V4.1 shapes; 8 and 16 were 1-3% slower on the H200
# When at most this many experts would be left to the grouped kernels, they go dense too: the grouped kernels
# give each chunk and column block one program, so a few experts would leave most multiprocessors idle.
DENSE_REST = 8
EPILOGUE_SMALL = 256  # rows up to which the prologue and epilogues take EPILOGUE[0]'s launch, beyond EPILOGUE[1]
# (rows, warps) a program of the rotation and the epilogues, for a few rows and for many (epilogue_launch). Each
# program reads the 32 KB Hadamard matrix, so many rows take more a program (at 16, prefill spent more on those
# reads than on its rows). On the H200, 2 or 8 warps were slower than 4 at 6 and 48 tokens; at 1,542 and 4,096
# skewed tokens the three kernels together took 26-37% longer at 64 rows and 8 warps, 1.45-1.5x at 16 rows and 4,
# 2.0-2.5x at 32 or 16 rows and 8 (docs/data/moe_kernel_h200_epilogue_sweep.txt).
EPILOGUE = ((16, 4), (64, 4))
# Rows a program of act_epilogue (calls of up to EPILOGUE_SMALL slots) and of route_rotate. Both are latency chains;
# fewer rows mean fewer values a thread (at 1-4 tokens most of 16 rows were masked, their instructions issued all the
# same) and more programs. At 16 rows act_epilogue also spilled 120-176 bytes a thread at 12-16 K splits (Triton 3.6,
# sm_90). On an H100 at V4.1 shapes, per kernel, three rounds in one process
# (docs/data/moe_kernel_h100_twentysixth_rows.txt):
# - act_epilogue: 3.2-5.1 us at 4 rows, 4.1-6.1 at 8, 5.2-7.9 at main's 16 (1-12 tokens); outputs bit-equal.
# - route_rotate: 3.3-4.6 us at 8 rows against 3.5-5.2 at 16 (1-6 tokens); at 4 rows 5.4-7.6 against 4.5-5.1 (6-8).
# - rotate_rows (beyond ROUTE_ROTATE slots) took longer at 8 (24 tokens: 9.2 against 6.0 us), so it keeps EPILOGUE.
ACT_ROWS = 4
ROUTE_ROTATE_ROWS = 8
# Tokens up to which the combine stacks a few tokens' slots into one product a program (combine_stacked): on the
# H200, in one run, 6.0 us at 6 tokens where one program per 16 tokens took 14.1; at 48 tokens 23.9 against 13.4.
COMBINE_STACKED = 16
# Tokens up to which combine_stacked's product takes 8 rows (one token's slots at top-5 to top-8) instead of 16:
# twice the programs, each half as long. On an H100 at V4.1 shapes it took 4.2 against 5.0 us at one token, 5.6
# against 6.0 at 6, 6.8 against 7.3 at 8 (docs/data/moe_kernel_h100_twentyninth_split.txt); at 12, 0.5 us longer
# (the twenty-sixth round).
COMBINE_FEW = 8
# Registers a thread ptxas may give grouped_mma, for gate and up together and for down alone (0: its own choice;
# without a limit it takes 64 and 40). More registers let it issue the next K step's loads earlier in the loop.
# Gate and up take 96 for two K steps an iteration (MMA_UNROLL; at 72 that spilled 32 bytes), 5 programs a
# multiprocessor where 72 gave 7: on the H200, against (72, 72) at one step, in two calls in opposite order, skewed
# calls of 12-48 tokens 2.8-4.3% faster, the rest within 2.1% (docs/data/moe_kernel_h200_eighteenth_unroll_registers.txt
# and moe_kernel_h200_eighteenth.txt).
MMA_MAXNREG = (96, 72)
# K steps a loop iteration of grouped_mma, for gate and up together and for down alone ("rows": 1). Two take the
# copies between the double-buffered loads out of the loop (each copy of a just-loaded word waited on its load) and
# its counting to every other step: at K = 2 (Triton 3.6) gate and up from 4.61 to 4.41 instructions a weight, down
# from 5.09 to 4.70.
MMA_UNROLL = (2, 2)
# A decode-size grouped_mma launch of one projection (a MoE call's down) takes two column blocks a program, n / 2
# columns apart, decoded as gate and up are: two streams of states to interleave, one set of rows, the gate and up
# launch's registers and unroll; K = 2 MCG at 4.28 instructions a weight against 4.72 (Triton 3.9, sm_90). Only where
# the pairs still make FILL programs a multiprocessor: on an H100, dense layers of 1-8 rows (one chunk, the K split at
# its cap) took 4-9% longer paired, except 4096 x 8192 (2% less), while down at V4.1 shapes took 2.6-3.1 us less at 6
# tokens and 5 us less at 12 (docs/data/moe_kernel_h100_twentythird_pair*, linear_kernel_h100_twentythird_pair.txt).
MMA_PAIR = True
# States a decode-size grouped_mma takes from a top or bottom half by dp2a (an IDP, on the FMA pipe at IMAD's rate)
# rather than by a PRMT, shift or AND on the integer pipe, as a bit mask of the 8 states of a lane, per (bits a lane
# W = 8 K, codebook): the count of instructions stays, the two pipes even out. On an H100 against none, outputs
# bit-equal: K = 2 MCG and 3INST 3-4% less decode time at 1-48 tokens, K = 3 0.5-2.5%, K = 1 and 4 8-11% (MCG; 3INST
# at K = 4 7%); mul1, whose codewords already take the FMA pipe (dp4a), 3-4% more, so none
# (docs/data/moe_kernel_h100_twentyeighth_idp*). Timed on the H100 only; other GPUs take the same masks.
MMA_IDP = {(8, 1): 0b11111111, (16, 1): 0b111, (16, 0): 0b111, (24, 1): 0b10001000, (24, 0): 0b10001000,
           (32, 1): 0b01110111, (32, 0): 0b01110111}
ROWS_MAXNREG = 128  # the same for the "rows" regime's launches (at 128, no spills: Triton 3.6, sm_90)
# Programs per multiprocessor that the K split aims for, per regime (grouped_gemv's programs are small: a
# finer split evens out the last wave; 32 from an H200 sweep of 4-64 at 6-12 tokens, 1-3% ahead of 16). "rows"
# splits only dense layers (a MoE prefill call has programs enough): 16 was 5-10% ahead of 4 at 16-32 rows. The
# split counts chunks as uniform routing would make them, so skewed calls, with fewer experts, get too few programs:
# on the H200 "mma" at 24 against 16 took 201 against 249 us at 24 skewed tokens, 161 against 166 at 12, and as
# long within 2% at 6-48 uniform tokens (docs/data/moe_kernel_h200_fifteenth_fill.txt, _fifteenth.txt).
FILL = {"mma": 24, "rows": 16, "mid": 16, "gemv": 32, "decode": 4, "prefill": 4}
# K splits a launch takes at most (its epilogue reads every split's partials). A dense layer of 1-16 rows is one
# chunk, so its split stays at this cap far short of FILL: 5120 x 2304 makes 18 column blocks x 16 = 288 programs.
SPLIT_MOST = 16
# The same for a MoE call's decode-size grouped_mma launches (only calls of 1-4 tokens reach either cap at V4.1
# shapes). On an H100 at V4.1 shapes, three runs, each in one process against 16: 2-4 tokens 2-6% faster, uniform
# and skewed; 1 token within 2% either way; 6 and 8 tokens the same plans
# (docs/data/moe_kernel_h100_twentyfifth_cap12.txt).
SPLIT_MOST_MOE = 12
# K steps (of BK rows) a decode-size grouped_mma program takes at least: with fewer, its own start and its stores of
# partials (which the epilogue reads back, one split each) outweigh a fuller GPU. On an H100 at V4.1 shapes, one
# token's down (36 steps) took 10.4-10.5 us in 6 splits against 11.0-11.1 in 12 (the cap), and the combine after it
# 3.9 against 4.2-4.3 (docs/data/moe_kernel_h100_twentyninth_odd.txt; in a sweep, 10.6 in 4 splits and 10.9 in 9,
# _split.txt); on the H200 a 2304 x 5120 dense layer (72 steps) took 1-8% less in 12 splits than in 15 (the
# twenty-fourth round).
MMA_MIN_STEPS = 6
# Calls of up to this many slots (at most routing.ROUTE_SLOTS) route and rotate in one launch (route_rotate), else
# route_small, then rotate_rows; 0 turns it off. On an H100 at V4.1 shapes, 6 tokens (36 slots): 5.2 us against
# 4.4 + 3.7; 12 tokens (72): 24.7 against 4.8 + 10.0, as route_small's one program over 128 slots on 4 warps (8
# standalone) outlasted the rotation.
ROUTE_ROTATE = 64


def regime(rows_per_chunk: float, tiled: bool = True, mma: bool = False, rows_mma: float | None = None,
           mid: bool = False) -> str:
    """The row regime, the key of TUNED and SWAP_AB: "mma" (where grouped_mma can run) up to MMA_ROWS rows per
    chunk, then for dense layers (`mid`) "mid" up to MID_ROWS, and "rows" up to `rows_mma` (ROWS_MMA unless given;
    with the tiled decoder, from ROWS_MMA_TILED), "gemv" (tiled decoder only) for about one row per weight,
    "decode" for a few, else "prefill"."""
    if mma and rows_per_chunk <= MMA_ROWS:
        return "mma"
    if mma and mid and rows_per_chunk <= MID_ROWS:
        return "mid"
    if mma and rows_per_chunk <= (rows_mma or ROWS_MMA) and not (tiled and rows_per_chunk <= ROWS_MMA_TILED):
        return "rows"
    if tiled and rows_per_chunk <= GEMV_ROWS:
        return "gemv"
    return "decode" if rows_per_chunk <= 16 else "prefill"


def _tiled(K: float) -> bool:
    """Whether weights of K bits take the tiled decoder: DECODER says so and K is 1, 2, 4 or 8."""
    return DECODER == "tiled" and K in (1, 2, 4, 8)


def _klog(K: float, tiled: bool) -> int:
    """The kernels' KLOG argument: log2 K for the tiled decoder, unused by the gather one."""
    return int(K).bit_length() - 1 if tiled else 1


def mma_refusal(w: Exl3Weight, device: torch.device) -> str | None:
    """Why grouped_mma cannot take w's products on `device`, or None when it can (said once per reason)."""
    if device.type != "cuda":
        return "Gluon kernels run on CUDA GPUs only"
    if DECODER != "tiled":
        reason = f"ops.DECODER is {DECODER!r}"
    elif w.K not in (1, 1.5, 2, 2.5, 3, 3.5, 4):
        reason = f"K = {w.K} (it decodes K = 1-4 and the half-integer K)"
    else:
        reason = _gluon_refusal()
    if reason:
        _announce(str(device), "grouped_mma not used", reason)
    return reason


@lru_cache(maxsize=None)
def _gluon_refusal() -> str | None:
    import triton
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6):
        return f"Triton {triton.__version__} (its Gluon API is that of Triton 3.6 and later)"
    return None


def plan(chunks: int, n: int, k: int, rows_per_chunk: float, sms: int, K: float = 2, gemv: bool = True,
         mma: bool = False, rows_mma: float | None = None, mid: bool = False, single: bool = False) -> Launch:
    """Tile sizes by regime (gemv=False: never grouped_gemv or grouped_mma; mma: grouped_mma can run; rows_mma:
    the "rows" regime's last rows per chunk, ROWS_MMA unless given; mid: a dense layer's; single: one projection,
    which "mma" takes in pairs of column blocks, MMA_PAIR); enough K splits to give each multiprocessor about FILL
    programs."""
    tiled = _tiled(K)
    mode = regime(rows_per_chunk, tiled and gemv, gemv and mma, rows_mma, mid)
    on_mma = mode in ("mma", "rows", "mid")
    BM, BK, BN, warps, stages = TUNED[mode, tiled or on_mma]
    BN = min(BN, n)
    while n % BN:  # n is a multiple of 128, BN a power of two: every column block whole
        BN //= 2
    steps = k // BK
    most = min(steps, SPLIT_MOST_MOE if mode == "mma" and not mid else SPLIT_MOST)
    if mode == "mma":
        most = max(1, min(most, steps // MMA_MIN_STEPS))
    blocks = max(chunks, 1) * (n // BN)  # programs a K split
    pair = (MMA_PAIR and single and mode == "mma" and n // BN % 2 == 0
            and blocks // 2 * most >= FILL[mode] * sms)  # pairs still fill the GPU
    programs = blocks // (1 + pair)
    split = max(1, min(most, -(-FILL[mode] * sms // programs)))
    split = -(-steps // -(-steps // split))  # no split left without steps (the kernels give each ceil(steps / split))
    return Launch(BM, BN, split, BK, warps, stages, tiled, tiled and mode in SWAP_AB, mode == "gemv", on_mma, pair)


@lru_cache(maxsize=None)
def _had(device: str) -> torch.Tensor:
    return (hadamard_128() * 128 ** 0.5).round().to(device=device, dtype=torch.float16)


@lru_cache(maxsize=None)
def _windows(K: float, device: str) -> torch.Tensor:
    return state_windows(K).to(device)


def _eager_tables(weights: tuple, device: torch.device) -> None:
    """Makes the tables that the gather decoder reads (_windows) outside any CUDA-graph capture: a capture may take
    that path where the eager calls before it did not (inside graphs there is no dense path), and a host table
    cannot be copied to the GPU while a capture runs."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    for w in weights:
        _windows(w.K, str(device))


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


CODEBOOK_ID = {"3inst": 0, "mcg": 1, "mul1": 2}
MASK_8FFF = 0x8FFF8FFF - (1 << 32)  # the codebooks' mask as an int32 argument of grouped_gemv


def epilogue_launch(rows: int, small_rows: int | None = None) -> tuple:
    """(rows, warps) a program of the rotation prologue and the epilogues of a call of `rows` rows; small_rows
    replaces EPILOGUE's rows a program up to EPILOGUE_SMALL (ACT_ROWS, ROUTE_ROTATE_ROWS)."""
    if rows > EPILOGUE_SMALL:
        return EPILOGUE[1]
    return small_rows or EPILOGUE[0][0], EPILOGUE[0][1]


def _rotation_buffers(P: int, w: Exl3Weight, second: Exl3Weight | None, launch: Launch,
                      device: torch.device) -> tuple:
    """The rotation's outputs (a0, a1, s0, s1): w's rotated rows and, with `second`, its own; their block sums."""
    a0 = _act_buffer(P, w.k, launch, device)
    a1 = _act_buffer(P, w.k, launch, device) if second is not None else a0
    s0 = _sums(P, w.k, w, device)
    s1 = _sums(P, w.k, w, device) if second is not None else s0
    return a0, a1, s0, s1


def _rotate(x, rows, expert, w: Exl3Weight, second: Exl3Weight | None, P: int, launch: Launch):
    """Rotated inputs (P, k): H_128 (x[rows[pos]] * suh[expert[pos]]), and the same with second's suh, in
    _act_dtype; and their block sums (_sums)."""
    from .triton_exl3 import rotate_rows
    a0, a1, s0, s1 = out = _rotation_buffers(P, w, second, launch, x.device)
    stride_se = w.suh.shape[-1] if w.experts else 0
    BM, warps = epilogue_launch(P)
    rotate_rows[(-(-P // BM), w.k // 128)](x, x.stride(0), rows, expert, w.suh, (second or w).suh, a0, a1, s0, s1,
                                           _had(str(x.device)), P, w.k, max(w.experts, 1), stride_se,
                                           DUAL=second is not None, SUMS=_mul1_h(w), BM=BM,
                                           num_warps=warps)
    return out


def _route_rotate(x, topk_ids, expert_map, w: Exl3Weight, second: Exl3Weight, launch: Launch) -> tuple:
    """route() and _rotate() in one launch (triton_exl3.route_rotate), for calls of up to ROUTE_ROTATE slots: the
    Routing, and the rotated rows of w and second with their block sums. A launch fewer in the decode call, whose
    small kernels are latency chains (route_small alone took 3.7 us on an H100 at 6 tokens)."""
    from .triton_exl3 import route_rotate
    P = topk_ids.numel()
    r, args, meta = small_route(topk_ids, w.experts, launch.BM, expert_map)
    a0, a1, s0, s1 = out = _rotation_buffers(P, w, second, launch, x.device)
    ROWS, warps = epilogue_launch(P, ROUTE_ROTATE_ROWS)
    route_rotate[(-(-P // ROWS) + 1, w.k // 128)](*args, x, x.stride(0), w.suh, second.suh, a0, a1, s0, s1,
                                                  _had(str(x.device)), w.k, w.suh.shape[-1], **meta, DUAL=True,
                                                  SUMS=_mul1_h(w), ROWS=ROWS, num_warps=warps)
    return r, out


def _act_dtype(launch: Launch) -> torch.dtype:
    """The GEMMs' activations: fp16 for tensor cores, fp32 for grouped_gemv (no conversion in its inner loop),
    int32 for grouped_mma (fp16 doubled, as_operand: each value already the pair of K rows its MMA reads)."""
    return torch.float32 if launch.gemv else torch.int32 if launch.mma else torch.float16


def _act_buffer(P: int, cols: int, launch: Launch, device: torch.device) -> torch.Tensor:
    """(P, cols) activations for the launch's GEMM (grouped_mma reads no row past a chunk's last: its MMA's spare
    rows read that row again)."""
    return torch.empty(P, cols, device=device, dtype=_act_dtype(launch))


def _mul1_h(w: Exl3Weight) -> bool:
    """Whether w's products come from the GEMM kernels as sums of mul1's h, the value before the codebook's fp16
    FMA, which the epilogues apply (triton_exl3.mul1_affine): at mul1 all of them leave it out (in grouped_mma a
    sixth of the instructions a weight, in the tensor-core decoders a byte sum of seven and a conversion)."""
    return w.codebook == "mul1"


def _sums(P: int, cols: int, w: Exl3Weight, device: torch.device) -> torch.Tensor:
    """The block sums of (P, cols) activations that mul1's epilogues read (fp32, one per row and 128 columns);
    one unread element where none are needed."""
    return torch.empty((P, cols // 128) if _mul1_h(w) else (1,), device=device, dtype=torch.float32)


def _rows_regime(launch: Launch) -> bool:
    """Whether a launch is grouped_mma's "rows" regime: chunks of more rows than its decode launch's."""
    return launch.mma and launch.BM > TUNED["mma", True][0]


def _maxnreg(registers: int) -> dict:
    return {"maxnreg": registers} if registers else {}


def _mma_idp(W: int, codebook_id: int, prefill: bool) -> int:
    """The states a grouped_mma launch of W bits a lane takes by dp2a (MMA_IDP; none in the "rows" regime)."""
    return 0 if prefill else MMA_IDP.get((W, codebook_id), 0)


def _gemm(a0, a1, chunks, w: Exl3Weight, p0, p1, second: Exl3Weight | None, launch: Launch):
    """Launch grouped_gemm (or grouped_gemv) over `chunks` = (pos, len, expert, count, bound) into partials p0
    (and p1)."""
    from .triton_exl3 import grouped_gemm
    from .triton_gemv import grouped_gemv
    pos, length, expert, count, bound = chunks
    words = w.trellis.view(torch.int32)
    stride_te = words[0].numel() if w.experts else 0
    other = (second if second is not None else w).trellis.view(torch.int32)
    grid = (bound, w.n // launch.BN, launch.split)
    tiled = launch.tiled and _tiled(w.K)
    if launch.mma:
        from .gluon_mma import grouped_mma
        if launch.BM % 8:
            raise ValueError(f"grouped_mma takes chunks of a multiple of 8 rows, the launch has {launch.BM}")
        prefill = _rows_regime(launch)  # gate and up one after the other
        dual = second is not None and not prefill
        pair = launch.pair and second is None
        single = second is None and not pair  # the settings of down alone, else of gate and up
        registers = ROWS_MAXNREG if prefill else MMA_MAXNREG[single]
        idp = _mma_idp(words.shape[-1], CODEBOOK_ID[w.codebook], prefill)
        for a, t, p in [(a0, words, p0)] + ([(a1, other, p1)] if second is not None and prefill else []):
            grouped_mma[grid[0], grid[1] // (1 + pair), grid[2]](
                a, a1 if dual else a, pos, length, expert, count, t, other if dual else t, p, p1 if dual else p,
                p0.shape[1], w.k, w.n, stride_te, MASK_8FFF, W=words.shape[-1], CB=CODEBOOK_ID[w.codebook], DUAL=dual,
                BN=launch.BN, BK=launch.BK, SPLIT=launch.split, ROWS=launch.BM,
                UNROLL=1 if prefill else MMA_UNROLL[single], PAIR=pair, IDP=idp, num_warps=launch.warps,
                **_maxnreg(registers))
        return
    if tiled and launch.gemv:
        grouped_gemv[grid](a0, a1, pos, length, expert, count, words, other, p0, p1 if p1 is not None else p0,
                           p0.shape[1], w.k, w.n, stride_te, MASK_8FFF, W=words.shape[-1], CB=CODEBOOK_ID[w.codebook],
                           DUAL=second is not None, BN=launch.BN, BK=launch.BK, SPLIT=launch.split,
                           KLOG=_klog(w.K, True), ASM=a0.device.type == "cuda", ROWS=launch.BM,
                           num_warps=launch.warps, num_stages=launch.stages)
        return
    grouped_gemm[grid](a0, a1, pos, length, expert, count, words, other, _windows(w.K, str(a0.device)),
                       p0, p1 if p1 is not None else p0, p0.shape[1], w.k, w.n, stride_te,
                       W=words.shape[-1], CB=CODEBOOK_ID[w.codebook], DUAL=second is not None,
                       BM=launch.BM, BN=launch.BN, BK=launch.BK, SPLIT=launch.split, TILED=tiled,
                       KLOG=_klog(w.K, tiled), SWAP=tiled and launch.swap, ASM=a0.device.type == "cuda",
                       num_warps=launch.warps, num_stages=launch.stages)


def decode_experts(w: Exl3Weight, ids: torch.Tensor, mul1_h: bool = False) -> torch.Tensor:
    """(len(ids), k, n) fp16: the decoded weights W-hat (before the Hadamards and scales) of experts `ids`
    (int32, on w's device; [0] for a single layer); with mul1_h, mul1's h instead of its weights, as the GEMM
    kernels take them (_mul1_h)."""
    from .triton_exl3 import decode_weights
    words = w.trellis.view(torch.int32)
    tiled = _tiled(w.K)
    out = torch.empty(len(ids), w.k, w.n, device=words.device, dtype=torch.float16)
    BK, BN = 32, 128  # the fastest of six block shapes on an H200 (5120 x 5120: 30 us, 64 x 64: 41 us)
    stride_te = words[0].numel() if w.experts else 0
    if mma_refusal(w, words.device) is None:  # grouped_mma's decoding (gluon_mma.decode_weights)
        from .gluon_mma import decode_weights as decode_lanes
        steps = 8  # blocks of BK rows a program
        decode_lanes[(-(-w.k // (BK * steps)), w.n // BN, len(ids))](
            words, ids, out, w.k, w.n, stride_te, MASK_8FFF, W=words.shape[-1],
            CB=CODEBOOK_ID[w.codebook], BN=BN, BK=BK, STEPS=steps, MUL1_H=mul1_h, num_warps=4)
        return out
    decode_weights[(w.k // BK, w.n // BN, len(ids))](
        words, ids, _windows(w.K, str(words.device)), out, w.k, w.n, stride_te,
        W=words.shape[-1], CB=CODEBOOK_ID[w.codebook], BK=BK, BN=BN, TILED=tiled,
        KLOG=_klog(w.K, tiled), MUL1_H=mul1_h, ASM=words.device.type == "cuda")
    return out


def _mm32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b in fp32 from fp16 weights and fp16 or fp32 rows (fp32 accumulation, as the Triton kernels)."""
    if a.is_cuda and a.dtype == b.dtype:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


DENSE_TILE = (128, 256, 64, 8, 3)  # dense_gemm's BM, BN, BK, warps, at most this many stages (H200 sweep)


@lru_cache(maxsize=None)
def _shared_memory(index: int) -> int:
    from triton.runtime import driver
    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


def _dense_tile(device: torch.device) -> tuple:
    """DENSE_TILE with as many pipeline stages as one program's shared memory holds (99 KB on sm_89/sm_120)."""
    BM, BN, BK, warps, stages = DENSE_TILE
    if device.type == "cuda":
        stages = max(1, min(stages, _shared_memory(device.index or 0) // ((BM + BN) * BK * 2)))
    return BM, BN, BK, warps, stages


DENSE_TMA = True  # dense_gemm_tma where the copy engine is there (sm_90 and later) or emulated (TRITON_INTERPRET)


def _tma(device: torch.device) -> bool:
    return DENSE_TMA and (device.type == "cpu" or torch.cuda.get_device_capability(device) >= (9, 0))


@dataclass(frozen=True)
class Hot:
    """The experts of a call that go dense: those with at least _dense_rows rows, or all of them where at most
    DENSE_REST others are left. flags (experts + 1,) int32, 1 for dense; per group of DENSE_GROUP, (ids, pos,
    length, slot): the experts and dense_gemm's chunks (first sorted position, rows, index in the group), all on
    the device."""
    flags: torch.Tensor
    groups: list
    every: bool  # no expert is left to the grouped kernels


def _find_hot(r: Routing, P: int, experts: int, BM: int, rows: int, device: torch.device) -> tuple:
    """Finds the call's dense experts on the device (hot_experts, from the routing's runs) and starts copying
    their counts to the host; returns what _hot_experts reads. Work queued after this call does not delay the
    read."""
    import triton
    from .triton_route import hot_experts
    runs = r.runs
    if runs is None:  # route_small's routing: count the slots (a scatter: bincount reads its maximum back)
        slot = r.slot_expert.long() + 1  # 0: other ranks' slots
        counts = torch.zeros(experts + 1, dtype=torch.long, device=slot.device)
        ends = counts.scatter_add_(0, slot, torch.ones_like(slot))[1:].cumsum(0)
        runs = torch.stack([ends - counts[1:], ends]).int()
    G = DENSE_GROUP
    GB = triton.next_power_of_2(-(-experts // G))
    flags = torch.empty(experts + 1, dtype=torch.int32, device=device)
    ids = torch.empty(experts, dtype=torch.int32, device=device)
    table = torch.empty(3, chunk_bound(P, BM, experts), dtype=torch.int32, device=device)
    counts = torch.empty(2 + GB, dtype=torch.int32, device=device)
    hot_experts[(1,)](runs, flags, ids, table, counts, experts, rows, DENSE_REST, runs.stride(0), table.stride(0),
                      BM=BM, G=G, EB=triton.next_power_of_2(experts + 1), GB=GB, num_warps=4)
    done = None
    if device.type == "cuda":
        counts = _host_counts(counts.numel(), str(device)).copy_(counts, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    return flags, ids, table, counts, done, G


@lru_cache(maxsize=None)
def _host_counts(n: int, device: str) -> torch.Tensor:
    """Pinned host memory that _find_hot's counts come back to: one buffer, reused, as each call reads it before
    the next can write it."""
    return torch.empty(n, dtype=torch.int32, pin_memory=True)


def _dense_rows(weights: tuple, device: torch.device, rows: bool = False) -> int:
    """Rows from which a call's expert goes dense: DENSE_ROWS, or DENSE_ROWS_UNTILED where a projection has no
    tiled grouped decoder but gluon_mma's decode_weights (K = 3 and the half-integer K), unless grouped_mma takes
    the call's other experts (`rows`: its "rows" regime)."""
    untiled = any(not _tiled(w.K) and mma_refusal(w, device) is None for w in weights)
    return DENSE_ROWS_UNTILED if untiled and not rows else DENSE_ROWS


def _hot_experts(found: tuple) -> Hot | None:
    """The call's dense experts (Hot), None if there are none, from _find_hot's tables: waits for its counts
    alone; the tables stay on the device, cut into groups by the counts. Only for calls of at least DENSE_ROWS
    tokens, never inside a CUDA-graph capture."""
    flags, ids, table, counts, done, G = found
    if done is not None:
        done.synchronize()
    dense, every, *chunks = counts.tolist()
    if not dense:
        return None
    groups, at = [], 0
    for i in range(-(-dense // G)):
        end = at + chunks[i]
        groups.append((ids[i * G:min(dense, (i + 1) * G)], *table[:, at:end]))
        at = end
    return Hot(flags, groups, every=bool(every))


def _dense_products(hot: Hot | None, a0, a1, w: Exl3Weight, second: Exl3Weight | None, p0, p1) -> None:
    """For each hot expert, p[0, rows] = a[rows] @ W-hat_e (and p1 from a1 and `second`) and the other K splits
    zeroed, as the epilogues sum them. Per group and projection, one decode and one dense_gemm launch: a
    matmul per expert made prefill host-bound (72 of them at 1,542 skewed tokens)."""
    if hot is None:
        return
    from triton.tools.tensor_descriptor import TensorDescriptor
    from .triton_exl3 import dense_gemm, dense_gemm_tma
    BM, BN, BK, warps, stages = _dense_tile(a0.device)
    tma = _tma(a0.device)
    kernel = dense_gemm_tma if tma else dense_gemm

    def operand(t: torch.Tensor, block: list):  # a 2-D matrix as the kernel reads it
        return TensorDescriptor.from_tensor(t, block) if tma else t

    pairs = [(operand(a0, [BM, BK]), w, p0)] + ([(operand(a1, [BM, BK]), second, p1)] if second is not None else [])
    for ids, pos, length, slot in hot.groups:
        for a, wt, p in pairs:
            dense = operand(decode_experts(wt, ids, _mul1_h(wt)).view(-1, wt.n), [BK, BN])  # (experts * k, n)
            kernel[(len(pos), -(-wt.n // BN))](a, dense, pos, length, slot, p, p.shape[1], wt.k, wt.n,
                                               SPLIT=p.shape[0], BM=BM, BN=BN, BK=BK, num_warps=warps,
                                               num_stages=stages)


def _without(chunks: tuple, hot: Hot, experts: int) -> tuple:
    """The chunk table without the hot experts' chunks (those go to _dense_products), on the device."""
    pos, length, expert, count, bound = chunks
    keep = (torch.arange(bound + 1, device=pos.device) < count) & (hot.flags[expert.long().clamp(0, experts)] == 0)
    order = torch.argsort((~keep).int(), stable=True)
    return pos[order], length[order], expert[order], keep.sum().int().reshape(1), bound


def _dense_call(M: int, launch: Launch, w: Exl3Weight, device: torch.device) -> bool:
    """Whether a call of M rows may take the dense path (and read the routing back, _hot_experts): only
    prefill-sized calls, never while a CUDA graph is being captured or torch.compile traces the call, and not
    with grouped_mma's launch, whose activations (doubled fp16) the dense product does not read, nor at mul1 with
    grouped_gemv's fp32 ones: the epilogue would take the rows' sums of values the dense product reads in fp16."""
    if torch.compiler.is_compiling() or launch.mma or (launch.gemv and _mul1_h(w)):
        return False
    return M >= DENSE_ROWS and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _padded_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    if x.shape[-1] < k:
        x = torch.nn.functional.pad(x, (0, k - x.shape[-1]))
    return x if x.stride(-1) == 1 else x.contiguous()


_ROW_CHUNKS: dict = {}


def _row_chunks(M: int, BM: int, device: torch.device, slices: int = 1) -> tuple:
    """A dense layer's routing: its M rows in chunks of BM, all on "expert" 0, or for `slices` slices
    (exl3_linear_slices) each slice's copy of the rows (positions s M ..) on expert s; (chunks, rows, experts) as
    _gemm and _rotate take them. Kept per shape, since building them is six small kernels, more than the layer's
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


def _linear_launch(M: int, w: Exl3Weight, device: torch.device, slices: int = 1) -> Launch:
    # without the tiled decoder, grouped_mma's chunks up to the dense path's rows: the gather decoder took 142-174 us
    # at 64 rows (H200, 5120 x 2304 and 2304 x 5120, K = 3), two chunks of 32 rows 37-38
    return plan(slices * -(-M // 16), w.n, w.k, M, _sms(device), w.K, mma=mma_refusal(w, device) is None,
                rows_mma=None if _tiled(w.K) or not ROWS_MMA else DENSE_ROWS - 1, mid=True, single=True)


def _linear_epilogue(part, sums, svh, bias, out, per_slice: int, w: Exl3Weight) -> None:
    """out = the rotated, scaled sums of the K splits of `part` (split, P, n) (+ bias): positions in slices of
    per_slice rows, slice s written to out's columns s n .. (linear_epilogue)."""
    from .triton_exl3 import linear_epilogue
    P, n = part.shape[1:]
    BM, warps = epilogue_launch(P)
    linear_epilogue[(-(-P // BM), n // 128)](part, sums, svh, bias if bias is not None else svh, out,
                                             _had(str(out.device)), P, n, min(n, out.shape[1]), w.k // 128,
                                             max(per_slice, 1), out.stride(0), HAS_BIAS=bias is not None,
                                             MUL1_H=_mul1_h(w), SPLIT=part.shape[0], BM=BM, num_warps=warps)


def exl3_linear(x: torch.Tensor, w: Exl3Weight, bias: torch.Tensor | None = None,
                backend: str = "auto") -> torch.Tensor:
    """y = x W + bias for x (..., in_features) fp16/bf16/fp32; returns (..., out_features) in x's dtype."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"exl3_linear: input has {x.shape[-1]} features, the layer takes {w.in_features}")
    if w.experts:
        raise ValueError("exl3_linear: takes one layer, got a stack of experts")
    if pick_backend(backend, x.device) == "torch":
        return exl3_linear_ref(x.reshape(-1, x.shape[-1]), w, bias).reshape(*x.shape[:-1], w.out_features)
    a = _padded_rows(x, w.k)
    M, dev = a.shape[0], x.device
    _eager_tables((w,), dev)
    launch = _linear_launch(M, w, dev)
    chunks, rows, zeros = _row_chunks(M, launch.BM, dev)
    a0, _, sums, _ = _rotate(a, rows, zeros, w, None, M, launch)
    if _dense_call(M, launch, w, dev):  # decoded once for all rows
        part = torch.empty(1, M, w.n, device=dev, dtype=torch.float32)
        _mm32(a0, decode_experts(w, zeros[:1], _mul1_h(w))[0], part[0])
    else:
        part = torch.empty(launch.split, M, w.n, device=dev, dtype=torch.float32)
        _gemm(a0, a0, chunks, w, part, None, None, launch)
    out = torch.empty(M, w.out_features, device=dev, dtype=x.dtype)
    _linear_epilogue(part, sums, w.svh, bias, out, M, w)
    return out.reshape(*x.shape[:-1], w.out_features)


def exl3_linear_slices(x: torch.Tensor, slices: Exl3Slices, backend: str = "auto") -> torch.Tensor:
    """Every layer of `slices` on x (..., in_features): (..., their outputs side by side) in x's dtype. Below the
    dense path's rows one launch each of rotation, GEMM and epilogue takes all slices (each slice rotating its own
    copy of the rows); from there each layer's slices are decoded once and multiplied as exl3_linear does."""
    w = slices.stack
    if x.shape[-1] != w.in_features:
        raise ValueError(f"exl3_linear_slices: input has {x.shape[-1]} features, the layers take {w.in_features}")
    if pick_backend(backend, x.device) == "torch":
        return exl3_slices_ref(x.reshape(-1, x.shape[-1]), slices).reshape(*x.shape[:-1], slices.out_features)
    a = _padded_rows(x, w.k)
    M, S, dev = a.shape[0], w.experts, x.device
    _eager_tables((w,), dev)
    launch = _linear_launch(M, w, dev, S)
    out = torch.empty(M, slices.out_features, device=dev, dtype=x.dtype)
    if _dense_call(M, launch, w, dev):
        _, rows, zeros = _row_chunks(M, launch.BM, dev)
        dense = decode_experts(w, torch.arange(S, device=dev, dtype=torch.int32), _mul1_h(w))  # (S, k, width)
        for layer in range(len(slices.widths)):
            s0, s1 = slices.bounds(layer)
            a0, _, sums, _ = _rotate(a, rows, zeros + s0, w, None, M, launch)  # the layer's suh: its first slice's
            part = torch.empty(1, M, (s1 - s0) * w.n, device=dev, dtype=torch.float32)
            _mm32(a0, dense[s0:s1].transpose(0, 1).reshape(w.k, -1), part[0])
            _linear_epilogue(part, sums, w.svh[s0:s1], None, out[:, s0 * w.n:s1 * w.n], M, w)
    else:
        chunks, rows, expert = _row_chunks(M, launch.BM, dev, S)
        a0, _, sums, _ = _rotate(a, rows, expert, w, None, S * M, launch)
        part = torch.empty(launch.split, S * M, w.n, device=dev, dtype=torch.float32)
        _gemm(a0, a0, chunks, w, part, None, None, launch)
        _linear_epilogue(part, sums, w.svh, None, out, M, w)
    return out.reshape(*x.shape[:-1], slices.out_features)


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Exl3Experts,
              limit: float | None = None, expert_map: torch.Tensor | None = None,
              backend: str = "auto") -> torch.Tensor:
    """sum over each token's experts of weight * down(act(gate(x)) * up(x)), act = SiLU (SwiGLU clamp with
    `limit`). x (M, hidden); topk_ids/topk_weights (M, top_k); expert_map: global -> local expert id, -1 for
    experts another rank owns (expert parallelism). Returns (M, hidden) in x's dtype."""
    if x.dim() != 2 or x.shape[1] != experts.hidden:
        raise ValueError(f"fused_moe: x is {tuple(x.shape)}, expected (tokens, {experts.hidden})")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be (tokens={x.shape[0]}, top_k)")
    if pick_backend(backend, x.device) == "torch":
        return fused_moe_ref(x, topk_ids, topk_weights, experts, limit, expert_map)
    from .triton_exl3 import act_epilogue, combine_epilogue, combine_stacked
    M, top_k = topk_ids.shape
    P, E, dev = M * top_k, experts.count, x.device
    g, d = experts.gate, experts.down
    _eager_tables((g, experts.up, d), dev)
    sms = _sms(dev)
    unique = expected_experts(P, E)
    mma = mma_refusal(g, dev) is None and mma_refusal(d, dev) is None
    up_launch = plan(unique, g.n, g.k, P / unique, sms, g.K, mma=mma)
    down_launch = plan(unique, d.n, d.k, P / unique, sms, d.K, mma=mma, single=True)
    if (up_launch.gemv, up_launch.mma) != (down_launch.gemv, down_launch.mma):
        # mixed K: one chunking serves both GEMMs, so tl.dot tensor cores for both
        up_launch = plan(unique, g.n, g.k, P / unique, sms, g.K, gemv=False)
        down_launch = plan(unique, d.n, d.k, P / unique, sms, d.K, gemv=False)
    down_launch = replace(down_launch, BM=up_launch.BM)  # the same chunks, so the same BM
    # prefill on grouped_mma ("rows"): with experts for the dense path, the tl.dot launches over the same chunks
    rows = _rows_regime(up_launch)
    dot = rows and tuple(replace(plan(unique, w.n, w.k, P / unique, sms, w.K, gemv=False), BM=up_launch.BM)
                         for w in (g, d))
    dense = _dense_call(M, dot[0] if rows else up_launch, g, dev)
    found, hot, xp = None, None, _padded_rows(x, g.k)
    if P <= min(ROUTE_ROTATE, ROUTE_SLOTS) and not dense:
        r, (a0, a1, s0, s1) = _route_rotate(xp, topk_ids, expert_map, g, experts.up, up_launch)
    else:
        r = route(topk_ids, E, up_launch.BM, expert_map, backend="triton")
        if dense:
            found = _find_hot(r, P, E, _dense_tile(dev)[0], _dense_rows((g, experts.up, d), dev, rows), dev)
        if rows and found:  # the rotation's format waits for the dense experts
            hot, found = _hot_experts(found), None
            up_launch, down_launch = dot if hot else (up_launch, down_launch)
        # otherwise the GPU rotates while the host waits for the counts of the dense experts
        a0, a1, s0, s1 = _rotate(xp, r.rows, r.sorted_expert, g, experts.up, P, up_launch)
        if found:
            hot = _hot_experts(found)
    grouped = not (hot and hot.every)  # some experts are left to the grouped kernels
    chunks = _without(r.chunks, hot, E) if hot and grouped else r.chunks
    pg = torch.empty(up_launch.split, P, g.n, device=dev, dtype=torch.float32)
    pu = torch.empty_like(pg)
    if grouped:
        _gemm(a0, a1, chunks, g, pg, pu, experts.up, up_launch)
    _dense_products(hot, a0, a1, g, experts.up, pg, pu)
    mid, mid_sums = _act_buffer(P, g.n, down_launch, dev), _sums(P, g.n, d, dev)
    BM, warps = epilogue_launch(P, ACT_ROWS)
    act_epilogue[(-(-P // BM), g.n // 128)](pg, pu, s0, s1, r.sorted_expert, g.svh, experts.up.svh, d.suh,
                                            _had(str(dev)), mid, mid_sums, P, g.n, experts.intermediate, E,
                                            float(limit or 0.0), g.k // 128, HAS_LIMIT=limit is not None,
                                            MUL1_H=_mul1_h(g), SUMS=_mul1_h(d),
                                            SPLIT=up_launch.split, BM=BM, num_warps=warps)
    pd = torch.empty(down_launch.split, P, d.n, device=dev, dtype=torch.float32)
    if grouped:
        _gemm(mid, mid, chunks, d, pd, None, None, down_launch)
    _dense_products(hot, mid, None, d, None, pd, None)
    out = torch.empty(M, experts.hidden, device=dev, dtype=x.dtype)
    args = (pd, mid_sums, r.slot_pos, r.slot_expert, topk_weights.reshape(-1), d.svh, _had(str(dev)), out, M, P,
            d.n, experts.hidden, d.k // 128)
    mul1_h = _mul1_h(d)
    if M <= COMBINE_STACKED:
        TP = 1 << (top_k - 1).bit_length()
        BT = max(1, (8 if M <= COMBINE_FEW else 16) // TP)  # tokens whose slots make one product
        combine_stacked[(-(-M // BT), d.n // 128)](*args, TOPK=top_k, MUL1_H=mul1_h, TP=TP,
                                                   SPLIT=down_launch.split, BT=BT, num_warps=epilogue_launch(M)[1])
    else:
        BM, warps = epilogue_launch(M)
        combine_epilogue[(-(-M // BM), d.n // 128)](*args, TOPK=top_k, MUL1_H=mul1_h, SPLIT=down_launch.split,
                                                    BM=BM, num_warps=warps)
    return out
