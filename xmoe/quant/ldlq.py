"""Calibrated quantization of one linear layer: LDLQ against the Hessian of its inputs.

Rows of the rotated weight (input features) are encoded bottom-up in 16-row strips. Each strip's target is
its own weights plus L^T times the error already made in the strips below, where H' = L D L^T is the
Hessian in the encoder's basis; the strip's tiles then go to the same trellis encoder as the uncalibrated
path (the Triton Viterbi on GPUs, the torch references elsewhere). This minimises tr(E^T H' E), the error
of the layer's output over the calibration inputs, instead of the weights' own squared error. Afterwards
suh and svh are refitted in the metric of H.
"""
from dataclasses import dataclass

import torch

from ..format.codebook import check_codebook
from ..format.hadamard import had_cols, had_rows
from ..format.layer import decode_weight
from ..format.trellis import check_bits, matrix_to_tiles, tiles_to_matrix
from .hessian import SIGMA_REG, block_ldl, check_hessian, damped, proxy_error, rotate
from .linear import (Regularized, ScaleSearch, check_weight, encoder_for, global_scale, pack, refit_scales,
                     regularize)


@dataclass(frozen=True)
class LdlqSpec:
    """sigma_reg: damping as a share of H's mean diagonal. scaled: rotate H with suh's full values, so each row
    is weighed by its input scale (the metric the encoder's domain really has: 2-7% less output error than the
    signs alone on the demo model's experts at K=2, docs/CALIBRATION.md); with scaled=False, the signs only,
    and LDLQ with H = I is then exactly the uncalibrated path."""
    sigma_reg: float = SIGMA_REG
    scaled: bool = True
    refit_iters: int = 4


def ldlq_encode(w: torch.Tensor, L: torch.Tensor, encode) -> tuple[torch.Tensor, torch.Tensor]:
    """w (k, m) in the encoder's domain, L (k, k) from block_ldl -> (q (k, m) decoded values, states
    (k/16 * m/16, 256) in matrix_to_tiles order)."""
    k, m = w.shape
    q, err = torch.zeros_like(w), torch.zeros_like(w)
    Lf = L.to(device=w.device, dtype=torch.float32)
    states = []
    for a in range(k - 16, -1, -16):
        target = w[a:a + 16]
        if a + 16 < k:  # feedback of the error in the strips below, through L's off-diagonal blocks
            target = target + Lf[a + 16:, a:a + 16].T @ err[a + 16:]
        values, s = encode(matrix_to_tiles(target))
        q[a:a + 16] = tiles_to_matrix(values, 16, m)
        err[a:a + 16] = w[a:a + 16] - q[a:a + 16]
        states.append(s)
    return q, torch.cat(states[::-1])


