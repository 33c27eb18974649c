"""Source precisions of expert weights, dequantized exactly to fp32 before encoding.

- bf16 / fp16 / fp32: cast.
- FP8 e4m3 with block scales (`weight_scale_inv`, `weight_scale` or `scale`; fp32, bf16 or e8m0): the
  block size follows from the two shapes (128x128 for DeepSeek-V3, 32x32 for V4.1).
- MXFP4 (OCP microscaling): two e2m1 values per byte, the first in the low nibble, with one e8m0 scale
  per 32 consecutive inputs.
"""
import torch

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "scale")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)):
        return torch.exp2(scale.view(torch.uint8).float() - 127)  # e8m0: a bare exponent
    return scale.float()


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    out, inp = weight.shape
    s = _scale_values(scale)
    if s.dim() != 2:
        raise ValueError(f"{name}: FP8 block scale must be 2-D, got shape {tuple(scale.shape)}")
    bo, bi = -(-out // s.shape[0]), -(-inp // s.shape[1])
    if (-(-out // bo), -(-inp // bi)) != tuple(s.shape):
        raise ValueError(f"{name}: scale shape {tuple(s.shape)} does not tile weight {tuple(weight.shape)}")
    full = s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return weight.float() * full


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    out, half = packed.shape
    b = packed.view(torch.uint8).to(torch.int64)
    table = E2M1.to(b.device)
    vals = torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).reshape(out, 2 * half)
    s = _scale_values(scale)
    if tuple(s.shape) != (out, 2 * half // 32):
        raise ValueError(f"{name}: MXFP4 scale shape {tuple(scale.shape)}, expected {(out, 2 * half // 32)}")
    return vals * s.repeat_interleave(32, 1)


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, name: str) -> torch.Tensor:
    """fp32 (out, in) from a stored expert weight and its optional scale tensor."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight, got shape {tuple(weight.shape)}")
    if weight.dtype in FLOAT and scale is None:
        return weight.float()
    if weight.dtype == torch.float8_e4m3fn and scale is not None:
        return dequant_fp8(weight, scale, name)
    if weight.dtype in (torch.uint8, torch.int8) and scale is not None:
        return dequant_mxfp4(weight, scale, name)
    how = "with" if scale is not None else "without"
    raise ValueError(f"{name}: unsupported expert weight dtype {weight.dtype} {how} a scale tensor "
                     f"(supported: bf16/fp16/fp32, fp8 e4m3 + block scale, mxfp4 uint8 + e8m0 scale)")
