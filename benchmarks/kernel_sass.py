"""Static cost of the grouped EXL3 GEMM: compile it for sm_90 (no GPU needed: Triton ships ptxas and
cuobjdump), then print registers, local-memory use and the SASS of the K loop per decoded weight and thread
(grouped_gemv: per weight and row, for its one- and two-row loops). Arguments are aligned as at V4.1 shapes,
which decides how Triton vectorises the loads. With --mma: the same for gluon_mma's grouped_mma (at the
tuning's registers for two streams, one, and chunks of 32 rows) and decode_weights at K = 1-4 (and 1.5, 2.5,
3.5 for mul1). With --viterbi: the fp16-pair Viterbi's step loop at K = 2, 3, 4, per candidate (65,536 a step).

    python benchmarks/kernel_sass.py [--arch 90] [--codebook mcg] [--mma | --viterbi]
"""
import argparse
import collections
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from cubins import compile_gluon, cuobjdump, resources  # noqa: E402
from xmoe.kernels import triton_gemm, triton_gemv  # noqa: E402
from xmoe.kernels.launch import CODEBOOK_ID  # noqa: E402
from xmoe.kernels.tuning import DEFAULT  # noqa: E402
ARGS = [("a0_ptr", "*fp16"), ("a1_ptr", "*fp16"), ("chunk_pos_ptr", "*i32"), ("chunk_len_ptr", "*i32"),
        ("chunk_expert_ptr", "*i32"), ("n_chunks_ptr", "*i32"), ("t0_ptr", "*i32"), ("t1_ptr", "*i32"),
        ("table_ptr", "*i32"), ("p0_ptr", "*fp32"), ("p1_ptr", "*fp32"), ("P", "i32"), ("k", "i32"), ("n", "i32"),
        ("stride_te", "i32")]


GEMV_ARGS = [("a0_ptr", "*fp32"), ("a1_ptr", "*fp32"), ("chunk_pos_ptr", "*i32"), ("chunk_len_ptr", "*i32"),
             ("chunk_expert_ptr", "*i32"), ("n_chunks_ptr", "*i32"), ("t0_ptr", "*i32"), ("t1_ptr", "*i32"),
             ("p0_ptr", "*fp32"), ("p1_ptr", "*fp32"), ("P", "i32"), ("k", "i32"), ("n", "i32"), ("stride_te", "i32"),
             ("mask", "i32")]


def variants():
    """(name, BM, BN, BK, warps, stages, dual, tiled, swap, gemv): the default tuning's tiles of grouped_gemm and
    grouped_gemv, single and dual (gate+up)."""
    for field in ("gemv", "dot_decode", "dot_prefill", "gather_decode", "gather_prefill"):
        t = getattr(DEFAULT, field)
        for dual in (False, True):
            name = f"{field}{' dual' if dual else ''}"
            yield name, t.BM, t.BN, t.BK, t.warps, t.stages, dual, not field.startswith("gather"), t.swap, \
                field == "gemv"


def compile_variant(arch, BM, BN, BK, warps, stages, dual, tiled, swap=False, gemv=False, K=2, CB=1):
    if gemv:
        consts = dict(W=8 * K, CB=CB, DUAL=dual, BN=BN, BK=BK, SPLIT=1, KLOG=K.bit_length() - 1,
                      ASM=True, ROWS=BM)
        fn, args = triton_gemv.grouped_gemv, GEMV_ARGS
    else:
        consts = dict(W=8 * K, CB=CB, DUAL=dual, BM=BM, BN=BN, BK=BK, SPLIT=1, TILED=tiled,
                      KLOG=K.bit_length() - 1, SWAP=swap, ASM=True)
        fn, args = triton_gemm.grouped_gemm, ARGS
    sig = dict(args, **{c: "constexpr" for c in consts})
    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, _) in enumerate(args)  # as at V4.1 shapes
               if name.endswith("_ptr") or name in ("k", "n", "stride_te")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))