def refit_hessian(w: torch.Tensor, a: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, H: torch.Tensor,
                  iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """su, sv minimising tr(E^T H E), E = w - diag(su) a diag(sv) (k, n), with a fixed (alternating closed
    forms: sv column by column; su from one k x k solve, since H couples the rows)."""
    if torch.count_nonzero(H - torch.diag(H.diagonal())) == 0:  # rows decouple: the weighted plain fit
        return refit_scales(w, a, su, sv, iters, row_weight=H.diagonal().float())
    Hf = H.float()
    Hw = Hf @ w
    for _ in range(iters):
        b = a * sv[None, :]  # (k, n); E = w - diag(su) b
        A = (b @ b.T) * Hf
        A.diagonal().add_(1e-9 * float(A.diagonal().mean()))
        su = torch.linalg.solve(A, (b * Hw).sum(1))
        c = a * su[:, None]  # E = w - c diag(sv)
        sv = (c * Hw).sum(0) / (c * (Hf @ c)).sum(0).clamp_min(1e-30)
    return su, sv


def _prepare(weight, H, K, codebook, seed, spec: LdlqSpec, name):
    check_bits(K)
    check_codebook(codebook)
    check_weight(weight, name)
    check_hessian(H, weight.shape[1], name)
    r = regularize(weight, codebook, seed)
    Hd = damped(H.to(weight.device), r.w0.shape[0], spec.sigma_reg)
    L, retries = block_ldl(rotate(Hd, r.su if spec.scaled else r.su.sign()), spec.sigma_reg, name)
    return r, Hd, L, retries


def quantize_ldlq(weight: torch.Tensor, hessian: torch.Tensor, K: float, codebook: str, encoder: str = "viterbi",
                  seed: int = 0, *, name: str = "weight", spec: LdlqSpec = LdlqSpec(),
                  search: ScaleSearch = ScaleSearch(), refit: bool = True, backend: str = "auto",
                  beam_width: int = 64) -> tuple[dict[str, torch.Tensor], dict]:
    """EXL3 tensors of weight (out, in), as quantize_linear returns them, encoded against hessian (in, in),
    the mean of x^T x over the layer's calibration inputs x. Also returns {"proxy_err", "cholesky_retries"}:
    proxy_err = tr(E H E^T) / tr(W H W^T) of the stored (decoded) weight against the undamped H.
    Deterministic for a given seed; with H = I and spec.scaled off the result is quantize_linear's, bit for bit."""
    r, Hd, L, retries = _prepare(weight, hessian, K, codebook, seed, spec, name)
    k, n = r.w0.shape
    encode = encoder_for(K, codebook, encoder, backend, beam_width)
    g = global_scale(r, encode, search)
    q, states = ldlq_encode(r.w4 * g, L, encode)
    su, sv = r.su / g, torch.where(r.live, r.sv, 0.0)
    if refit:
        su, sv = refit_hessian(r.w0, had_cols(had_rows(q)), su, sv, Hd, spec.refit_iters)
    tensors = pack(states, su, sv, k, n, K, codebook)
    n_out, n_in = weight.shape
    e = decode_weight({s: t.to(weight.device) for s, t in tensors.items()})[:n_in, :n_out] - weight.T.float()
    return tensors, {"proxy_err": proxy_error(e, weight.T, hessian.to(weight.device)), "cholesky_retries": retries}


def sample_error(r: Regularized, L: torch.Tensor, encode, search: ScaleSearch, strips: int,
                 H_rot: torch.Tensor, gen: torch.Generator) -> float:
    """Proxy error of LDLQ on a sample of `strips` 16-column strips of the rotated weight (columns encode
    independently, so the sample is exact LDLQ on those columns): tr(E^T H' E) / tr(W^T H' W) there."""
    k, n = r.w4.shape
    cols = torch.randperm(n // 16, generator=gen)[:strips].sort().values
    idx = (cols[:, None] * 16 + torch.arange(16)).reshape(-1).to(r.w4.device)
    g = global_scale(r, encode, search)
    w = r.w4[:, idx] * g
    q, _ = ldlq_encode(w, L, encode)
    return proxy_error(w - q, w, H_rot)


def error_curve(weight: torch.Tensor, hessian: torch.Tensor | None, Ks: list[float], codebook: str,
                encoder: str = "viterbi", seed: int = 0, *, name: str = "weight", strips: int = 4,
                spec: LdlqSpec = LdlqSpec(), search: ScaleSearch = ScaleSearch(sample_tiles=64),
                backend: str = "auto", beam_width: int = 64) -> dict[float, float]:
    """{K: estimated proxy error} of weight at each K, from LDLQ on a seeded sample of column strips
    (plain relative error when hessian is None). Cheap: about strips / (n / 16) of one encode per K."""
    if hessian is None:
        hessian = torch.eye(weight.shape[1], device=weight.device)
    r, _, L, _ = _prepare(weight, hessian, Ks[0], codebook, seed, spec, name)
    # measured in the metric of the layer's output: undamped, each row weighed by its input scale
    H_rot = rotate(damped(hessian.to(weight.device), r.w0.shape[0], 0.0), r.su)
    curve = {}
    for K in Ks:
        check_bits(K)
        encode = encoder_for(K, codebook, encoder, backend, beam_width)
        state = r.gen.get_state()
        curve[K] = sample_error(r, L, encode, search, strips, H_rot, torch.Generator().manual_seed(seed + 1))
        r.gen.set_state(state)  # every K sees the same scale-search sample
    return curve
