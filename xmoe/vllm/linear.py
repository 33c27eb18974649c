"""EXL3 dense linear layers in vLLM (e.g. fully-EXL3 models made by exllamav3). The CPU path decodes each
layer to the compute dtype once loading ends and runs a plain matmul."""
import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.linear import LinearMethodBase, RowParallelLinear

from ..format.layer import decode_weight
from .moe import collector


class Exl3LinearMethod(LinearMethodBase):
    def __init__(self, suffixes: frozenset):
        self.suffixes = suffixes

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        layer._exl3 = {}
        layer._exl3_shape = (input_size_per_partition, list(output_partition_sizes), input_size, params_dtype)
        for suffix in sorted(self.suffixes):
            layer.register_parameter(suffix, collector(layer, suffix, experts=False))

    def process_weights_after_loading(self, layer) -> None:
        in_part, out_parts, in_full, dtype = layer._exl3_shape
        rank = get_tensor_model_parallel_rank()
        shards = _in_order(layer._exl3, len(out_parts))
        row_parallel = isinstance(layer, RowParallelLinear)
        pieces = []
        for key, out in zip(shards, out_parts):
            w = decode_weight(layer._exl3[key])  # (in, out), padded
            if row_parallel:
                pieces.append(w[rank * in_part:(rank + 1) * in_part, :out].T)
            else:
                pieces.append(w[:in_full, rank * out:(rank + 1) * out].T)
        for suffix in self.suffixes:
            delattr(layer, suffix)
        del layer._exl3
        layer.weight = torch.nn.Parameter(torch.cat(pieces).to(dtype).contiguous(), requires_grad=False)

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.weight, bias)


def _in_order(parts: dict, n: int) -> list:
    """Shard keys in the layer's output order: q, k, v or 0, 1, ... (None for an unfused layer)."""
    for order in (["q", "k", "v"], list(range(n)), [None]):
        keys = [(s, None) for s in order]
        if all(k in parts for k in keys):
            return keys
    raise ValueError(f"exl3: cannot order the loaded shards {sorted(map(str, parts))}")
