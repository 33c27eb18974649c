"""Beam search over trellis paths: a fast approximate encoder for machines without a GPU.

Each beam fixes its first state s_0, which also fixes the last bits of the stream (tail-biting), so in
the final positions only continuations consistent with s_0 are allowed and every path closes.
"""
import torch

from ..format.codebook import codebook_table
from ..format.trellis import _layout


def beam_torch(tiles: torch.Tensor, K: float, codebook: str, width: int = 64) -> torch.Tensor:
    """tiles: float32 (T, 256) in trellis order -> int64 states (T, 256) of a closed trellis path."""
    T = tiles.shape[0]
    values = codebook_table(codebook, tiles.device).float()
    D, S = _layout(K)
    n_bits = int(256 * K)
    wrap = n_bits - 16 + int(D[0])  # stream bits from here to the end are the high bits of s_0

    cost, cur = ((values[None, :] - tiles[:, :1]) ** 2).topk(width, dim=1, largest=False)
    first = cur
    states, parents = [cur], []
    for p in range(1, 256):
        d = int(D[p])
        cand = ((cur[..., None] << d) | torch.arange(1 << d, device=tiles.device)) & 0xFFFF
        c = cost[..., None] + (values[cand] - tiles[:, p, None, None]) ** 2
        r = int(S[p]) - wrap  # low r bits of s_p are already fixed by s_0
        if r > 0:
            c = torch.where((cand & ((1 << r) - 1)) == (first[..., None] >> (16 - r)), c, float("inf"))
        cost, idx = c.reshape(T, -1).topk(width, dim=1, largest=False)
        parent = idx >> d
        cur = cand.reshape(T, -1).gather(1, idx)
        first = first.gather(1, parent)
        states.append(cur)
        parents.append(parent)

    beam = cost.argmin(dim=1, keepdim=True)
    out = [states[-1].gather(1, beam)]
    for s, parent in zip(reversed(states[:-1]), reversed(parents)):
        beam = parent.gather(1, beam)
        out.append(s.gather(1, beam))
    return torch.cat(out[::-1], dim=1)
