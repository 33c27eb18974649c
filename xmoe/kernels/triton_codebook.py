"""The EXL3 codebooks as Triton device functions, bit-exact with format/codebook.py, whose constants they use:
the one codebook definition of every kernel (the GEMMs, grouped_gemv, gluon_mma's mul1 and the Viterbi encoders)."""
import triton
import triton.language as tl

from ..format import codebook as fmt

MCG_MULT: tl.constexpr = tl.constexpr(fmt.MCG_MULT)
MUL1_MULT: tl.constexpr = tl.constexpr(fmt.MUL1_MULT)
INST3_MULT: tl.constexpr = tl.constexpr(fmt.INST3_MULT)
INST3_ADD: tl.constexpr = tl.constexpr(fmt.INST3_ADD)
HALVES_MASK: tl.constexpr = tl.constexpr(fmt.HALVES_MASK)
HALVES_XOR: tl.constexpr = tl.constexpr(fmt.HALVES_XOR)
MUL1_K_INV: tl.constexpr = tl.constexpr(fmt.MUL1_K_INV)
MUL1_K_BIAS: tl.constexpr = tl.constexpr(fmt.MUL1_K_BIAS)
MUL1_BIAS: tl.constexpr = tl.constexpr(fmt.MUL1_BIAS)
# mul1's h = 1024 + the byte sum of $1 (the state times MUL1_MULT), as fp16 bits, in one dp4a (inline PTX)
MUL1_H_PTX = tl.constexpr("{ .reg .b32 m, z; mov.b32 m, 0x01010101; mov.b32 z, 0x6400; dp4a.u32.u32 $0, $1, m, z; }")


@triton.jit
def codebook_halves(state, mask, CB: tl.constexpr):
    """3INST (CB 0) and MCG (CB 1): uint32 pairs of fp16 halves whose sum is each state's weight; `mask` is
    HALVES_MASK (a kernel argument where ptxas should read it from the constant bank)."""
    if CB == 0:
        x = state * INST3_MULT + INST3_ADD
    else:
        x = state * MCG_MULT
    return (x & mask) ^ HALVES_XOR


@triton.jit
def codebook_fp16(state, CB: tl.constexpr):
    """fp16 weights of uint32 states 0..65535 (CB: 0 3inst, 1 mcg, 2 mul1), bit-exact with the format."""
    if CB == 2:
        x = state * MUL1_MULT
        b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        v = (b.to(tl.float32) * MUL1_K_INV + MUL1_BIAS).to(tl.float16)
    else:
        x = codebook_halves(state, HALVES_MASK, CB)
        v = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True) + \
            (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return v


@triton.jit
def codebook_operand(state, CB: tl.constexpr, MUL1_H: tl.constexpr, ASM: tl.constexpr):
    """codebook_fp16, except that with MUL1_H mul1 gives h = 1024 + its byte sum, the value before the format's
    fp16 FMA, which mul1_affine applies to the products (ASM: the byte sum in one dp4a, inline PTX: not under
    the interpreter)."""
    if CB == 2 and MUL1_H:
        x = state * MUL1_MULT
        if ASM:
            h = tl.inline_asm_elementwise(MUL1_H_PTX, "=r,r", [x], dtype=tl.uint32, is_pure=True, pack=1)
            return h.to(tl.uint16).to(tl.float16, bitcast=True)
        return ((x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24) + 1024).to(tl.float16)
    return codebook_fp16(state, CB)
