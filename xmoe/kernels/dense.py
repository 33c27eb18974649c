"""The dense path: in prefill-sized calls, experts with many rows are decoded to fp16 once and multiplied densely,
instead of being decoded again for every chunk of rows. The dense experts are found on the device (hot_experts)
and only their counts are read back; the decoded weights go through dense_gemm in groups."""
from dataclasses import dataclass
from functools import lru_cache

import torch

from .launch import CODEBOOK_ID, MASK, mul1_h, windows
from .plan import is_tiled, mma_refusal, target_of
from .routing import Routing, aligned_rows, chunk_bound
from .tuning import DEFAULT, Tile, Tuning
from .weights import Exl3Weight

DECODE_BK, DECODE_BN = 32, 128  # decode_weights' block: the fastest of six shapes timed (docs/kernels.md)
DECODE_STEPS = 8  # gluon_mma.decode_weights: blocks of DECODE_BK rows a program


def decode_experts(w: Exl3Weight, ids: torch.Tensor, mul1_h: bool = False, on_mma: bool | None = None,
                   tuning: Tuning = DEFAULT) -> torch.Tensor:
    """(len(ids), k, n) fp16: the decoded weights W-hat (before the Hadamards and scales) of experts `ids`
    (int32, on w's device; [0] for a single layer); with mul1_h, mul1's h instead of its weights, as the GEMM
    kernels take them. on_mma: decoded as grouped_mma decodes (gluon_mma.decode_weights), where it can run
    unless said."""
    if on_mma is None:
        on_mma = mma_refusal(w.K, target_of(w.trellis.device), tuning) is None
    return (_decode_lanes if on_mma else _decode_tiles)(w, ids, mul1_h, tuning)


