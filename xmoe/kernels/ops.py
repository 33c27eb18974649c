"""The one import surface of xmoe.kernels: EXL3 linear layers and fused MoE, torch reference or Triton.

Backends are chosen explicitly: "torch" (the reference, any device), "triton" (CUDA GPUs, or the CPU under
TRITON_INTERPRET=1), or "auto", which takes Triton where it can run, says so once, and otherwise the torch
reference. Asking for Triton where it cannot run is an error that says why; nothing falls back silently.
Launch settings come from a Tuning (tuning.py): every entry point takes one, else the device's from the table.
"""
import itertools
import logging
import os
import weakref
from functools import lru_cache

import torch

from . import dense as D
from . import launch as L
from .dense import decode_experts
from .moe import fused_moe_triton
from .plan import eager, plan_linear, target_of
from .reference import activation_ref, exl3_linear_ref, exl3_slices_ref, fused_moe_ref
from .tuning import DEFAULT, Tile, Tuning, tuning_for
from .warmup import warm_up_linear, warm_up_moe
from .weights import Exl3Experts, Exl3Slices, Exl3Weight

__all__ = ["BACKENDS", "DEFAULT", "Exl3Experts", "Exl3Slices", "Exl3Weight", "Tile", "Tuning", "activation_ref",
           "decode_experts", "exl3_linear", "exl3_linear_op", "exl3_linear_slices", "fused_moe", "pick_backend",
           "register_linear", "triton_refusal", "tuning_for", "warm_up_linear",
           "warm_up_moe"]
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


def exl3_linear(x: torch.Tensor, w: Exl3Weight, bias: torch.Tensor | None = None, backend: str = "auto",
                tuning: Tuning | None = None) -> torch.Tensor:
    """y = x W + bias for x (..., in_features) fp16/bf16/fp32; returns (..., out_features) in x's dtype."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"exl3_linear: input has {x.shape[-1]} features, the layer takes {w.in_features}")
    if w.experts:
        raise ValueError("exl3_linear: takes one layer, got a stack of experts")
    if pick_backend(backend, x.device) == "torch":
        return exl3_linear_ref(x.reshape(-1, x.shape[-1]), w, bias).reshape(*x.shape[:-1], w.out_features)
    a = L.padded_rows(x, w.k)
    M, dev = a.shape[0], x.device
    tuning = tuning or tuning_for(str(dev))
    L.eager_tables((w,), dev)
    plan = plan_linear(M, w, target_of(dev), tuning, 1, eager(dev))
    chunks, rows, zeros = L.row_chunks(M, plan.launch.BM, dev)
    a0, _, sums, _ = L.rotate(a, rows, zeros, w, None, M, plan.launch, plan.programs)
    if plan.dense:  # decoded once for all rows
        part = torch.empty(1, M, w.n, device=dev, dtype=torch.float32)
        D.mm32(a0, decode_experts(w, zeros[:1], L.mul1_h(w), plan.decode_mma, tuning)[0], part[0])
    else:
        part = torch.empty(plan.launch.split, M, w.n, device=dev, dtype=torch.float32)
        L.gemm(a0, a0, chunks, w, part, None, None, plan.launch, tuning)
    out = torch.empty(M, w.out_features, device=dev, dtype=x.dtype)
    L.linear_epilogue(part, sums, w.svh, bias, out, M, w, plan.programs)
    return out.reshape(*x.shape[:-1], w.out_features)


def exl3_linear_slices(x: torch.Tensor, slices: Exl3Slices, backend: str = "auto",
                       tuning: Tuning | None = None) -> torch.Tensor:
    """Every layer of `slices` on x (..., in_features): (..., their outputs side by side) in x's dtype. Below the
    dense path's rows one launch each of rotation, GEMM and epilogue takes all slices (each slice rotating its own
    copy of the rows); from there each layer's slices are decoded once and multiplied as exl3_linear does."""
    w = slices.stack
    if x.shape[-1] != w.in_features:
        raise ValueError(f"exl3_linear_slices: input has {x.shape[-1]} features, the layers take {w.in_features}")
    if pick_backend(backend, x.device) == "torch":
        return exl3_slices_ref(x.reshape(-1, x.shape[-1]), slices).reshape(*x.shape[:-1], slices.out_features)
    a = L.padded_rows(x, w.k)
    M, S, dev = a.shape[0], w.experts, x.device
    tuning = tuning or tuning_for(str(dev))
    L.eager_tables((w,), dev)
    plan = plan_linear(M, w, target_of(dev), tuning, S, eager(dev))
    out = torch.empty(M, slices.out_features, device=dev, dtype=x.dtype)
    if plan.dense:
        _, rows, zeros = L.row_chunks(M, plan.launch.BM, dev)
        ids = torch.arange(S, device=dev, dtype=torch.int32)
        weights = decode_experts(w, ids, L.mul1_h(w), plan.decode_mma, tuning)  # (S, k, width)
        for layer in range(len(slices.widths)):
            s0, s1 = slices.bounds(layer)
            # the layer's suh: its first slice's
            a0, _, sums, _ = L.rotate(a, rows, zeros + s0, w, None, M, plan.launch, plan.programs)
            part = torch.empty(1, M, (s1 - s0) * w.n, device=dev, dtype=torch.float32)
            D.mm32(a0, weights[s0:s1].transpose(0, 1).reshape(w.k, -1), part[0])
            L.linear_epilogue(part, sums, w.svh[s0:s1], None, out[:, s0 * w.n:s1 * w.n], M, w, plan.programs)
    else:
        chunks, rows, expert = L.row_chunks(M, plan.launch.BM, dev, S)
        a0, _, sums, _ = L.rotate(a, rows, expert, w, None, S * M, plan.launch, plan.programs)
        part = torch.empty(plan.launch.split, S * M, w.n, device=dev, dtype=torch.float32)
        L.gemm(a0, a0, chunks, w, part, None, None, plan.launch, tuning)
        L.linear_epilogue(part, sums, w.svh, None, out, M, w, plan.programs)
    return out.reshape(*x.shape[:-1], slices.out_features)


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Exl3Experts,
              limit: float | None = None, expert_map: torch.Tensor | None = None, backend: str = "auto",
              tuning: Tuning | None = None) -> torch.Tensor:
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
    return fused_moe_triton(x, topk_ids, topk_weights, experts, limit, expert_map, tuning)


