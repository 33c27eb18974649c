"""Tail-biting Viterbi over all 2^16 trellis states, in plain torch (the reference encoder).

Costs are fp32. A state s_p keeps the low 16 - D bits of s_{p-1} and adds D new bits (D = K, or K +-
0.5 alternating for half-integer K), so the best cost of reaching s_p is err(s_p) plus the minimum over
the D high bits of the predecessor.

Tail-biting: pass 1 runs unconstrained from `warmup` positions before the wrap to `warmup` positions
after it and traces back the state at position 255; pass 2 runs 0..255 with s_0 forced to continue
that state's low bits and ends on a state that has them, so the path closes on itself.
"""
import torch

from ..format.codebook import codebook_table
from ..format.trellis import _layout

STATES = 1 << 16


def _step(prev: torch.Tensor, err: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prev (T, 65536) costs of s_{p-1}, err (T, 65536) of s_p -> new costs, backpointers (T, 2^(16-D))."""
    best, arg = prev.view(-1, 1 << D, STATES >> D).min(dim=1)
    new = (err.view(-1, STATES >> D, 1 << D) + best[..., None]).view(-1, STATES)
    return new, arg.to(torch.uint8)


def _trace(bps: list, Ds: list, last: torch.Tensor) -> torch.Tensor:
    """Walk backpointers from full states `last` (T,) at the final step; returns (T, steps) states."""
    out = [last]
    s = last
    for bp, D in zip(reversed(bps), reversed(Ds)):
        node = s >> D
        s = (bp.gather(1, node[:, None])[:, 0].to(torch.int64) << (16 - D)) | node
        out.append(s)
    return torch.stack(out[::-1], dim=1)


def _run(tiles, values, positions, D, first_cost):
    """Forward pass over `positions`; returns final costs and backpointers of steps after the first."""
    cost = (values[None, :] - tiles[:, positions[0], None]) ** 2 + first_cost
    bps = []
    for p in positions[1:]:
        err = (values[None, :] - tiles[:, p, None]) ** 2
        cost, bp = _step(cost, err, int(D[p]))
        bps.append(bp)
    return cost, bps


def viterbi_torch(tiles: torch.Tensor, K: float, codebook: str, warmup: int = 128) -> torch.Tensor:
    """tiles: float32 (T, 256) in trellis order -> int64 states (T, 256) of a closed trellis path."""
    dev = tiles.device
    values = codebook_table(codebook, dev).float()
    D, _ = _layout(K)
    all_states = torch.arange(STATES, device=dev)

    # Pass 1: positions 256-warmup .. 255, 0 .. warmup-1, no constraint.
    order = [(p - warmup) % 256 for p in range(2 * warmup)]
    cost, bps = _run(tiles, values, order, D, 0.0)
    path = _trace(bps, [int(D[p]) for p in order[1:]], cost.argmin(dim=1))
    s255 = path[:, warmup - 1]

    # Pass 2: 0..255 with s_0 continuing s_255's low bits.
    D0 = int(D[0])
    keep = (1 << (16 - D0)) - 1
    link = s255[:, None] & keep
    allowed = (all_states[None, :] >> D0) == link  # s_0 whose predecessor matches s_255
    cost, bps = _run(tiles, values, list(range(256)), D, torch.where(allowed, 0.0, float("inf")))
    closes = (all_states[None, :] & keep) == link  # s_255 that s_0 continues
    last = torch.where(closes, cost, float("inf")).argmin(dim=1)
    return _trace(bps, [int(d) for d in D[1:]], last)