def loop_ops(sass: str) -> list[collections.Counter]:
    """Opcode counts between the target and the source of each backward branch (the K loops; grouped_gemv has
    one for chunks of one row, then one for two), in code order."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    loops = sorted((int(m.group(1), 16), a) for a, t in ins if (m := re.search(r"BRA\s.*?(0x[0-9a-f]+)", t))
                   and int(m.group(1), 16) < a)
    return [collections.Counter((w[1] if w[0].startswith("@") else w[0]).split(".")[0]
                                for w in (t.split() for a, t in ins if start <= a <= end)) for start, end in loops]


ALU = ("LOP3", "PRMT", "SHF", "IADD3", "SEL", "ISETP", "LEA", "IABS", "FLO", "POPC")  # the integer pipe
FMA = ("IMAD", "IDP")  # IMAD (IMAD.HI at half rate) and dp2a/dp4a: the FMA pipe


def pipes(counts: collections.Counter, per: float) -> str:
    """Instructions a decoded weight on the integer (ALU) and FMA pipes; on sm_90 each takes a warp instruction
    every two cycles (benchmarks/int_pipes.py), so each needs twice its count in cycles against issue's one."""
    alu, fma = (sum(counts[op] for op in names) / per for names in (ALU, FMA))
    return f"ALU pipe {alu:.2f}, FMA pipe {fma:.2f}"


def viterbi(arch: int, warps: int = 16) -> None:
    from xmoe.quant import viterbi_half

    for K in (2, 3, 4):
        fn = viterbi_half._forward_kernel if K == 2 else viterbi_half._forward_kernel_k
        sig = {"tiles_ptr": "*fp32", "ends_ptr": "*i32", "bp_ptr": "*i32" if K == 2 else "*i16",
               **({} if K == 2 else {"K": "constexpr"}), "CB": "constexpr", "WARMUP": "constexpr",
               "PASS": "constexpr", "ASM": "constexpr"}
        consts = dict(CB=1, WARMUP=128, PASS=2, ASM=True, **({} if K == 2 else {"K": K}))
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts,
                                        attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
        cubin = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps)).asm["cubin"]
        usage = resources(cubin)
        counts = max(loop_ops(cuobjdump(cubin, "-sass")), key=lambda c: sum(c.values()))
        per = 65536 / (32 * warps)
        print(f"viterbi_half K={K} pass 2, MCG, sm_{arch}, Triton {triton.__version__}, {warps} warps: "
              f"{usage['REG']} registers, {usage['STACK']} B stack\n  step loop: {sum(counts.values()) / per:.2f} "
              f"instructions per candidate ({', '.join(f'{op} {n / per:.2f}' for op, n in counts.most_common(10))})")


