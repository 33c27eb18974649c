"""The trellis decoders of the Triton GEMMs: a block of weights from its words, as fp16 operands.

The tiled decoder (K = 1, 2, 4, 8) loads each tile's words once and spreads them over the tile by reshape, permute
and broadcast; then a funnel shift and the codebook (triton_codebook) give the weights. The gather decoder (every
K) loads two words per weight, at offsets and shifts from a 256-entry table per K (format.state_windows).
"""
import triton
import triton.language as tl

from .triton_codebook import codebook_operand


@triton.jit
def decode_block(words, lo_off, hi_off, shift, CB: tl.constexpr, MUL1_H: tl.constexpr, ASM: tl.constexpr):
    """Decode weights whose state ends in word lo_off, continuing word hi_off, `shift` bits up
    (codebook_operand)."""
    lo = tl.load(words + lo_off).to(tl.uint32, bitcast=True)
    hi = tl.load(words + hi_off).to(tl.uint32, bitcast=True)
    state = ((lo >> shift) | ((hi << 1) << (31 - shift))) & 0xFFFF  # two shifts: shift may be 0
    return codebook_operand(state, CB, MUL1_H, ASM)


@triton.jit
def spread_words(words, KLOG: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """(BK/16, BN/16, W) tile words -> (BK, BN): each weight gets the word holding its state's last bit.

    For K = 2^KLOG that word is position p >> (5 - KLOG), and p's bits are, from the top, c2 c1 c0 r2 r1 c3
    r3 r0 (tile row r, column c): the word index is a few of r's and c's bits, so the words only need
    their index bits spread onto the (r, c) grid: reshape, permute and broadcast, no gather.
    """
    TK: tl.constexpr = BK // 16
    TN: tl.constexpr = BN // 16
    if KLOG == 0:  # bits c2 c1 c0
        x = tl.reshape(words, (TK, 1, 1, 1, 1, TN, 1, 2, 2, 2))
    elif KLOG == 1:  # c2 c1 c0 r2
        x = tl.permute(tl.reshape(words, (TK, TN, 2, 2, 2, 2)), (0, 5, 1, 2, 3, 4))
        x = tl.reshape(x, (TK, 1, 2, 1, 1, TN, 1, 2, 2, 2))
    elif KLOG == 2:  # c2 c1 c0 r2 r1
        x = tl.permute(tl.reshape(words, (TK, TN, 2, 2, 2, 2, 2)), (0, 5, 6, 1, 2, 3, 4))
        x = tl.reshape(x, (TK, 1, 2, 2, 1, TN, 1, 2, 2, 2))
    else:  # c2 c1 c0 r2 r1 c3
        x = tl.permute(tl.reshape(words, (TK, TN, 2, 2, 2, 2, 2, 2)), (0, 5, 6, 1, 7, 2, 3, 4))
        x = tl.reshape(x, (TK, 1, 2, 2, 1, TN, 2, 2, 2, 2))
    return tl.reshape(tl.broadcast_to(x, (TK, 2, 2, 2, 2, TN, 2, 2, 2, 2)), (BK, BN))


@triton.jit
def tile_offsets(pid_n, n, W: tl.constexpr, KLOG: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """For the tiled decoder: the (BK/16, BN/16, W) word offsets of a block, relative to its first k-tile row,
    the offsets of the words their states continue into, and each (BK, BN) weight's shift."""
    tk = tl.arange(0, BK // 16)[:, None, None]
    tn = tl.arange(0, BN // 16)[None, :, None]
    word = tl.arange(0, W)[None, None, :]
    tile = tk * ((n // 16) * W) + (pid_n * (BN // 16) + tn) * W
    rr = tl.arange(0, BK)[:, None] % 16
    cc = tl.arange(0, BN)[None, :] % 16
    p = 32 * (cc & 7) + 8 * ((rr >> 1) & 3) + 4 * (cc >> 3) + 2 * (rr >> 3) + (rr & 1)
    shift = (32 - (1 << KLOG) * ((p & ((1 << (5 - KLOG)) - 1)) + 1)).to(tl.uint32)
    return tile + word, tile + (word + W - 1) % W, shift


@triton.jit
def gather_offsets(table_ptr, pid_n, n, W: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """For the gather decoder: each (BK, BN) weight's word offset relative to its block's first k-tile row, the
    word its state continues into, and its shift, from the 256-entry table of its K (format.state_windows)."""
    r = tl.arange(0, BK)[:, None]
    c = tl.arange(0, BN)[None, :]
    entry = tl.load(table_ptr + (r % 16) * 16 + c % 16)
    tile = (r // 16) * ((n // 16) * W) + (pid_n * (BN // 16) + c // 16) * W
    return tile + (entry & 0xFF), tile + ((entry >> 8) & 0xFF), (entry >> 16).to(tl.uint32)


@triton.jit
def load_words(base, lo_off, hi_off):
    """The (BK/16, BN/16, W) words of a block and, for each, the word its states continue into."""
    return tl.load(base + lo_off), tl.load(base + hi_off)


@triton.jit
def tile_states(lo, hi, shift, KLOG: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """The (BK, BN) states of a block for K = 1, 2, 4, 8 from its (BK/16, BN/16, W) words, each loaded once."""
    lo = spread_words(lo, KLOG, BK, BN).to(tl.uint32, bitcast=True)
    hi = spread_words(hi, KLOG, BK, BN).to(tl.uint32, bitcast=True)
    return ((lo >> shift) | ((hi << 1) << (31 - shift))) & 0xFFFF


@triton.jit
def decode_tiles(lo, hi, shift, CB: tl.constexpr, KLOG: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                 MUL1_H: tl.constexpr, ASM: tl.constexpr):
    """decode_block for K = 1, 2, 4, 8 from the (BK/16, BN/16, W) words of a block, each loaded once."""
    return codebook_operand(tile_states(lo, hi, shift, KLOG, BK, BN), CB, MUL1_H, ASM)
