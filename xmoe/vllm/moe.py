"""EXL3 routed experts in vLLM. Per-expert EXL3 tensors are collected as vLLM loads them; once loading ends
they are either kept as EXL3, stacked per projection, for the fused Triton kernel (GPUs), or decoded to the
compute dtype and run as a plain torch loop (the CPU: memory of a dense model, the routed experts included).
"""
import functools
import logging
import types

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from ..format.layer import decode_weight, slice_layer
from ..kernels.ops import Exl3Experts, Exl3Weight, activation_ref, fused_moe, warm_up_moe
from .loading import collector, load_named_experts
from .warmup import max_batch_tokens, wanted

SHARD = {"w1": "gate", "w3": "up", "w2": "down"}
log = logging.getLogger(__name__)


@functools.cache
def warn_dummy(dummy) -> None:
    log.warning("exl3: random EXL3 experts at K=%g %s (--load-format dummy): for speed, not for answers",
                dummy.K, dummy.codebook)


class Exl3MoEMethod(FusedMoEMethodBase):
    def __init__(self, moe, suffixes: frozenset, prefix: str, backend: str, dummy=None):
        super().__init__(moe)
        self.suffixes = suffixes  # the stored tensors of each expert projection (trellis, suh, svh, marker)
        self.prefix = prefix
        self.backend = backend  # "triton": keep EXL3 and run the fused kernel; "torch": decode at load
        self.dummy = dummy  # a `DummyExl3` under --load-format dummy: random EXL3 experts, no checkpoint

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        fused = layer.expert_map_manager.num_fused_shared_experts
        if fused:  # vLLM would load the dense shared expert into slot E, which holds no EXL3 tensors
            raise NotImplementedError(f"exl3: {self.prefix}: {fused} shared expert(s) fused into the routed-expert "
                                      "layer are not supported; serve without shared-expert fusion")
        layer._exl3 = {}
        layer._exl3_shape = (num_experts, hidden_size, intermediate_size_per_partition, params_dtype)
        layer._exl3_device = torch.empty(0).device  # vLLM builds the model under its target device
        self.max_tokens = max_batch_tokens()
        for proj in ("w13", "w2"):
            for suffix in sorted(self.suffixes):
                layer.register_parameter(f"{proj}_{suffix}", collector(layer, suffix, experts=True))
        # vLLM 0.26's generic loader takes every 3-D tensor for a packed [E, N, K] one, trellis included;
        # this layer's own loader matches each tensor to its expert by name on every release.
        layer.load_weights = types.MethodType(load_named_experts, layer)

    def _tensors(self, layer, shard: str, e: int) -> dict:
        t = layer._exl3.get((shard, e))
        if t is None:
            raise ValueError(f"exl3: {self.prefix}: expert {e} has no {SHARD[shard]} tensors in the checkpoint")
        return t

    def _stack(self, layer) -> Exl3Experts:
        """This rank's slice of every expert, stacked per projection: gate/up split on the output side and
        down on the input side, at multiples of 128 (the Hadamard blocks)."""
        E, H, I, _ = layer._exl3_shape
        rank, tp = self.moe.tp_rank, self.moe.tp_size
        cut = (lambda t, side: slice_layer(t, side, rank * I, (rank + 1) * I)) if tp > 1 else (lambda t, side: t)
        try:
            proj = {s: [Exl3Weight.from_tensors(cut(self._tensors(layer, s, e), "in" if s == "w2" else "out"),
                                                I if s == "w2" else H, H if s == "w2" else I,
                                                f"{self.prefix}.{e}.{SHARD[s]}") for e in range(E)]
                    for s in SHARD}
        except ValueError as err:
            raise ValueError(f"exl3: {self.prefix}: cannot take rank {rank}'s slice of {tp}: {err}") from None
        return Exl3Experts(*(Exl3Weight.stack(proj[s], f"{self.prefix} {SHARD[s]}") for s in ("w1", "w3", "w2")))

    def process_weights_after_loading(self, layer) -> None:
        E, H, I, dtype = layer._exl3_shape
        if not layer._exl3 and self.dummy is not None:  # --load-format dummy: nothing was delivered
            warn_dummy(self.dummy)
            if self.backend == "triton":
                layer._experts = self.dummy.experts(E, H, I, layer._exl3_device)
                self._drop_collectors(layer)
                return self._warm_up(layer)
            full = self.dummy.experts(E, H, I * self.moe.tp_size, "cpu")
            layer._exl3 = {(s, e): getattr(full, SHARD[s]).tensors(e) for s in SHARD for e in range(E)}
        if self.backend == "triton":
            layer._experts = self._stack(layer).to(layer._exl3_device)
            self._drop_collectors(layer)
            return self._warm_up(layer)
        rank = self.moe.tp_rank
        rows = slice(rank * I, (rank + 1) * I)  # this rank's part of the intermediate dimension
        w13 = torch.empty(E, 2 * I, H, dtype=dtype)
        w2 = torch.empty(E, H, I, dtype=dtype)
        for e in range(E):
            def dense(shard, out, inp):
                return decode_weight(self._tensors(layer, shard, e))[:inp, :out].T  # (out, in)
            w13[e, :I] = dense("w1", I * self.moe.tp_size, H)[rows]
            w13[e, I:] = dense("w3", I * self.moe.tp_size, H)[rows]
            w2[e] = dense("w2", H, I * self.moe.tp_size)[:, rows]
        self._drop_collectors(layer)
        layer.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(w2, requires_grad=False)

    def _warm_up(self, layer) -> None:
        """Compile the kernels of every batch size now, not while requests wait (once per process and shapes)."""
        if wanted(layer._exl3_device):
            warm_up_moe(layer._experts, self.moe.experts_per_token, self.max_tokens, layer._exl3_shape[3],
                        layer.expert_map, self.moe.swiglu_limit)

    def _drop_collectors(self, layer) -> None:
        for proj in ("w13", "w2"):
            for suffix in self.suffixes:
                delattr(layer, f"{proj}_{suffix}")
        del layer._exl3

    def get_fused_moe_quant_config(self, layer):
        return None

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if self.moe.activation.value != "silu":
            raise NotImplementedError(f"exl3: activation {self.moe.activation.value} is not supported yet")
        limit = self.moe.swiglu_limit
        expert_map = layer.expert_map  # global -> local expert id, -1 for another rank's (None without EP)
        if self.backend == "triton":  # graph-safe: no host sync, scratch from the caching allocator
            return fused_moe(x, topk_ids, topk_weights, layer._experts, limit, expert_map, backend="triton")
        local = topk_ids if expert_map is None else expert_map[topk_ids.long()]
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in local.unique().tolist():
            if e < 0:
                continue
            token, slot = (local == e).nonzero(as_tuple=True)
            gate, up = (x[token] @ layer.w13_weight[e].T).chunk(2, dim=-1)
            y = activation_ref(gate, up, limit) @ layer.w2_weight[e].T
            out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
        return out.to(x.dtype)

