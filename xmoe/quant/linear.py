"""Quantize one linear layer to EXL3 (uncalibrated: the trellis search minimises plain MSE).

weight (out, in) -> W0 = weight^T (k = in, n = out), zero-padded to multiples of 128, then
  svh = random signs x column RMS,  W2 = (W0 / svh) H_n,
  suh = random signs x row RMS of W2 / codebook std / g,  W4 = H_k (W2 / suh),
  trellis = encode(W4), with the global scale g searched on a sample of tiles,
and finally suh, svh refitted by least squares with the trellis held fixed.
The calibrated path (ldlq.py) shares every step but the encoding order and the refit's metric.
"""
from dataclasses import dataclass

import torch

from ..format.codebook import check_codebook, codebook_table
from ..format.hadamard import had_cols, had_rows
from ..format.layer import marker, padded
from ..format.trellis import check_bits, matrix_to_tiles, pack_states, tiles_to_matrix
from .encode import encode_tiles


@dataclass(frozen=True)
class ScaleSearch:
    """The global-scale search: a grid of factors around 1, a parabola through the best three."""
    grid: tuple[float, ...] = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2)
    sample_tiles: int = 128


@dataclass
class Regularized:
    """A weight in the encoder's domain: w0 ~ diag(su) H_k w4 H_n diag(sv) (k, n), before the global scale."""
    w0: torch.Tensor  # (k, n) fp32, the padded original
    w4: torch.Tensor  # (k, n) fp32, rows of RMS ~ the codebook std
    su: torch.Tensor  # (k,)
    sv: torch.Tensor  # (n,)
    live: torch.Tensor  # (n,) bool: output columns that are not all zero
    std: float  # the codebook's std
    gen: torch.Generator  # continues the seeded stream (the scale search draws its sample from it)


