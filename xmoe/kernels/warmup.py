"""Compile the fused MoE's (and dense EXL3 layers') Triton kernels before a server takes requests.

Each kernel variant compiles at its first launch, which takes seconds. vLLM's start-up launches the batch sizes it
captures in CUDA graphs and one batch of its largest size, but not the sizes in between, which mixed prefill and
decode batches reach all the time: without a warm-up, every request in flight stalls while a new size compiles.
Token counts with the same launch_key launch the same variants, so one call per distinct key over 1..max_tokens
compiles them all; a call that may take the dense path gets a second one whose routing sends half its tokens to
the same few experts, which compiles the dense kernels too.
"""
import dataclasses
import logging
import time

import torch

from .plan import Target, plan_linear, plan_moe, target_of
from .routing import ROUTE_SLOTS
from .tuning import Tuning, tuning_for
from .weights import Exl3Experts, Exl3Slices, Exl3Weight

log = logging.getLogger(__name__)
_WARM: set = set()  # what this process has warmed up: device, shapes, K, codebooks, dtypes, batch limit


def launch_key(tokens: int, top_k: int, experts: Exl3Experts, target: Target, tuning: Tuning) -> tuple:
    """What decides the kernel variants a call of `tokens` tokens launches: its plan but the count; the routing
    kernels' slot block (a power of two); and the count's and slots' divisibility by 16 and being 1, which Triton
    specializes integer arguments on."""
    plan = plan_moe(tokens, top_k, experts, target, tuning, True)
    slots = tokens * top_k
    block = max(16, 1 << (slots - 1).bit_length()) if slots <= ROUTE_SLOTS else 0
    return dataclasses.replace(plan, tokens=0, slots=0), block, tokens == 1, tokens % 16 == 0, slots % 16 == 0


def linear_key(rows: int, w: Exl3Weight, slices: int, target: Target, tuning: Tuning) -> tuple:
    """launch_key's counterpart for a dense layer: its plan but the count, and the count's specialization."""
    plan = plan_linear(rows, w, target, tuning, slices, True)
    return dataclasses.replace(plan, rows=0), rows == 1, rows % 16 == 0


def smallest_per_key(key, max_tokens: int) -> dict[int, tuple]:
    """{count: key(count)} for the smallest count of each distinct key over 1..max_tokens (planned as eager calls,
    as the sizes between vLLM's CUDA-graph sizes run)."""
    first: dict = {}
    for n in range(1, max_tokens + 1):
        first.setdefault(key(n), n)
    return {n: k for k, n in sorted(first.items(), key=lambda item: item[1])}


def plan_sizes(experts: Exl3Experts, top_k: int, max_tokens: int, target: Target, tuning: Tuning) -> list[int]:
    """The smallest token count of each distinct launch_key over 1..max_tokens."""
    return list(smallest_per_key(lambda n: launch_key(n, top_k, experts, target, tuning), max_tokens))


def _done(dev: torch.device, key: tuple, what: str, sizes: list[int], t0: float) -> list[int]:
    if dev.type == "cuda":  # and give the warm-up's buffers back before vLLM sizes its cache
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    _WARM.add(key)
    log.info("exl3: %s kernels warmed up at %d sizes in %.1f s", what, len(sizes), time.perf_counter() - t0)
    return sizes


def routings(tokens: int, top_k: int, count: int, dense: bool, generator: torch.Generator) -> list[torch.Tensor]:
    """topk_ids of the warm-up calls at `tokens`: spread over all `count` experts, and where the call may go dense
    also half of the tokens on experts 0..top_k-1 (hot: decoded once) and the rest spread (the grouped kernels)."""
    spread = torch.rand(tokens, count, generator=generator).argsort(-1)[:, :top_k]
    if not dense:
        return [spread]
    mixed = spread.clone()
    mixed[: tokens // 2] = torch.arange(top_k)
    return [spread, mixed]


def warm_up_moe(experts: Exl3Experts, top_k: int, max_tokens: int, dtype: torch.dtype,
                expert_map: torch.Tensor | None = None, limit: float | None = None,
                ids_dtype: torch.dtype = torch.int32, tuning: Tuning | None = None) -> list[int]:
    """Launch fused_moe once per distinct launch_key (twice where it may go dense) on random inputs, `dtype`
    activations and `ids_dtype` expert ids (vLLM's routers give int32; Triton compiles per pointer type); returns
    the token counts launched, [] if this process has already warmed up the same shapes, K and codebooks."""
    from .ops import fused_moe
    dev = experts.gate.trellis.device
    key = (str(dev), top_k, max_tokens, expert_map is not None, dtype, ids_dtype, tuning,
           tuple((w.experts, w.k, w.n, w.K, w.codebook) for w in (experts.gate, experts.up, experts.down)))
    if key in _WARM:
        return []
    t0, tuning, target = time.perf_counter(), tuning or tuning_for(str(dev)), target_of(dev)
    keys = smallest_per_key(lambda n: launch_key(n, top_k, experts, target, tuning), max_tokens)
    count = experts.gate.experts if expert_map is None else expert_map.numel()  # routing ids are global
    g = torch.Generator().manual_seed(0)
    for tokens, (plan, *_) in keys.items():
        x = (torch.randn(tokens, experts.hidden, generator=g) * 0.1).to(dev, dtype)
        share = torch.full((tokens, top_k), 1 / top_k, device=dev)
        for ids in routings(tokens, top_k, count, plan.dense, g):
            fused_moe(x, ids.to(dev, ids_dtype), share, experts, limit, expert_map, "triton", tuning)
    return _done(dev, key, f"fused MoE (1..{max_tokens} tokens)", list(keys), t0)


def linear_sizes(w: Exl3Weight, slices: int, max_tokens: int, target: Target, tuning: Tuning) -> list[int]:
    """The smallest row count of each distinct linear_key over 1..max_tokens."""
    return list(smallest_per_key(lambda n: linear_key(n, w, slices, target, tuning), max_tokens))


def warm_up_linear(weights: "Exl3Slices | list[Exl3Weight]", max_tokens: int, dtype: torch.dtype,
                   tuning: Tuning | None = None) -> list[int]:
    """A dense EXL3 layer's launches (one set of slices, or layers one by one, as ops runs them) once per distinct
    launch over 1..max_tokens rows; returns the row counts run, [] where the same shapes were warmed already."""
    from .ops import exl3_linear, exl3_linear_slices
    parts = [weights.stack] if isinstance(weights, Exl3Slices) else list(weights)
    dev = parts[0].trellis.device
    shapes = tuple((w.experts, w.k, w.n, w.K, w.codebook) for w in parts)
    key = ("linear", str(dev), max_tokens, dtype, tuning, isinstance(weights, Exl3Slices), shapes)
    if key in _WARM:
        return []
    t0, tuning = time.perf_counter(), tuning or tuning_for(str(dev))
    sizes = sorted({n for w in parts for n in linear_sizes(w, max(w.experts, 1), max_tokens, target_of(dev), tuning)})
    g = torch.Generator().manual_seed(0)
    for rows in sizes:
        x = (torch.randn(rows, parts[0].in_features, generator=g) * 0.1).to(dev, dtype)
        if isinstance(weights, Exl3Slices):
            exl3_linear_slices(x, weights, "triton", tuning)
        else:
            for w in parts:
                exl3_linear(x, w, None, "triton", tuning)
    return _done(dev, key, f"dense {shapes[0][1]}x{shapes[0][2]} (1..{max_tokens} rows)", sizes, t0)
