"""`Exl3Config`: vLLM's quantization config for EXL3 checkpoints.

Per module it picks the EXL3 method where the checkpoint holds EXL3 tensors for that module. Every other
module takes the method of the checkpoint's original quantization (`original_quantization_config`, e.g.
FP8 attention in a DeepSeek pack) when there is one, else vLLM's unquantized path.
"""
import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from ..format.config import QuantConfig
from .checkpoint import exl3_modules
from .compat import map_name
from .dummy import DummyExl3, is_dummy_load


class Exl3Config(QuantizationConfig):
    def __init__(self, qconfig: QuantConfig):
        super().__init__()
        self.qconfig = qconfig
        self.modules: dict[str, frozenset] | None = None  # filled by maybe_update_config
        self.scanned = False
        self.mapper = None  # the model's checkpoint-to-vLLM renames, set by apply_vllm_mapper
        original = qconfig.original_quantization_config
        self.original = None
        if original:
            from vllm.model_executor.layers.quantization import get_quantization_config
            self.original = get_quantization_config(original["quant_method"]).from_config(original)

    def __repr__(self) -> str:
        return f"Exl3Config({self.qconfig})"

    @classmethod
    def get_name(cls) -> str:
        return "exl3"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # the Triton kernels use Ampere+ tensor-core paths; CPUs skip this check

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> "Exl3Config":
        return cls(QuantConfig.from_dict(config))

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        self.modules = exl3_modules(model_name)
        self.scanned = True

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """Models that rename checkpoint tensors on load (DeepSeek-V4's native `layers.N.ffn...` becomes
        `model.layers.N.ffn...`) pass their renames here; module keys are looked up under the new names."""
        self.mapper = hf_to_vllm_mapper

    def _scanned(self) -> dict[str, frozenset]:
        if not self.scanned:
            raise RuntimeError("exl3: checkpoint not scanned (maybe_update_config was not called)")
        if self.modules is None:  # no weights on disk: only --load-format dummy can build this model
            if not is_dummy_load():
                raise ValueError("exl3: the model directory holds no safetensors; only --load-format dummy "
                                 "(random EXL3 experts) can serve it")
            return {}
        if self.mapper is not None:  # rename once, as vLLM renames the tensors it loads
            self.modules = {renamed(self.mapper, k): v for k, v in self.modules.items()}
            self.mapper = None
        return self.modules

    def _suffixes(self, prefix: str) -> list[frozenset | None]:
        """EXL3 suffix sets of the checkpoint modules behind a vLLM prefix (a fused layer has several)."""
        parent, _, name = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(name, [name])
        return [self._scanned().get(f"{parent}.{p}" if parent else p) for p in parts]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.platforms import current_platform

        from .linear import Exl3LinearMethod
        from .moe import Exl3MoEMethod

        if self.original is not None:
            self.original.packed_modules_mapping = self.packed_modules_mapping
        backend = kernel_backend(current_platform)

        if isinstance(layer, RoutedExperts):
            dummy = DummyExl3.of(self.qconfig) if is_dummy_load() else None
            suffixes = next((s for k, s in self._scanned().items() if k.startswith(prefix + ".")), None)
            if suffixes is None and dummy is not None and self.modules is None:
                suffixes = dummy.suffixes  # no checkpoint: every routed-expert layer is EXL3
            if suffixes is not None:
                return Exl3MoEMethod(layer.moe_config, suffixes, prefix, backend, dummy)
            return self.original.get_quant_method(layer, prefix) if self.original \
                else UnquantizedFusedMoEMethod(layer.moe_config)
        if isinstance(layer, LinearBase):
            found = self._suffixes(prefix)
            if all(s is None for s in found):
                return self.original.get_quant_method(layer, prefix) if self.original else UnquantizedLinearMethod()
            if any(s is None for s in found) or len(set(found)) > 1:
                raise ValueError(f"exl3: {prefix} fuses modules of which only some are EXL3 or whose EXL3 "
                                 f"tensors differ ({found}); this is not supported")
            return Exl3LinearMethod(found[0], backend, prefix)
        return None


def renamed(mapper, key: str) -> str:
    """A checkpoint module key under the model's renames (mapped as its `.trellis` tensor is on load)."""
    name = map_name(mapper, f"{key}.trellis")
    return key if name is None else name.removesuffix(".trellis")


def kernel_backend(platform) -> str:
    """The kernel backend for the platform: "triton" on GPUs (weights stay EXL3, decoded on the fly), where
    the kernels are required: a GPU they cannot run on is an error that says why, never a silent decode to
    dense (~8x the memory). On the CPU "torch" (decode at load), or the kernels when Triton emulates a GPU
    (TRITON_INTERPRET=1)."""
    from ..kernels.ops import pick_backend
    if platform.is_cpu():
        return pick_backend("auto", torch.device("cpu"))
    return pick_backend("triton", torch.device(platform.device_type))