def _signs(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.sign(torch.randn(n, generator=gen) + 1e-5)


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    r = x.pow(2).mean(dim).sqrt()
    return torch.where(r > 0, r, torch.full_like(r, 0.1))


def check_weight(weight: torch.Tensor, name: str = "weight") -> None:
    if weight.dim() != 2:
        raise ValueError(f"{name}: must be 2-D (out, in), got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError(f"{name}: contains inf or NaN")


def regularize(weight: torch.Tensor, codebook: str, seed: int) -> Regularized:
    """Random signs, RMS scales and the Hadamard rotations that make the weight look Gaussian per tile."""
    dev = weight.device
    n_out, n_in = weight.shape
    k, n = padded(n_in), padded(n_out)
    w0 = torch.zeros(k, n, device=dev)
    w0[:n_in, :n_out] = weight.T.float()
    gen = torch.Generator().manual_seed(seed)
    su_sign, sv_sign = _signs(k, gen).to(dev), _signs(n, gen).to(dev)
    col = w0.pow(2).mean(0).sqrt()
    sv = sv_sign * torch.where(col > 0, col / col[col > 0].mean().clamp_min(1e-30), 0.1)
    w2 = had_rows(w0 / sv[None, :])
    std = float(codebook_table(codebook).float().std())
    su = su_sign * _rms(w2, 1) / std
    return Regularized(w0, had_cols(w2 / su[:, None]), su, sv, col > 0, std, gen)


def _nmse(tiles: torch.Tensor, gs: list[float], encode) -> list[float]:
    """Relative error of the encoder on tiles * g for each g, in one call (tiles are encoded independently)."""
    values, _ = encode(torch.cat([tiles * g for g in gs]))
    energy = (tiles ** 2).sum()
    return [float(((v / g - tiles) ** 2).sum() / energy) for v, g in zip(values.split(tiles.shape[0]), gs)]


def search_scale(tiles: torch.Tensor, encode, search: ScaleSearch, gen: torch.Generator, g0: float = 1.0) -> float:
    """Factor g (searched as multiples of g0) minimising the encoder's relative error on a fixed sample."""
    idx = torch.randperm(tiles.shape[0], generator=gen)[: search.sample_tiles].to(tiles.device)
    sample = tiles[idx]
    grid = [g0 * g for g in search.grid]
    errs = _nmse(sample, grid, encode)
    i = min(range(len(errs)), key=errs.__getitem__)
    if 0 < i < len(errs) - 1:  # vertex of the parabola through the best point and its neighbours
        (x0, x1, x2), (y0, y1, y2) = grid[i - 1:i + 2], errs[i - 1:i + 2]
        den = (x0 - x1) * (x0 - x2) * (x1 - x2)
        a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / den
        b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / den
        if a > 0:
            g = min(max(-b / (2 * a), x0), x2)
            if _nmse(sample, [g], encode)[0] < errs[i]:
                return g
    return grid[i]


def global_scale(r: Regularized, encode, search: ScaleSearch) -> float:
    """g for the whole weight. Rows padded with zeros dilute each 128-block after the Hadamard: the search
    starts at the codebook std over the weight's RMS."""
    g0 = r.std / float(r.w4.pow(2).mean().sqrt().clamp_min(1e-30))
    return search_scale(matrix_to_tiles(r.w4), encode, search, r.gen, g0=g0)


def refit_scales(w: torch.Tensor, a: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, iters: int = 4,
                 row_weight: torch.Tensor | None = None):
    """Least-squares su, sv for w ~ diag(su) a diag(sv) with a = H Q H fixed (alternating, closed form).

    `row_weight` (k,) weighs each row's squared error (a diagonal Hessian); a row's own weight cancels in
    its su, so it enters the sv step only."""
    h = 1.0 if row_weight is None else row_weight[:, None]
    for _ in range(iters):
        asv = a * sv[None, :]
        su = (w * asv).sum(1) / asv.pow(2).sum(1).clamp_min(1e-30)
        sua = a * su[:, None]
        sv = (w * sua * h).sum(0) / (sua.pow(2) * h).sum(0).clamp_min(1e-30)
    return su, sv


def pack(states: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, k: int, n: int, K: float, codebook: str) -> dict:
    trellis = pack_states(states.to(torch.int64) & 0xFFFF, K).reshape(k // 16, n // 16, -1)
    return {"trellis": trellis.cpu(), "suh": su.half().cpu(), "svh": sv.half().cpu(), **marker(codebook)}


def encoder_for(K: float, codebook: str, encoder: str, backend: str, beam_width: int):
    """tiles (T, 256) -> (values, states) with the chosen encoder (the GPU's Triton Viterbi where it can)."""
    def encode(t):
        return encode_tiles(t, K, codebook, encoder, backend=backend, beam_width=beam_width)
    return encode


def quantize_linear(weight: torch.Tensor, K: float, codebook: str, encoder: str = "viterbi", seed: int = 0,
                    *, search: ScaleSearch = ScaleSearch(), refit: bool = True, backend: str = "auto",
                    beam_width: int = 64) -> dict[str, torch.Tensor]:
    """EXL3 tensors {trellis, suh, svh[, mcg|mul1]} for a weight shaped like nn.Linear.weight (out, in).

    Computation runs on weight's device; results are on the CPU. Deterministic for a given seed.
    """
    check_bits(K)
    check_codebook(codebook)
    check_weight(weight)
    r = regularize(weight, codebook, seed)
    k, n = r.w0.shape
    encode = encoder_for(K, codebook, encoder, backend, beam_width)
    g = global_scale(r, encode, search)
    values, states = encode(matrix_to_tiles(r.w4) * g)
    su, sv = r.su / g, torch.where(r.live, r.sv, 0.0)
    if refit:
        a = had_cols(had_rows(tiles_to_matrix(values, k, n)))
        su, sv = refit_scales(r.w0, a, su, sv)
    return pack(states, su, sv, k, n, K, codebook)
