"""Planning a call: which kernel takes each projection, at which tile and K split, how the call routes, whether its
experts may go dense, and the rotation's and epilogues' programs. A plan is a frozen value computed in one place
from the call's sizes, the device (Target) and the Tuning, before anything launches; the launchers only follow it.
"""
import logging
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from .routing import ROUTE_SLOTS, expected_experts
from .tuning import DEFAULT, Tile, Tuning

log = logging.getLogger(__name__)
MMA_K = (1, 1.5, 2, 2.5, 3, 3.5, 4)  # the K grouped_mma decodes
TILED_K = (1, 2, 4, 8)  # the K the tiled decoder decodes
CHUNK_GUESS = 16  # rows a chunk of a dense layer, for its first plan: the chunk count only sets the K split


@dataclass(frozen=True)
class Target:
    """What planning needs to know of a device: its name (for messages), multiprocessors, whether it is a CUDA GPU,
    why Gluon kernels cannot run there at all (None: they can), whether it has a copy engine for tensor
    descriptors (TMA; emulated on the CPU), and a program's shared memory in bytes (0: not limited)."""
    name: str = "cpu"
    sms: int = 4
    gpu: bool = False
    gluon_refusal: str | None = None
    tma: bool = True
    shared_memory: int = 0


@lru_cache(maxsize=None)
def device_target(device: str) -> Target:
    """The Target of a torch device (fixed for the process)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return Target(name=device)
    from triton.runtime import driver
    props = torch.cuda.get_device_properties(dev)
    smem = driver.active.utils.get_device_properties(dev.index or 0)["max_shared_mem"]
    return Target(device, props.multi_processor_count, True, _gluon_refusal(), (props.major, props.minor) >= (9, 0),
                  smem)


def target_of(device: torch.device) -> Target:
    return device_target(str(device))


def eager(device: torch.device) -> bool:
    """Whether a call may read device data back: not while torch.compile traces it or a CUDA graph captures it."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return not torch.compiler.is_compiling() and not capturing


def _gluon_refusal() -> str | None:
    import triton
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6):
        return f"Triton {triton.__version__} (its Gluon API is that of Triton 3.6 and later)"
    return None


@lru_cache(maxsize=None)
def _announce(device: str, what: str, reason: str) -> None:
    log.info("xmoe kernels on %s: %s (%s)", device, what, reason)


def mma_refusal(K: float, target: Target, tuning: Tuning = DEFAULT) -> str | None:
    """Why grouped_mma cannot take products of K bits on `target`, or None when it can (logged once per reason)."""
    if not target.gpu:
        return "Gluon kernels run on CUDA GPUs only"
    if tuning.decoder != "tiled":
        reason = f"the tuning's decoder is {tuning.decoder!r}"
    elif K not in MMA_K:
        reason = f"K = {K} (it decodes K = 1-4 and the half-integer K)"
    else:
        reason = target.gluon_refusal
    if reason:
        _announce(target.name, "grouped_mma not used", reason)
    return reason


def is_tiled(K: float, tuning: Tuning = DEFAULT) -> bool:
    """Whether weights of K bits take the tiled decoder."""
    return tuning.decoder == "tiled" and K in TILED_K


@dataclass(frozen=True)
class Launch:
    """One grouped-GEMM launch: rows per chunk, columns per program, K splits, K block, warps, pipeline stages, and
    the kernel: grouped_mma (mma: weights decoded into mma.sync registers; pair: one projection, two column blocks
    a program), grouped_gemv (tiled and gemv: CUDA cores, chunks of 1-2 rows), else grouped_gemm (tl.dot; tiled:
    each tile's words loaded once, else per-weight gathers; swap: W^T a^T)."""
    BM: int
    BN: int
    split: int
    BK: int = 32
    warps: int = 4
    stages: int = 2
    tiled: bool = False
    swap: bool = False
    gemv: bool = False
    mma: bool = False
    pair: bool = False

    @property
    def kernel(self) -> str:
        return "grouped_mma" if self.mma else "grouped_gemv" if self.tiled and self.gemv else "grouped_gemm"


def regime(rows: float, tiled: bool = True, mma: bool = False, rows_mma: float | None = None, mid: bool = False,
           tuning: Tuning = DEFAULT) -> str:
    """The kernel and tile for `rows` expected rows per chunk: grouped_mma ("mma_decode"; for dense layers, `mid`,
    "mma_mid"; "mma_prefill" up to `rows_mma`, else the tuning's limit, unless the tiled decoder's tl.dot keeps
    the call), grouped_gemv ("gemv", tiled decoder only), else tl.dot ("decode" for a few rows, "prefill")."""
    t = tuning
    if mma and rows <= t.mma_decode_max_rows:
        return "mma_decode"
    if mma and mid and rows <= t.mma_mid_max_rows:
        return "mma_mid"
    if mma and rows <= (rows_mma or t.mma_prefill_max_rows) and not (tiled and rows <= t.tiled_dot_max_rows):
        return "mma_prefill"
    if tiled and rows <= t.gemv_max_rows:
        return "gemv"
    return "decode" if rows <= t.dot_decode_max_rows else "prefill"


