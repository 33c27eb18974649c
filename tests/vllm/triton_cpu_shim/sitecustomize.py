"""Test-only shim, loaded by the Python of a vLLM server whose PYTHONPATH starts with this folder: it lets
vLLM 0.32's CPU implementation of DeepSeek-V4 run on a machine without triton-cpu. Two gaps are bridged:

1. vLLM's CPU build computes V4's sparse-attention metadata with Triton kernels and expects triton-cpu (a
   Triton with a "cpu" backend, not on PyPI). With TRITON_INTERPRET=1 the stock Triton runs those kernels in
   its interpreter on CPU tensors; vLLM only needs to see a backend registered under "cpu".
2. `DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler` returns no entry for the "c1a" and "c2a"
   layer types that the shared `build()` reads (KeyError 'c1a'); the CPU never uses these, so they are None.
Nothing here touches the model's arithmetic.
"""
import importlib.abc
import importlib.machinery
import os
import sys

CPU_MLA = "vllm.models.deepseek_v4.cpu.cpu_mla"


def _fill_layer_types(module) -> None:
    cls = module.DeepseekV4CPUSparseSWAMetadataBuilder
    build = cls.build_tile_scheduler

    def build_tile_scheduler(self, num_decode_tokens):
        return {"c1a": None, "c2a": None, **build(self, num_decode_tokens)}

    cls.build_tile_scheduler = build_tile_scheduler


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != CPU_MLA:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def run(module):
            exec_module(module)
            _fill_layer_types(module)

        spec.loader.exec_module = run
        return spec


if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.backends import backends

    backends.setdefault("cpu", backends["nvidia"])  # any entry: its driver is only counted, never launched
    sys.meta_path.insert(0, _PatchOnImport())
