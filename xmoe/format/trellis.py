"""EXL3 trellis tiles: the order of the 256 weights in a tile, bit packing, and the reference decode.

A tile covers 16 input rows x 16 output columns. Position p of the trellis walk holds a 16-bit state;
only the state's newest bits are stored, as one MSB-first bit stream of 256*K bits per tile, cut into
uint32 words that are stored as little-endian int16 pairs. A state is the 16 stream bits ending at its
position, read circularly (the trellis is tail-biting).
"""
from functools import lru_cache

import torch

from .codebook import codebook_table

HALF_K = (1.5, 2.5, 3.5)  # fractional bit widths, mul1 only
HALF_MASK = 0xAAAA  # odd positions of each 16 take the extra bit


def check_bits(K: float) -> float:
    if K in HALF_K or (float(K).is_integer() and 1 <= K <= 8):
        return K
    raise ValueError(f"unsupported bits per weight K={K}: expected an integer 1..8 or one of {HALF_K}")


def bits_from_trellis(trellis: torch.Tensor) -> float:
    """K from a trellis tensor's last dimension (16*K int16 per tile)."""
    K = trellis.shape[-1] / 16
    return check_bits(int(K) if K.is_integer() else K)


@lru_cache(maxsize=None)
def tile_perm() -> torch.Tensor:
    """perm[p] = r*16 + c: the tile element visited at trellis position p (the mma B-fragment order)."""
    p = torch.arange(256)
    t, j = p // 8, p % 8
    r = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = t // 4 + 8 * ((j >> 2) & 1)
    return r * 16 + c


def matrix_to_tiles(w: torch.Tensor) -> torch.Tensor:
    """(k, n) matrix -> (k/16 * n/16, 256) tiles in trellis order, tiles row-major over (k-tile, n-tile)."""
    k, n = w.shape
    tiles = w.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3).reshape(-1, 256)
    return tiles[:, tile_perm().to(w.device)]


def tiles_to_matrix(tiles: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """Inverse of matrix_to_tiles."""
    out = torch.empty_like(tiles)
    out[:, tile_perm().to(tiles.device)] = tiles
    return out.reshape(k // 16, n // 16, 16, 16).permute(0, 2, 1, 3).reshape(k, n)


@lru_cache(maxsize=None)
def _layout(K: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: bits added (D) and the stream offset where its symbol ends (S)."""
    check_bits(K)
    p = torch.arange(256)
    if float(K).is_integer():
        D = torch.full((256,), int(K))
    else:
        D = int(K) + ((HALF_MASK >> (p % 16)) & 1)
    return D, torch.cumsum(D, 0)


def unpack_states(trellis: torch.Tensor, K: float) -> torch.Tensor:
    """trellis int16 (..., 16K) -> int64 states (..., 256)."""
    check_bits(K)
    n_bits = int(256 * K)
    if trellis.shape[-1] * 16 != n_bits:
        raise ValueError(f"trellis last dim {trellis.shape[-1]} does not hold 256 weights at K={K}")
    t = trellis.to(torch.int64) & 0xFFFF
    words = t[..., 0::2] | (t[..., 1::2] << 16)  # little-endian int16 pairs -> uint32
    _, S = _layout(K)
    start = ((S - 16) % n_bits).to(trellis.device)
    w0, n_words = start // 32, n_bits // 32
    hi = words[..., w0]
    lo = words[..., (w0 + 1) % n_words]
    return (((hi << 32) | lo) >> (48 - start % 32)) & 0xFFFF


def pack_states(states: torch.Tensor, K: float) -> torch.Tensor:
    """int states (..., 256) -> trellis int16 (..., 16K). Only each state's newest D(p) bits are stored;
    the older bits are implied by the neighbours (see check_tail_biting)."""
    D, S = (x.to(states.device) for x in _layout(check_bits(K)))
    n_bits = int(256 * K)
    d_max = int(D.max())
    b = torch.arange(d_max, device=states.device)
    valid = b[None, :] < D[:, None]  # (256, d_max)
    shift = (D[:, None] - 1 - b[None, :]).clamp(min=0)
    pos = (S - D)[:, None] + b[None, :]  # stream index of each symbol bit
    bits = (states.to(torch.int64)[..., :, None] >> shift) & 1
    stream = torch.zeros(*states.shape[:-1], n_bits, dtype=torch.int64, device=states.device)
    stream[..., pos[valid]] = bits[..., valid]
    weights = 1 << torch.arange(31, -1, -1, device=states.device)
    words = (stream.reshape(*states.shape[:-1], n_bits // 32, 32) * weights).sum(-1)
    halves = torch.stack([words & 0xFFFF, words >> 16], dim=-1).reshape(*states.shape[:-1], -1)
    return halves.to(torch.int32).to(torch.int16)  # int16 cast of 0..65535 wraps as two's complement


@lru_cache(maxsize=None)
def state_windows(K: float) -> torch.Tensor:
    """Where each weight of a tile finds its state, for decoders that read the packed words directly.

    Returns int32 (256,), indexed by r*16 + c (input row r, output column c of the tile): the low byte is
    the word holding the state's last bit (lo), the next byte the word before it (hi, circularly), bits
    16 and up the right shift s such that state = ((hi:lo) >> s) & 0xFFFF on the 64-bit concatenation.
    """
    _, S = _layout(check_bits(K))
    n_words = int(256 * K) // 32
    end = torch.empty(256, dtype=torch.int64)
    end[tile_perm()] = S  # S[p]: the stream offset just past position p's last bit
    word = (end - 1) // 32
    shift = 32 * (word + 1) - end
    return (word | ((word - 1) % n_words) << 8 | shift << 16).to(torch.int32)


def check_tail_biting(states: torch.Tensor, K: float) -> bool:
    """True when every state continues its predecessor, p = 0 continuing p = 255."""
    D, _ = _layout(check_bits(K))
    prev = torch.roll(states.to(torch.int64), 1, dims=-1)
    D = D.to(states.device)
    return bool(((states >> D) == (prev & ((1 << (16 - D)) - 1))).all())


def decode_inner(trellis: torch.Tensor, K: float, codebook: str) -> torch.Tensor:
    """Decode a trellis to the fp16 inner matrix W-hat, bit-exact with exllamav3.

    trellis: int16 (k/16, n/16, 16*K). Returns fp16 (k, n), before the Hadamards and suh/svh.
    """
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise ValueError(f"trellis must be int16 of shape (k/16, n/16, 16*K), got {trellis.dtype} {tuple(trellis.shape)}")
    if K in HALF_K and codebook != "mul1":
        raise ValueError(f"half-integer K={K} exists only for the mul1 codebook, not {codebook}")
    kt, nt, _ = trellis.shape
    states = unpack_states(trellis.reshape(kt * nt, -1), K)
    values = codebook_table(codebook, trellis.device)[states]
    return tiles_to_matrix(values, kt * 16, nt * 16)
