"""EXL3 kernels: Triton and Gluon GEMMs and fused MoE, with plain-torch references. The rest of xmoe imports
kernels.ops only; docs/architecture.md maps the modules, docs/kernels.md their launch settings."""
