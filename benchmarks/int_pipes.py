"""Which pipe takes each integer instruction of the decode, and at what rate: independent chains of one
instruction, or of two alternating, at full occupancy. A pair on two pipes issues about twice as fast as one on a
single pipe; a pair that shares a pipe runs at that pipe's rate.

    python benchmarks/int_pipes.py [--steps 2000]
"""
import argparse

import torch
import triton
import triton.language as tl

OPS = {  # (PTX, its SASS on sm_90)
    "imad": ("mad.lo.u32 $0, $1, 0x3453e013, $2;", "IMAD"),
    "imad.hi": ("mul.hi.u32 $0, $1, $2;", "IMAD.HI"),
    "prmt": ("prmt.b32 $0, $1, $2, 0x5432;", "PRMT"),
    "lop3": ("lop3.b32 $0, $1, $2, 0x3b603b60, 0x6c;", "LOP3"),
    "dp2a": ("dp2a.lo.u32.u32 $0, $1, 256, $2;", "IDP.2A"),
}
PAIRS = [("imad", "imad"), ("imad.hi", "imad.hi"), ("prmt", "prmt"), ("lop3", "lop3"), ("dp2a", "dp2a"),
         ("prmt", "lop3"), ("prmt", "imad"), ("prmt", "dp2a"), ("lop3", "dp2a"), ("imad", "dp2a")]


@triton.jit
def chains(out_ptr, steps, A: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = offs.to(tl.uint32) * 2654435761
    y = offs.to(tl.uint32) * 40503 + 17
    for _ in range(steps):  # four dependent instructions a step, A and B in turn
        x = tl.inline_asm_elementwise(A, "=r,r,r", [x, y], dtype=tl.uint32, is_pure=True, pack=1)
        y = tl.inline_asm_elementwise(B, "=r,r,r", [y, x], dtype=tl.uint32, is_pure=True, pack=1)
        x = tl.inline_asm_elementwise(A, "=r,r,r", [x, y], dtype=tl.uint32, is_pure=True, pack=1)
        y = tl.inline_asm_elementwise(B, "=r,r,r", [y, x], dtype=tl.uint32, is_pure=True, pack=1)
    tl.store(out_ptr + offs, x ^ y)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    block, warps, programs = 2048, 8, 8 * props.multi_processor_count  # 8 values a thread, 64 warps a multiprocessor
    out = torch.empty(programs * block, dtype=torch.int32, device="cuda")
    print(f"{props.name}: ns per warp instruction and scheduler (4 a multiprocessor)")
    print(f"{'instructions':>18} {'us':>9} {'G instr/s':>10} {'ns/instr':>9}")
    for a, b in PAIRS:
        run = lambda: chains[(programs,)](out, args.steps, OPS[a][0], OPS[b][0], block, num_warps=warps)  # noqa: E731
        ms = triton.testing.do_bench(run, warmup=5, rep=50)
        instructions = programs * block * args.steps * 4
        per_scheduler = instructions / 32 / (4 * props.multi_processor_count)
        print(f"{OPS[a][1] + ' + ' + OPS[b][1]:>18} {ms * 1e3:9.1f} {instructions / ms / 1e6:10.1f} "
              f"{ms * 1e6 / per_scheduler:9.3f}")


if __name__ == "__main__":
    main()
