"""Encoding to EXL3: trellis encoders (Viterbi, beam) and layer quantization. Depends on xmoe.format."""
from .encode import BACKENDS, ENCODERS, encode_tiles
from .linear import ScaleSearch, quantize_linear

__all__ = ["BACKENDS", "ENCODERS", "ScaleSearch", "encode_tiles", "quantize_linear"]