def _decode_lanes(w: Exl3Weight, ids: torch.Tensor, mul1_h: bool, tuning: Tuning) -> torch.Tensor:
    from .gluon_mma import decode_weights
    words = w.trellis.view(torch.int32)
    out = torch.empty(len(ids), w.k, w.n, device=words.device, dtype=torch.float16)
    stride_te = words[0].numel() if w.experts else 0
    decode_weights[(-(-w.k // (DECODE_BK * DECODE_STEPS)), w.n // DECODE_BN, len(ids))](
        words, ids, out, w.k, w.n, stride_te, MASK, W=words.shape[-1], CB=CODEBOOK_ID[w.codebook], BN=DECODE_BN,
        BK=DECODE_BK, STEPS=DECODE_STEPS, MUL1_H=mul1_h, num_warps=4)
    return out


def _decode_tiles(w: Exl3Weight, ids: torch.Tensor, mul1_h: bool, tuning: Tuning) -> torch.Tensor:
    from .triton_gemm import decode_weights
    words = w.trellis.view(torch.int32)
    tiled = is_tiled(w.K, tuning)
    out = torch.empty(len(ids), w.k, w.n, device=words.device, dtype=torch.float16)
    stride_te = words[0].numel() if w.experts else 0
    decode_weights[(w.k // DECODE_BK, w.n // DECODE_BN, len(ids))](
        words, ids, windows(w.K, str(words.device)), out, w.k, w.n, stride_te, W=words.shape[-1],
        CB=CODEBOOK_ID[w.codebook], BK=DECODE_BK, BN=DECODE_BN, TILED=tiled, KLOG=int(w.K).bit_length() - 1 if tiled
        else 1, MUL1_H=mul1_h, ASM=words.device.type == "cuda")
    return out


def mm32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b in fp32 from fp16 weights and fp16 or fp32 rows (fp32 accumulation, as the Triton kernels)."""
    if a.is_cuda and a.dtype == b.dtype:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


@dataclass(frozen=True)
class Hot:
    """The experts of a call that go dense: flags (experts + 1,) int32, 1 for dense; per group of the tuning's
    dense_group, (ids, pos, length, slot): the experts and dense_gemm's chunks (first sorted position, rows, index
    in the group), all on the device."""
    flags: torch.Tensor
    groups: list
    every: bool  # no expert is left to the grouped kernels


def find_hot(r: Routing, P: int, experts: int, BM: int, rows: int, tuning: Tuning, device: torch.device) -> tuple:
    """Finds the call's dense experts on the device (hot_experts, from the routing's runs) and starts copying their
    counts to the host; returns what hot_experts() reads. Work queued after this call does not delay the read."""
    import triton
    from .triton_route import hot_experts as kernel
    runs = r.runs
    if runs is None:  # route_small's routing: count the slots (a scatter: bincount reads its maximum back)
        slot = r.slot_expert.long() + 1  # 0: other ranks' slots
        counts = torch.zeros(experts + 1, dtype=torch.long, device=slot.device)
        ends = counts.scatter_add_(0, slot, torch.ones_like(slot))[1:].cumsum(0)
        runs = torch.stack([ends - counts[1:], ends]).int()
    G = tuning.dense_group
    GB = triton.next_power_of_2(-(-experts // G))
    flags = torch.empty(experts + 1, dtype=torch.int32, device=device)
    ids = torch.empty(experts, dtype=torch.int32, device=device)
    table = aligned_rows(3, chunk_bound(P, BM, experts), device)
    counts = torch.empty(2 + GB, dtype=torch.int32, device=device)
    kernel[(1,)](runs, flags, ids, table, counts, experts, rows, tuning.dense_rest, runs.stride(0), table.stride(0),
                 BM=BM, G=G, EB=triton.next_power_of_2(experts + 1), GB=GB, num_warps=4)
    done = None
    if device.type == "cuda":
        counts = _host_counts(counts.numel(), str(device)).copy_(counts, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    return flags, ids, table, counts, done, G


@lru_cache(maxsize=None)
def _host_counts(n: int, device: str) -> torch.Tensor:
    """Pinned host memory that find_hot's counts come back to: one buffer, reused, as each call reads it before
    the next can write it."""
    return torch.empty(n, dtype=torch.int32, pin_memory=True)


def hot_experts(found: tuple) -> Hot | None:
    """The call's dense experts (Hot), None if there are none, from find_hot's tables: waits for its counts alone;
    the tables stay on the device, cut into groups by the counts. Only for eager calls."""
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


def without(chunks: tuple, hot: Hot, experts: int) -> tuple:
    """The chunk table without the hot experts' chunks (those go to dense_products), on the device."""
    pos, length, expert, count, bound = chunks
    keep = (torch.arange(bound + 1, device=pos.device) < count) & (hot.flags[expert.long().clamp(0, experts)] == 0)
    order = torch.argsort((~keep).int(), stable=True)
    return pos[order], length[order], expert[order], keep.sum().int().reshape(1), bound


def dense_products(hot: Hot | None, pairs: list, tile: Tile, tma: bool, tuning: Tuning) -> None:
    """For each hot expert and each (a, w, p, on_mma) of `pairs`, p[0, rows] = a[rows] @ W-hat_e and the other K
    splits zeroed, as the epilogues sum them. Per group and projection one decode and one dense_gemm launch: a
    matmul per expert made prefill host-bound (72 of them at 1,542 skewed tokens)."""
    if hot is None:
        return
    from triton.tools.tensor_descriptor import TensorDescriptor
    from .triton_dense import dense_gemm, dense_gemm_tma
    kernel = dense_gemm_tma if tma else dense_gemm

    def operand(t: torch.Tensor, block: list):  # a 2-D matrix as the kernel reads it
        return TensorDescriptor.from_tensor(t, block) if tma else t

    rows = [(operand(a, [tile.BM, tile.BK]), w, p, on_mma) for a, w, p, on_mma in pairs]
    for ids, pos, length, slot in hot.groups:
        for a, w, p, on_mma in rows:
            weights = decode_experts(w, ids, mul1_h(w), on_mma, tuning).view(-1, w.n)  # (experts * k, n)
            kernel[(len(pos), -(-w.n // tile.BN))](a, operand(weights, [tile.BK, tile.BN]), pos, length, slot, p,
                                                   p.shape[1], w.k, w.n, SPLIT=p.shape[0], BM=tile.BM, BN=tile.BN,
                                                   BK=tile.BK, num_warps=tile.warps, num_stages=tile.stages)

