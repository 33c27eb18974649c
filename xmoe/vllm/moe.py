"""EXL3 routed experts in vLLM. Per-expert EXL3 tensors are collected as vLLM loads them, then decoded to
the compute dtype once loading ends (the CPU path: memory of a dense model, the routed experts included),
and the experts run as a plain torch loop over the experts that tokens were routed to."""
import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from ..format.layer import decode_weight

SHARD = {"w1": "gate", "w3": "up", "w2": "down"}


def collector(layer: torch.nn.Module, suffix: str, experts: bool) -> torch.nn.Parameter:
    """An empty parameter whose loader keeps each delivered tensor in layer._exl3[(shard, expert)][suffix].

    The loader has vLLM's signature for expert weights, or for (possibly merged) linear weights."""
    param = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    def keep(shard, expert, tensor):
        layer._exl3.setdefault((shard, expert), {})[suffix] = tensor.clone()

    def expert_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        keep(shard_id, expert_id, loaded_weight)
        return True if return_success else None

    def linear_loader(param, loaded_weight, loaded_shard_id=None):
        keep(loaded_shard_id, None, loaded_weight)

    set_weight_attrs(param, {"weight_loader": expert_loader if experts else linear_loader})
    return param


class Exl3MoEMethod(FusedMoEMethodBase):
    def __init__(self, moe, suffixes: frozenset, prefix: str):
        super().__init__(moe)
        if moe.ep_size > 1:
            raise NotImplementedError("exl3: expert parallelism is not supported yet")
        self.suffixes = suffixes  # the stored tensors of each expert projection (trellis, suh, svh, marker)
        self.prefix = prefix

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        layer._exl3 = {}
        layer._exl3_shape = (num_experts, hidden_size, intermediate_size_per_partition, params_dtype)
        for proj in ("w13", "w2"):
            for suffix in sorted(self.suffixes):
                layer.register_parameter(f"{proj}_{suffix}", collector(layer, suffix, experts=True))

    def process_weights_after_loading(self, layer) -> None:
        E, H, I, dtype = layer._exl3_shape
        rank = self.moe.tp_rank
        rows = slice(rank * I, (rank + 1) * I)  # this rank's part of the intermediate dimension
        w13 = torch.empty(E, 2 * I, H, dtype=dtype)
        w2 = torch.empty(E, H, I, dtype=dtype)
        for e in range(E):
            def dense(shard, out, inp):
                t = layer._exl3.get((shard, e))
                if t is None:
                    raise ValueError(f"exl3: {self.prefix}: expert {e} has no {SHARD[shard]} tensors in the checkpoint")
                return decode_weight(t)[:inp, :out].T  # (out, in)
            w13[e, :I] = dense("w1", I * self.moe.tp_size, H)[rows]
            w13[e, I:] = dense("w3", I * self.moe.tp_size, H)[rows]
            w2[e] = dense("w2", H, I * self.moe.tp_size)[:, rows]
        for proj in ("w13", "w2"):
            for suffix in self.suffixes:
                delattr(layer, f"{proj}_{suffix}")
        del layer._exl3
        layer.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(w2, requires_grad=False)

    def get_fused_moe_quant_config(self, layer):
        return None

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if self.moe.activation.value != "silu":
            raise NotImplementedError(f"exl3: activation {self.moe.activation.value} is not supported yet")
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in topk_ids.unique().tolist():
            token, slot = (topk_ids == e).nonzero(as_tuple=True)
            h = x[token] @ layer.w13_weight[e].T
            gate, up = h.chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ layer.w2_weight[e].T
            out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
        return out.to(x.dtype)