def tile_name(mode: str, tiled: bool) -> str:
    """The Tuning field of a regime's tile: tl.dot's decode and prefill tiles per decoder."""
    return ("dot_" if tiled else "gather_") + mode if mode in ("decode", "prefill") else mode


def tile_of(mode: str, tiled: bool, tuning: Tuning = DEFAULT) -> Tile:
    return getattr(tuning, tile_name(mode, tiled))


def plan_gemm(chunks: int, n: int, k: int, rows: float, sms: int, K: float = 2, gemv: bool = True,
              mma: bool = False, rows_mma: float | None = None, mid: bool = False, single: bool = False,
              tuning: Tuning = DEFAULT) -> Launch:
    """The launch of a grouped GEMM over about `chunks` chunks of `rows` rows (gemv=False: neither grouped_gemv nor
    grouped_mma; mma: grouped_mma can run; rows_mma, mid: regime's; single: one projection, which "mma_decode"
    takes in pairs of column blocks where they still fill the GPU): the regime's tile, and enough K splits to give
    each multiprocessor about the tile's `fill` programs."""
    tiled = is_tiled(K, tuning)
    mode = regime(rows, tiled and gemv, gemv and mma, rows_mma, mid, tuning)
    on_mma = mode.startswith("mma")
    tile = tile_of(mode, tiled or on_mma, tuning)
    BN = min(tile.BN, n)
    while n % BN:  # n is a multiple of 128, BN a power of two: every column block whole
        BN //= 2
    steps = k // tile.BK
    decode_mma = mode == "mma_decode"
    most = min(steps, tuning.split_most_moe if decode_mma and not mid else tuning.split_most)
    if decode_mma:  # too few steps a program and its start and stores outweigh a fuller GPU
        most = max(1, min(most, steps // tuning.mma_min_steps))
    blocks = max(chunks, 1) * (n // BN)  # programs a K split
    pair = (tuning.mma_pair and single and decode_mma and n // BN % 2 == 0
            and blocks // 2 * most >= tile.fill * sms)  # pairs still fill the GPU
    split = max(1, min(most, -(-tile.fill * sms // (blocks // (1 + pair)))))
    split = -(-steps // -(-steps // split))  # no split left without steps (the kernels give each ceil(steps / split))
    swap = tiled and mode in ("decode", "prefill") and tile.swap
    return Launch(tile.BM, BN, split, tile.BK, tile.warps, tile.stages, tiled, swap, mode == "gemv", on_mma, pair)


def wide_mma(launch: Launch, tuning: Tuning = DEFAULT) -> bool:
    """Whether a launch is grouped_mma in chunks wider than its decode chunks (16 or 32 rows: "mma_mid",
    "mma_prefill"), which launch gate and up one after the other, at their own registers."""
    return launch.mma and launch.BM > tuning.mma_decode.BM


def epilogue_launch(rows: int, small_rows: int | None = None, tuning: Tuning = DEFAULT) -> tuple:
    """(rows, warps) a program of the rotation and the epilogues of a call of `rows` rows; small_rows replaces the
    few-rows launch's rows (act_epilogue's, route_rotate's)."""
    if rows > tuning.epilogue_few_max_rows:
        return tuning.epilogue_many_rows, tuning.epilogue_many_warps
    return small_rows or tuning.epilogue_few_rows, tuning.epilogue_few_warps


def dense_tile(target: Target, tuning: Tuning = DEFAULT) -> Tile:
    """dense_gemm's tile with as many pipeline stages as a program's shared memory holds (99 KB on sm_89 and
    sm_120)."""
    t = tuning.dense
    if target.shared_memory:
        return replace(t, stages=max(1, min(t.stages, target.shared_memory // ((t.BM + t.BN) * t.BK * 2))))
    return t


def dense_call(rows: int, launch: Launch, codebook: str, eager_call: bool, tuning: Tuning = DEFAULT) -> bool:
    """Whether a call of `rows` rows may take the dense path (and read the routing back): prefill-sized eager calls,
    not with grouped_mma's launch, whose activations (doubled fp16) the dense product does not read, nor at mul1
    with grouped_gemv's fp32 ones: the epilogue would take the sums of values the dense product reads in fp16."""
    if not eager_call or launch.mma or (launch.gemv and codebook == "mul1"):
        return False
    return rows >= tuning.dense_rows


@dataclass(frozen=True)
class LinearPlan:
    """A dense layer's call (or a set of layers' slices): its GEMM, whether it goes dense (decoded once, then a
    matmul; decoded by gluon_mma where `decode_mma`), and (rows, warps) a program of its rotation and epilogue."""
    rows: int
    launch: Launch
    dense: bool
    decode_mma: bool
    programs: tuple


def plan_linear(rows: int, w, target: Target, tuning: Tuning = DEFAULT, slices: int = 1,
                eager_call: bool = True) -> LinearPlan:
    """The plan of exl3_linear (slices 1) or exl3_linear_slices over weights w (Exl3Weight) for `rows` rows."""
    mma = mma_refusal(w.K, target, tuning) is None
    # without the tiled decoder, grouped_mma's chunks reach up to the dense path's rows: it decodes K = 3 faster
    # than the gather decoder at 64 rows
    rows_mma = None if is_tiled(w.K, tuning) or not tuning.mma_prefill_max_rows else tuning.dense_rows - 1
    launch = plan_gemm(slices * -(-rows // CHUNK_GUESS), w.n, w.k, rows, target.sms, w.K, mma=mma,
                       rows_mma=rows_mma, mid=True, single=True, tuning=tuning)
    dense = dense_call(rows, launch, w.codebook, eager_call, tuning)
    return LinearPlan(rows, launch, dense, dense and mma,
                      epilogue_launch(rows if dense else slices * rows, tuning=tuning))


@dataclass(frozen=True)
class MoePlan:
    """A fused_moe call: the launches of gate and up (together) and of down, over the same chunks; the tl.dot
    launches that replace them where the call is on grouped_mma's prefill chunks and some experts go dense (the
    rotation then waits for the dense experts, its format being the GEMM's); whether experts may go dense (from
    dense_rows rows, decoded by gluon_mma per projection where decode_mma, multiplied at dense_tile, by tensor
    descriptors where tma); the routing ("route_rotate", "route_small" or "route_counted"); (rows, warps) a
    program of the rotation and of act_epilogue; and the combine: (kernel, tokens a program, warps)."""
    tokens: int
    slots: int
    gate_up: Launch
    down: Launch
    dense_gate_up: Launch | None
    dense_down: Launch | None
    dense: bool
    dense_rows: int
    decode_mma: tuple
    dense_tile: Tile
    tma: bool
    route: str
    rotate: tuple
    act: tuple
    combine: tuple


def plan_moe(tokens: int, top_k: int, experts, target: Target, tuning: Tuning = DEFAULT,
             eager_call: bool = True) -> MoePlan:
    """The plan of a fused_moe call of `tokens` tokens routed to top_k of `experts` (Exl3Experts), planned for
    uniform routing (the real routing is known only on the device)."""
    P, E = tokens * top_k, experts.count
    g, d = experts.gate, experts.down
    unique = expected_experts(P, E)

    def gemm(w, **kw) -> Launch:
        return plan_gemm(unique, w.n, w.k, P / unique, target.sms, w.K, tuning=tuning, **kw)

    mma = mma_refusal(g.K, target, tuning) is None and mma_refusal(d.K, target, tuning) is None
    gate_up, down = gemm(g, mma=mma), gemm(d, mma=mma, single=True)
    if (gate_up.gemv, gate_up.mma) != (down.gemv, down.mma):  # mixed K: one chunking serves both, on tl.dot
        gate_up, down = gemm(g, gemv=False), gemm(d, gemv=False)
    down = replace(down, BM=gate_up.BM)  # the same chunks, so the same BM
    wide = wide_mma(gate_up, tuning)
    dot = tuple(replace(gemm(w, gemv=False), BM=gate_up.BM) for w in (g, d)) if wide else (None, None)
    dense = dense_call(tokens, dot[0] if wide else gate_up, g.codebook, eager_call, tuning)
    dense_rows, decode_mma = tuning.dense_rows, (False, False, False)
    if dense:
        weights = (g, experts.up, d)
        decode_mma = tuple(mma_refusal(w.K, target, tuning) is None for w in weights)
        # where a projection has no tiled grouped decoder but gluon_mma's dense one (K = 3, the half-integer K),
        # from fewer rows, unless grouped_mma's prefill chunks take the call's other experts
        if not wide and any(not is_tiled(w.K, tuning) and on for w, on in zip(weights, decode_mma)):
            dense_rows = tuning.dense_rows_untiled
    if P <= min(tuning.route_rotate_max_slots, ROUTE_SLOTS) and not dense:
        route, rotate = "route_rotate", epilogue_launch(P, tuning.route_rotate_rows, tuning)
    else:
        route, rotate = "route_small" if P <= ROUTE_SLOTS else "route_counted", epilogue_launch(P, tuning=tuning)
    if tokens <= tuning.combine_stacked_max_tokens:
        stacked = (8 if tokens <= tuning.combine_few_max_tokens else 16) // (1 << (top_k - 1).bit_length())
        combine = ("combine_stacked", max(1, stacked), epilogue_launch(tokens, tuning=tuning)[1])
    else:
        combine = ("combine_epilogue", *epilogue_launch(tokens, tuning=tuning))
    return MoePlan(tokens, P, gate_up, down, *dot, dense, dense_rows, decode_mma,
                   dense_tile(target, tuning) if dense else tuning.dense, tuning.dense_tma and target.tma, route, rotate,
                   epilogue_launch(P, tuning.act_rows, tuning), combine)
