"""Encoder selection: tiles in trellis order -> closed trellis paths (states) and their decoded values."""
import logging

import torch

from ..format.codebook import check_codebook, codebook_table
from ..format.trellis import check_bits
from .beam import beam_torch
from .viterbi import viterbi_torch

log = logging.getLogger(__name__)
ENCODERS = ("viterbi", "beam")
BACKENDS = ("auto", "triton", "torch")
_logged = set()


def triton_refusal(tiles: torch.Tensor, K: float) -> str | None:
    """Why the Triton Viterbi cannot take these tiles, or None when it can."""
    if not tiles.is_cuda:
        return "tiles are not on a CUDA device"
    if not float(K).is_integer():
        return f"half-integer K={K} is encoded by the torch reference only"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def pick_backend(tiles: torch.Tensor, K: float, encoder: str, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if encoder == "beam" or backend == "torch":
        return "torch"
    reason = triton_refusal(tiles, K)
    if backend == "triton" and reason:
        raise RuntimeError(f"Triton Viterbi unavailable: {reason}")
    choice = "torch" if reason else "triton"
    if backend == "auto" and (choice, reason) not in _logged:
        _logged.add((choice, reason))
        log.info("viterbi backend: %s%s", choice, f" ({reason})" if reason else "")
    return choice


def encode_tiles(tiles: torch.Tensor, K: float, codebook: str, encoder: str = "viterbi", *,
                 backend: str = "auto", beam_width: int = 64, chunk: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode tiles onto the trellis.

    tiles: float32 (T, 256) in trellis order. Returns (values float32 (T, 256), states int16 (T, 256)):
    the states form closed tail-biting paths and pack_states(states) decodes exactly to `values`.
    """
    check_bits(K)
    check_codebook(codebook)
    if encoder not in ENCODERS:
        raise ValueError(f"unknown encoder {encoder!r}; expected one of {', '.join(ENCODERS)}")
    if tiles.dim() != 2 or tiles.shape[1] != 256:
        raise ValueError(f"tiles must be (T, 256), got {tuple(tiles.shape)}")
    tiles = tiles.float()
    if not torch.isfinite(tiles).all():
        raise ValueError("tiles contain inf or NaN")
    which = pick_backend(tiles, K, encoder, backend)
    if which == "triton":
        from .viterbi_triton import viterbi_triton
        states = viterbi_triton(tiles, K, codebook)
    else:
        if encoder == "viterbi":
            fn, default_chunk = (lambda t: viterbi_torch(t, K, codebook)), (256 if tiles.is_cuda else 16)
        else:
            fn, default_chunk = (lambda t: beam_torch(t, K, codebook, beam_width)), 1024
        step = chunk or default_chunk
        states = torch.cat([fn(tiles[i:i + step]) for i in range(0, tiles.shape[0], step)])
    values = codebook_table(codebook, tiles.device)[states].float()
    return values, states.to(torch.int32).to(torch.int16)
