"""EXL3 dense linear layers in vLLM (e.g. fully-EXL3 models made by exllamav3). On GPUs the EXL3 tensors
stay as they are and the Triton kernel decodes them on the fly; on the CPU each layer is decoded to the
compute dtype once loading ends and runs as a plain matmul."""
import logging

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import LinearMethodBase, RowParallelLinear

from ..format.layer import decode_weight, slice_layer
from ..kernels.ops import Exl3Slices, Exl3Weight, exl3_linear_op, register_linear, warm_up_linear
from .loading import collector
from .warmup import max_batch_tokens, wanted

log = logging.getLogger(__name__)


class Exl3LinearMethod(LinearMethodBase):
    def __init__(self, suffixes: frozenset, backend: str, prefix: str = "layer"):
        self.suffixes = suffixes
        self.backend = backend  # "triton": keep EXL3, "torch": decode at load
        self.prefix = prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        layer._exl3 = {}
        layer._exl3_shape = (input_size_per_partition, list(output_partition_sizes), input_size, params_dtype)
        layer._exl3_device = torch.empty(0).device  # vLLM builds the model under its target device
        self.max_tokens = max_batch_tokens()
        for suffix in sorted(self.suffixes):
            layer.register_parameter(suffix, collector(layer, suffix, experts=False))

    def process_weights_after_loading(self, layer) -> None:
        in_part, out_parts, in_full, dtype = layer._exl3_shape
        rank = get_tensor_model_parallel_rank()
        shards = _in_order(layer._exl3, len(out_parts))
        row_parallel = isinstance(layer, RowParallelLinear)
        if self.backend == "triton":
            layer._weights = [self._slice(layer._exl3[key], row_parallel, rank, in_part, in_full, out)
                              .to(layer._exl3_device) for key, out in zip(shards, out_parts)]
            slices = self._merge(layer._weights)
            layer._exl3_index = register_linear(slices if slices is not None else layer._weights, owner=layer)
            if wanted(layer._exl3_device):  # compile every batch size's kernels now, not while requests wait
                warm_up_linear(slices if slices is not None else layer._weights, self.max_tokens, dtype)
            del layer._weights
            for suffix in self.suffixes:
                delattr(layer, suffix)
            del layer._exl3
            return
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

    def _slice(self, tensors, row_parallel, rank, in_part, in_full, out) -> Exl3Weight:
        """This rank's part of one shard (rows for a row-parallel layer, else columns), at multiples of 128."""
        if get_tensor_model_parallel_world_size() > 1:
            side, size = ("in", in_part) if row_parallel else ("out", out)
            try:
                tensors = slice_layer(tensors, side, rank * size, (rank + 1) * size)
            except ValueError as err:
                raise ValueError(f"exl3: {self.prefix}: cannot take rank {rank}'s slice: {err}") from None
        return Exl3Weight.from_tensors(tensors, in_part if row_parallel else in_full, out, self.prefix)

    def _merge(self, weights: list) -> Exl3Slices | None:
        """A merged layer's parts (q, k, v; gate, up) as one set of launches, where they allow it."""
        if len(weights) == 1:
            return None
        try:
            return Exl3Slices.of(weights, self.prefix)
        except ValueError as err:
            log.info("exl3: %s runs its %d parts one at a time: %s", self.prefix, len(weights), err)
            return None

    def apply(self, layer, x, bias=None):
        if self.backend == "triton":
            y = exl3_linear_op(x, layer._exl3_index, "triton")
            return y if bias is None else y + bias
        return torch.nn.functional.linear(x, layer.weight, bias)


def _in_order(parts: dict, n: int) -> list:
    """Shard keys in the layer's output order: q, k, v or 0, 1, ... (None for an unfused layer)."""
    for order in (["q", "k", "v"], list(range(n)), [None]):
        keys = [(s, None) for s in order]
        if all(k in parts for k in keys):
            return keys
    raise ValueError(f"exl3: cannot order the loaded shards {sorted(map(str, parts))}")
