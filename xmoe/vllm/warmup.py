"""When the plugin compiles its kernels at load (kernels.warmup): on CUDA GPUs, where Triton compiles (the
interpreter on the CPU compiles nothing), unless XMOE_WARMUP=0; for batches up to vLLM's largest."""
import os

import torch


def max_batch_tokens() -> int:
    """The most tokens vLLM's scheduler puts in one step, read while the model is built (8192 outside vLLM)."""
    from vllm.config import get_current_vllm_config_or_none
    config = get_current_vllm_config_or_none()
    return config.scheduler_config.max_num_batched_tokens if config is not None else 8192


def wanted(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("XMOE_WARMUP", "1") != "0"