def gluon_kernels(arch: int, codebook: str) -> None:
    """grouped_mma (gate and up, and down alone) and decode_weights at the default tuning's launch settings."""
    from xmoe.kernels import gluon_mma

    t = DEFAULT
    BK, BN, warps = t.mma_decode.BK, t.mma_decode.BN, t.mma_decode.warps
    RM, RK, RN = t.mma_prefill.BM, t.mma_prefill.BK, t.mma_prefill.BN  # the same warps
    mma_args = {**dict(ARGS[:8]), "p0_ptr": "*fp32", "p1_ptr": "*fp32", **dict(ARGS[11:]), "mask": "i32"}
    mma_args.update(a0_ptr="*i32", a1_ptr="*i32")  # doubled fp16
    del mma_args["n"]  # a constexpr of grouped_mma
    decode_args = {"t_ptr": "*i32", "expert_ptr": "*i32", "out_ptr": "*fp16", "k": "i32", "n": "i32",
                   "stride_te": "i32", "mask": "i32"}
    CB = CODEBOOK_ID[codebook]
    print(f"gluon_mma, {codebook}, sm_{arch}, Triton {triton.__version__}, BN={BN} BK={BK} warps={warps}")
    for K in (1, 2, 3, 4) + ((1.5, 2.5, 3.5) if codebook == "mul1" else ()):
        # n: V4.1's gate and up; IDP: the states the launcher takes by dp2a
        mma = dict(n=1152, W=int(8 * K), CB=CB, SPLIT=1, PAIR=False, IDP=t.idp(int(8 * K), codebook))
        for name, fn, args, consts, registers in (
                ("grouped_mma dual", gluon_mma.grouped_mma, mma_args,
                 dict(mma, DUAL=True, BN=BN, BK=BK, ROWS=8, UNROLL=t.mma_unroll_two), t.mma_registers_two),
                ("grouped_mma pair", gluon_mma.grouped_mma, mma_args,
                 dict(mma, DUAL=False, BN=BN, BK=BK, ROWS=8, UNROLL=t.mma_unroll_two, PAIR=True), t.mma_registers_two),
                ("grouped_mma", gluon_mma.grouped_mma, mma_args,
                 dict(mma, DUAL=False, BN=BN, BK=BK, ROWS=8, UNROLL=t.mma_unroll_one), t.mma_registers_one),
                ("grouped_mma rows", gluon_mma.grouped_mma, mma_args,
                 dict(mma, DUAL=False, BN=RN, BK=RK, ROWS=RM, UNROLL=1, IDP=0), t.mma_registers_wide),
                ("decode_weights", gluon_mma.decode_weights, decode_args,
                 dict(W=int(8 * K), CB=CB, BN=128, BK=32, STEPS=8, MUL1_H=CB == 2), 0)):
            kernel = compile_gluon(fn, args, consts, arch, num_warps=warps,
                                   **({"maxnreg": registers} if registers else {}))
            cubin = kernel.asm["cubin"]
            usage = resources(cubin)
            counts = max(loop_ops(cuobjdump(cubin, "-sass")), key=lambda c: sum(c.values()))
            streams = 1 + bool(consts.get("DUAL") or consts.get("PAIR"))  # projections, or column blocks, a program
            per = (128 * 32 if name == "decode_weights" else  # weights a thread in the loop's K steps
                   consts["BK"] * consts["BN"] * streams * consts["UNROLL"]) / (32 * warps)
            top = ", ".join(f"{op} {n / per:.2f}" for op, n in counts.most_common(8))
            print(f"K={K} {name:<16}: {usage['REG']} registers, {usage['STACK']} B stack; K loop "
                  f"{sum(counts.values()) / per:.2f} instructions per decoded weight ({top}; {pipes(counts, per)})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--viterbi", action="store_true", help="the fp16-pair Viterbi instead of the GEMM kernels")
    p.add_argument("--mma", action="store_true", help="gluon_mma's kernels instead of triton_gemm's")
    p.add_argument("--codebook", choices=("3inst", "mcg", "mul1"), default="mcg")
    args = p.parse_args()
    if args.viterbi:
        return viterbi(args.arch)
    if args.mma:
        return gluon_kernels(args.arch, args.codebook)
    print(f"grouped_gemm, K=2 {args.codebook}, sm_{args.arch}, Triton {triton.__version__}")
    for name, BM, BN, BK, warps, stages, dual, tiled, swap, gemv in variants():
        kernel = compile_variant(args.arch, BM, BN, BK, warps, stages, dual, tiled, swap, gemv,
                                 CB=CODEBOOK_ID[args.codebook])
        cubin = kernel.asm["cubin"]
        usage = resources(cubin)
        loops = loop_ops(cuobjdump(cubin, "-sass"))
        if not gemv:  # the K loop is the longest
            loops = [max(loops, key=lambda c: sum(c.values()))]
        # products (decoded weight x row) per thread and iteration: a two-row chunk of grouped_gemv halves BK
        per = BK * BN * (2 if dual else 1) / (32 * warps)
        print(f"{name:<20} BM={BM} BN={BN} BK={BK} warps={warps}{' swap' if swap else ''}: {usage['REG']} registers, "
              f"{usage['STACK']} B stack")
        for rows, counts in enumerate(loops, 1):
            top = ", ".join(f"{op} {n / per:.2f}" for op, n in counts.most_common(8))
            what = f"{rows}-row chunks" if gemv else "K loop"
            unit = "weight and row" if gemv else "decoded weight"
            print(f"  {what}: {sum(counts.values()) / per:.2f} instructions per {unit} ({top})")


if __name__ == "__main__":
    main()
