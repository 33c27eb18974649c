"""Plain-torch references of the EXL3 ops: the CPU path and the oracle the Triton kernels are tested against.

Weights are decoded whole (format.decode_weight) and applied with matmuls in fp32; nothing here is tuned.
"""
import torch

from ..format.layer import decode_weight
from .weights import Exl3Experts, Exl3Slices, Exl3Weight


def _pad(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, k - x.shape[-1])) if x.shape[-1] < k else x


def exl3_linear_ref(x: torch.Tensor, w: Exl3Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W + bias for x (M, in_features); returns (M, out_features) in x's dtype."""
    dense = decode_weight(w.tensors())  # (k, n) padded
    y = _pad(x.float(), w.k) @ dense
    y = y[:, :w.out_features]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def exl3_slices_ref(x: torch.Tensor, slices: Exl3Slices) -> torch.Tensor:
    """Every layer of `slices` on x (M, in_features): their outputs side by side, in x's dtype."""
    w = slices.stack
    dense = torch.cat([decode_weight(w.tensors(s)) for s in range(w.experts)], dim=1)  # (k, sum of the widths)
    return (_pad(x.float(), w.k) @ dense).to(x.dtype)


def activation_ref(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SiLU(gate) * up; with a SwiGLU limit (DeepSeek-V4) gate is clamped above and up on both sides."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Exl3Experts,
                  limit: float | None = None, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's experts of weight * down(act(gate(x)) * up(x)).

    x (M, hidden); topk_ids (M, top_k) global expert ids; topk_weights (M, top_k); expert_map (global ->
    local id, -1 where another rank owns the expert) for expert parallelism. Returns (M, hidden), x's dtype.
    """
    local = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
    out = torch.zeros(x.shape[0], experts.hidden, dtype=torch.float32, device=x.device)
    xf = _pad(x.float(), experts.gate.k)
    for e in local.unique().tolist():
        if e < 0:
            continue
        token, slot = (local == e).nonzero(as_tuple=True)
        g = xf[token] @ decode_weight(experts.gate.tensors(e))
        u = xf[token] @ decode_weight(experts.up.tensors(e))
        a = activation_ref(g, u, limit)[:, :experts.intermediate]
        d = _pad(a, experts.down.k) @ decode_weight(experts.down.tensors(e))
        out.index_add_(0, token, d[:, :experts.hidden] * topk_weights[token, slot, None].float())
    return out.to(x.dtype)
