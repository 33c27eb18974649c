"""The 128-wide Sylvester Hadamard transform that EXL3 applies on both sides of every weight."""
from functools import lru_cache

import torch

HAD = 128


@lru_cache(maxsize=None)
def _h128() -> torch.Tensor:
    i = torch.arange(HAD)
    parity = torch.zeros(HAD, HAD, dtype=torch.int64)
    and_ = i[:, None] & i[None, :]
    for b in range(7):
        parity ^= (and_ >> b) & 1
    return (1 - 2 * parity).to(torch.float32) / HAD**0.5


def hadamard_128(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Natural-order Sylvester H_128 / sqrt(128): symmetric and its own inverse."""
    return _h128().to(device=device, dtype=dtype)


def had_rows(x: torch.Tensor) -> torch.Tensor:
    """x @ blockdiag(H_128, ...) along the last dimension (a multiple of 128)."""
    if x.shape[-1] % HAD:
        raise ValueError(f"Hadamard dimension {x.shape[-1]} is not a multiple of {HAD}")
    h = hadamard_128(x.device, x.dtype)
    return (x.reshape(*x.shape[:-1], -1, HAD) @ h).reshape(x.shape)


def had_cols(x: torch.Tensor) -> torch.Tensor:
    """blockdiag(H_128, ...) @ x along the first dimension of a 2-D x."""
    return had_rows(x.T).T
