"""EXL3 kernels: Triton GEMM/GEMV and fused MoE, with plain-torch references. Import from kernels.ops."""