# Registered layers' EXL3 weights by index. torch.compile (vLLM compiles every model with it) must not trace the
# kernels' host code (planning, tables, file reads): exl3_linear_op is one opaque op that sees only its input and
# the index here. An entry lives as long as the layer that registered it.
_KERNELS: dict = {}
_NEXT_INDEX = itertools.count()


def _run(x: torch.Tensor, weights, backend: str) -> torch.Tensor:
    """Exl3Slices as one set of launches, or a list of Exl3Weight one by one, outputs side by side."""
    if isinstance(weights, Exl3Slices):
        return exl3_linear_slices(x, weights, backend=backend)
    y = [exl3_linear(x, w, backend=backend) for w in weights]
    return y[0] if len(y) == 1 else torch.cat(y, dim=-1)


def _out_features(weights) -> int:
    return weights.out_features if isinstance(weights, Exl3Slices) else sum(w.out_features for w in weights)


@torch.library.custom_op("xmoe::exl3_linear", mutates_args=())
def exl3_linear_op(x: torch.Tensor, index: int, backend: str) -> torch.Tensor:
    return _run(x, _KERNELS[index], backend)


@exl3_linear_op.register_fake
def _(x: torch.Tensor, index: int, backend: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _out_features(_KERNELS[index]))


def register_linear(weights, owner=None) -> int:
    """The index under which exl3_linear_op finds `weights` (an Exl3Slices or a list of Exl3Weight); with
    `owner`, the entry is dropped when the owner is garbage-collected (a process may load many models)."""
    index = next(_NEXT_INDEX)
    _KERNELS[index] = weights
    if owner is not None:
        weakref.finalize(owner, _KERNELS.pop, index, None)
    return index
