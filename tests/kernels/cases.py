"""Random EXL3 layers and experts for kernel tests (any trellis bits decode to valid weights)."""
import torch

from xmoe.format.layer import padded
from xmoe.kernels.weights import Exl3Experts, Exl3Weight


def random_weight(in_features: int, out_features: int, K: float, codebook: str, experts: int = 0,
                  seed: int = 0, device="cpu") -> Exl3Weight:
    g = torch.Generator(device).manual_seed(seed)
    k, n = padded(in_features), padded(out_features)
    lead = (experts,) if experts else ()
    kw = dict(generator=g, device=device)
    trellis = torch.randint(-32768, 32768, (*lead, k // 16, n // 16, int(16 * K)), dtype=torch.int16, **kw)
    suh = (torch.rand(*lead, k, **kw) + 0.5) * (torch.randint(0, 2, (*lead, k), **kw) * 2 - 1)
    svh = (torch.rand(*lead, n, **kw) + 0.5) * (torch.randint(0, 2, (*lead, n), **kw) * 2 - 1) / k ** 0.5
    return Exl3Weight(trellis, suh.half(), svh.half(), K, codebook, in_features, out_features)


def random_experts(E: int, hidden: int, intermediate: int, K: float, codebook: str, K_down: float | None = None,
                   seed: int = 0, device="cpu") -> Exl3Experts:
    return Exl3Experts(random_weight(hidden, intermediate, K, codebook, E, seed, device),
                       random_weight(hidden, intermediate, K, codebook, E, seed + 1, device),
                       random_weight(intermediate, hidden, K_down or K, codebook, E, seed + 2, device))


def routing(M: int, E: int, top_k: int, skew: bool, seed: int = 0, device="cpu"):
    """(topk_ids int64, topk_weights fp32): distinct experts per token; skewed routing favours a few."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, E, generator=g)
    if skew:
        logits[:, : max(1, E // 16)] += 4.0
    w, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)
