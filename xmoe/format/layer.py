"""One EXL3 linear layer as stored: `<key>.trellis`, `.suh`, `.svh`, an optional codebook marker
(`.mcg` or `.mul1`, absent for 3INST), optional `.bias`, or the legacy sign bitfields `.su`/`.sv`.

The full weight is W = diag(suh) H_k W-hat H_n diag(svh), shape (in_features, out_features), y = x W + b.
"""
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .codebook import MARKER_VALUE, check_codebook
from .hadamard import HAD, had_cols, had_rows
from .trellis import bits_from_trellis, decode_inner

SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")
INDEX = "model.safetensors.index.json"


class FormatError(ValueError):
    """A tensor set that is not a valid EXL3 layer; the message names the layer and tensor."""


def padded(dim: int) -> int:
    """Stored size of a dimension: EXL3 pads every dimension to a multiple of 128 with zeros."""
    return -(-dim // HAD) * HAD


def stored_layout(in_features: int, out_features: int, K: float, codebook: str) -> list[tuple[str, torch.dtype, tuple]]:
    """(suffix, dtype, shape) of every tensor a layer of this size is stored as, before it is encoded."""
    k, n = padded(in_features), padded(out_features)
    return [("suh", torch.float16, (k,)), ("svh", torch.float16, (n,)),
            ("trellis", torch.int16, (k // 16, n // 16, int(16 * K)))] + \
        [(name, t.dtype, tuple(t.shape)) for name, t in marker(codebook).items()]


def is_exl3(tensors: dict) -> bool:
    return "trellis" in tensors and ("suh" in tensors or "su" in tensors) and ("svh" in tensors or "sv" in tensors)


def layer_codebook(tensors: dict, name: str = "layer") -> str:
    if "mcg" in tensors and "mul1" in tensors:
        raise FormatError(f"{name}: both .mcg and .mul1 markers present")
    return "mcg" if "mcg" in tensors else "mul1" if "mul1" in tensors else "3inst"


def marker(codebook: str) -> dict:
    """The marker tensor for a codebook (3INST has none)."""
    check_codebook(codebook)
    return {} if codebook == "3inst" else {codebook: torch.tensor(MARKER_VALUE[codebook], dtype=torch.int32)}


def unpack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Legacy su/sv: int16 words, bit b of word w (LSB first) is the sign of element 16w+b (1 means -1)."""
    b = (bits.to(torch.int64)[:, None] >> torch.arange(16, device=bits.device)) & 1
    return (1 - 2 * b).reshape(-1).to(torch.float16)


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    neg = (signs < 0).to(torch.int64).reshape(-1, 16)
    return (neg << torch.arange(16, device=signs.device)).sum(-1).to(torch.int32).to(torch.int16)


def check_layer(tensors: dict, name: str = "layer") -> tuple[int, int, float]:
    """Validate shapes and dtypes; returns (k, n, K). Errors name the offending tensor."""
    if not is_exl3(tensors):
        missing = [s for s in ("trellis", "suh", "svh") if s not in tensors and s[:2] not in tensors]
        raise FormatError(f"{name}: not an EXL3 layer, missing {', '.join(f'.{m}' for m in missing)}")
    trellis = tensors["trellis"]
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise FormatError(f"{name}.trellis: expected int16 of rank 3, got {trellis.dtype} {tuple(trellis.shape)}")
    try:
        K = bits_from_trellis(trellis)
    except ValueError as e:
        raise FormatError(f"{name}.trellis: {e}") from None
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if k % HAD or n % HAD:
        raise FormatError(f"{name}.trellis: dimensions ({k}, {n}) are not multiples of {HAD}")
    for vec, size, words in (("suh", k, "su"), ("svh", n, "sv")):
        t, want = (tensors[vec], (size,)) if vec in tensors else (tensors[words], (size // 16,))
        if tuple(t.shape) != want:
            raise FormatError(f"{name}.{vec if vec in tensors else words}: shape {tuple(t.shape)}, expected {want}")
    if "bias" in tensors and tuple(tensors["bias"].shape) != (n,):
        raise FormatError(f"{name}.bias: shape {tuple(tensors['bias'].shape)}, expected ({n},)")
    codebook = layer_codebook(tensors, name)
    if not float(K).is_integer() and codebook != "mul1":
        raise FormatError(f"{name}.trellis: half-integer K={K} requires the mul1 codebook, found {codebook}")
    return k, n, K


def scale_vectors(tensors: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(suh, svh) as fp32, expanding legacy sign bitfields."""
    su = tensors["suh"] if "suh" in tensors else unpack_signs(tensors["su"])
    sv = tensors["svh"] if "svh" in tensors else unpack_signs(tensors["sv"])
    return su.float(), sv.float()


def decode_weight(tensors: dict, K: float | None = None) -> torch.Tensor:
    """Full fp32 weight (in_features, out_features) of one EXL3 layer (padded dims as stored)."""
    _, _, stored_K = check_layer(tensors)
    if K is not None and K != stored_K:
        raise FormatError(f"trellis holds K={stored_K}, caller asked for K={K}")
    w_hat = decode_inner(tensors["trellis"], stored_K, layer_codebook(tensors)).float()
    su, sv = scale_vectors(tensors)
    return su[:, None] * had_rows(had_cols(w_hat)) * sv[None, :]


def slice_layer(tensors: dict, side: str, start: int, stop: int) -> dict:
    """Tensor-parallel slice at multiples of 128: side "out" (column-parallel) or "in" (row-parallel).

    Splitting the input side keeps the bias only in the slice that starts at 0 (it must be added once).
    """
    k, n, _ = check_layer(tensors)
    size = n if side == "out" else k
    if side not in ("out", "in"):
        raise ValueError(f"side must be 'out' or 'in', not {side!r}")
    if start % HAD or stop % HAD or not 0 <= start < stop <= size:
        raise ValueError(f"slice [{start}, {stop}) of {side} dim {size} must be within range at multiples of {HAD}")
    out = dict(tensors)
    tile = slice(start // 16, stop // 16)
    if side == "out":
        out["trellis"] = tensors["trellis"][:, tile]
        for v in ("svh", "bias"):
            if v in tensors:
                out[v] = tensors[v][start:stop]
        if "sv" in tensors:
            out["sv"] = tensors["sv"][tile]
    else:
        out["trellis"] = tensors["trellis"][tile]
        if "suh" in tensors:
            out["suh"] = tensors["suh"][start:stop]
        if "su" in tensors:
            out["su"] = tensors["su"][tile]
        if start and "bias" in tensors:
            del out["bias"]
    return {name: t.contiguous() for name, t in out.items()}


def flatten(layers: dict[str, dict]) -> dict[str, torch.Tensor]:
    """{module_key: {suffix: tensor}} -> {"module_key.suffix": tensor}."""
    return {f"{key}.{suffix}": t for key, ts in layers.items() for suffix, t in ts.items()}


def save_layers(path: str | os.PathLike, layers: dict[str, dict], metadata: dict | None = None) -> None:
    """Write layers to one safetensors file atomically (temp file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: t.contiguous() for k, t in flatten(layers).items()}, str(tmp), metadata=metadata or {"format": "pt"})
    os.replace(tmp, path)


def shard_files(model_dir: str | os.PathLike) -> tuple[list[str], dict | None]:
    """Safetensors files of a model directory and its index's weight_map (None for a single-file model)."""
    path = Path(model_dir)
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text()).get("weight_map", {})
        return sorted(set(weight_map.values())), weight_map
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"], None
    raise FormatError(f"{path}: neither {INDEX} nor model.safetensors")


def load_layer(path: str | os.PathLike, key: str, device: str = "cpu") -> dict:
    """Read the EXL3 tensors of module `key` from a safetensors file, validated."""
    with safe_open(str(path), framework="pt", device=device) as f:
        names = set(f.keys())
        tensors = {s: f.get_tensor(f"{key}.{s}") for s in SUFFIXES if f"{key}.{s}" in names}
    if not tensors:
        raise FormatError(f"{path}: no tensors for module {key!r}")
    check_layer(tensors, f"{path}: {key}")
    return tensors
