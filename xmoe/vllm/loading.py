"""Loading EXL3 tensors into vLLM's layers: each module's stored tensors arrive one by one through vLLM's weight
loaders and are kept until loading ends, when the linear and MoE methods assemble them."""
from collections.abc import Iterable

import torch
from vllm.model_executor.utils import set_weight_attrs


def collector(layer: torch.nn.Module, suffix: str, experts: bool) -> torch.nn.Parameter:
    """An empty parameter whose loader keeps each delivered tensor in layer._exl3[(shard, expert)][suffix].

    The loader has vLLM's signature for expert weights, or for (possibly merged) linear weights. Experts are
    kept under their local id; under expert parallelism another rank's experts are skipped."""
    param = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    def keep(shard, expert, tensor):
        layer._exl3.setdefault((shard, expert), {})[suffix] = tensor.clone()

    def expert_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        local = layer._map_global_expert_id_to_local_expert_id(expert_id)  # -1: another EP rank's expert
        if local >= 0:
            keep(shard_id, local, loaded_weight)
        return local >= 0 if return_success else None

    def linear_loader(param, loaded_weight, loaded_shard_id=None):
        keep(loaded_shard_id, None, loaded_weight)

    set_weight_attrs(param, {"weight_loader": expert_loader if experts else linear_loader})
    return param


def load_named_experts(layer, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str]:
    """`RoutedExperts.load_weights` for per-expert EXL3 tensors (`experts.{id}.{proj}.{suffix}`): each goes
    to its expert and shard through the parameter's loader, whatever its rank."""
    mapping = layer.get_expert_mapping()
    for name, tensor in weights:
        qualified = f"{layer.layer_name}.{name}"
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in qualified:
                continue
            param_name = qualified.replace(weight_name, param_name).removeprefix(f"{layer.layer_name}.")
            param = getattr(layer, param_name)
            if param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=expert_id, return_success=True):
                yield param_name
            break
