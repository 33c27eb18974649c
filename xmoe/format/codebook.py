"""EXL3 codebooks: each maps one 16-bit trellis state to one fp16 weight.

All three evaluate integer arithmetic modulo 2^32 and end in a single fp16 rounding, so a 65,536-entry
table per codebook reproduces exllamav3's decoder bit for bit.
"""
from functools import lru_cache

import torch

CODEBOOKS = ("3inst", "mcg", "mul1")

# Multipliers fixed by the format; the markers' stored values are never read, only their presence.
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
INST3_MULT, INST3_ADD = 89226354, 64248484
MARKER_VALUE = {"mcg": MCG_MULT - (1 << 32), "mul1": MUL1_MULT - (1 << 32)}
# 3INST and MCG: the product masked and flipped into two fp16 halves in ±[0.125, 2), whose sum is the weight.
HALVES_MASK, HALVES_XOR = 0x8FFF8FFF, 0x3B603B60
# mul1: the fp16 FMA (1024 + the product's byte sum) k_inv + k_bias, k_inv 0x1EEE and k_bias 0xC931 as fp16 bits;
# exact in fp32 as b k_inv + MUL1_BIAS for the byte sum b.
MUL1_K_INV, MUL1_K_BIAS = 0.00676727294921875, -10.3828125
MUL1_BIAS = 1024 * MUL1_K_INV + MUL1_K_BIAS  # -3.453125

# Every codebook is quantized against a target std of 1.24371088 (the 3INST std); mul1 (std 1.0) is
# rescaled through the searched global scale.
TARGET_STD = 1.24371088


def check_codebook(codebook: str) -> str:
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {', '.join(CODEBOOKS)}")
    return codebook


def _half_sum(x: torch.Tensor) -> torch.Tensor:
    """3INST/MCG tail: mask and xor into two fp16 halves in ±[0.125, 2), summed with one fp16 rounding."""
    x = (x & HALVES_MASK) ^ HALVES_XOR
    lo = (x & 0xFFFF).to(torch.int16)  # wraps to the same 16 bits
    hi = (x >> 16).to(torch.int16)
    return lo.view(torch.float16) + hi.view(torch.float16)


def _mul1(x: torch.Tensor) -> torch.Tensor:
    b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    return (b.to(torch.float32) * MUL1_K_INV + MUL1_BIAS).to(torch.float16)  # exact in fp32, one rounding


def codebook_values(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """fp16 weights of integer `states` (any shape, values 0..65535), computed from the definition."""
    s = states.to(torch.int64) & 0xFFFF
    check_codebook(codebook)
    if codebook == "3inst":
        return _half_sum((s * INST3_MULT + INST3_ADD) & 0xFFFFFFFF)
    if codebook == "mcg":
        return _half_sum((s * MCG_MULT) & 0xFFFFFFFF)
    return _mul1((s * MUL1_MULT) & 0xFFFFFFFF)


@lru_cache(maxsize=None)
def _table(codebook: str) -> torch.Tensor:
    return codebook_values(torch.arange(65536), codebook)


def codebook_table(codebook: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """All 65,536 fp16 values of a codebook, indexed by state."""
    return _table(check_codebook(codebook)).to(device)
