"""The Hessian side of calibrated quantization: H = X^T X of a linear layer's inputs, damped, rotated into the
encoder's domain and factored as a block LDL^T.

The work is in float64: H is rotated with the weight's own signs and 128-blocks of Hadamard, and float64
keeps the factor of an isotropic H isotropic to ~1e-17, so LDLQ with H = I reproduces the uncalibrated
encoding bit for bit.
"""
import logging

import torch

from ..format.hadamard import had_cols, had_rows

log = logging.getLogger(__name__)
SIGMA_REG = 0.025  # damping: this share of H's mean diagonal is added to the diagonal
BLOCK = 16  # LDL block = one trellis tile's rows
RETRIES = 10


class HessianError(ValueError):
    """A Hessian that cannot be used; the message names the tensor."""


def hessian_problem(H: torch.Tensor | None, count: int) -> str | None:
    """Why a captured H cannot drive LDLQ (the converter then encodes uncalibrated), or None."""
    if H is None or count == 0:
        return "no calibration tokens reached this input"
    if not torch.isfinite(H).all():
        return "H is not finite"
    if float(H.diagonal().mean()) < 1e-20:
        return "all calibration inputs are zero"
    return None


def check_hessian(H: torch.Tensor, n_in: int, name: str) -> None:
    if H.dim() != 2 or tuple(H.shape) != (n_in, n_in):
        raise HessianError(f"{name}: Hessian of shape {tuple(H.shape)}, expected ({n_in}, {n_in})")
    if not torch.isfinite(H).all():
        raise HessianError(f"{name}: Hessian contains inf or NaN")
    if float(H.diagonal().mean()) <= 0:
        raise HessianError(f"{name}: Hessian has no positive diagonal (no calibration input reached it)")


def damped(H: torch.Tensor, k: int, sigma_reg: float = SIGMA_REG) -> torch.Tensor:
    """float64 (k, k): H zero-padded to k, plus sigma_reg x its mean diagonal on the whole diagonal (padded
    inputs included), scaled to a mean diagonal of 1 over the real inputs (LDLQ and the metric are
    scale-free; unit scale makes an isotropic H exactly the identity)."""
    n = H.shape[0]
    out = torch.zeros(k, k, dtype=torch.float64, device=H.device)
    out[:n, :n] = H.double()
    mean = out.diagonal()[:n].mean()
    out.diagonal().add_(sigma_reg * mean)
    return out / out.diagonal()[:n].mean()


def rotate(H: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """H in the encoder's input basis: H_k diag(s) H diag(s) H_k, where the weight is w4 = H_k diag(1/su) w2
    (s = su's signs, or su itself to weigh each row by its scale)."""
    s = s.double().to(H.device)
    return had_cols(had_rows(H * s[:, None] * s[None, :]))


def block_ldl(H: torch.Tensor, sigma_reg: float = SIGMA_REG, name: str = "weight") -> tuple[torch.Tensor, int]:
    """Unit block-lower-triangular L with H = L D L^T (16x16 blocks), returned with its diagonal blocks zeroed
    (the part LDLQ feeds back), and the number of retries with more damping that Cholesky needed."""
    H = H.clone()
    k = H.shape[0]
    step = 2 * sigma_reg * float(H.diagonal().mean())
    for retry in range(RETRIES + 1):
        C, info = torch.linalg.cholesky_ex(H)
        if int(info) == 0:
            break
        if retry == RETRIES:
            raise HessianError(f"{name}: Cholesky of the Hessian failed after {RETRIES} retries with more damping")
        log.warning("%s: Cholesky failed, adding %.3g to the Hessian's diagonal (retry %d)", name, step, retry + 1)
        H.diagonal().add_(step)
    m = k // BLOCK
    diag = torch.diagonal(C.view(m, BLOCK, m, BLOCK), dim1=0, dim2=2).permute(2, 0, 1)  # (m, 16, 16)
    L = (C.view(k, m, BLOCK).transpose(0, 1) @ torch.linalg.inv(diag)).transpose(0, 1).reshape(k, k)
    blocks = L.view(m, BLOCK, m, BLOCK)
    idx = torch.arange(m)
    blocks[idx, :, idx, :] = 0
    return L, retry


def proxy_error(E: torch.Tensor, W: torch.Tensor, H: torch.Tensor) -> float:
    """tr(E^T H E) / tr(W^T H W) for E, W (k, n) with H (k, k): the share of the layer's output energy over
    the calibration inputs that the error takes (|X E|^2 / |X W|^2)."""
    E, W, H = E.double(), W.double(), H.double()
    num = ((H @ E) * E).sum()
    den = ((H @ W) * W).sum()
    return float(num / den.clamp_min(1e-300))
