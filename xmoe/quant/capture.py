"""Calibration capture, one decoder layer at a time, with transformers' own modules for the architecture.

The model's skeleton is built on the meta device; a layer is materialised only when its turn comes, its
weights read from the source shards (FP8 blocks dequantized, names mapped by transformers' own renaming
rules), and the calibration hidden states are run through it by the base model's forward with that single
layer in place (rotary embeddings and the causal mask come from transformers too).

The routed experts run in `CaptureExperts`, which takes the place of the layer's experts module: tokens
go to the experts the router picked, as in the model, and the Hessians of every expert are accumulated over
*all* tokens, so no expert is starved of calibration data: gate and up of all experts share H of the block
input, each down projection gets H of act(gate) * up over all tokens. Rows holding inf or NaN are dropped.
"""
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .experts import ExpertProj
from .source import SCALE_SUFFIXES, dequantize
from .st_io import CheckpointError


# Architectures whose decoder layers the one-layer forward cannot drive, and why.
UNSUPPORTED = {
    "deepseek_v4": "its residual is a stack of parallel streams (hyper-connections) and its first MoE layers route by "
                   "token id, while the capture runs one layer at a time on plain hidden states",
}


def capture_refusal(config: dict) -> str | None:
    """Why the calibration capture cannot run this model (config.json), or None."""
    try:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return "transformers>=5 is not installed (pip install 'xmoe[calibrate]')"
    model_type = config.get("model_type")
    if model_type in UNSUPPORTED:
        return f"model_type {model_type}: {UNSUPPORTED[model_type]}"
    if model_type not in CONFIG_MAPPING:
        return f"transformers {AutoConfig.__module__.split('.')[0]} does not know model_type {model_type!r}"
    return None


class CaptureExperts(nn.Module):
    """Routed experts from per-expert (out, in) weights, with the forward signature of transformers' MoE
    experts modules: (tokens (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)."""

    def __init__(self, gate: list, up: list, down: list, act, capture: bool):
        super().__init__()
        self.gate, self.up, self.down, self.act = gate, up, down, act
        self.capture = capture
        E, H, inter = len(gate), gate[0].shape[1], gate[0].shape[0]
        dev = gate[0].device
        self.h_input = torch.zeros(H, H, device=dev) if capture else None
        self.h_down = [torch.zeros(inter, inter, device=dev) for _ in range(E)] if capture else None
        self.count = 0  # tokens in the Hessians (every token reaches every expert's)
        self.dropped = 0  # rows left out for holding inf or NaN
        self.routed = [0] * E  # tokens the router sent to each expert
        self.energy = 0.0  # sum of squares of the block's routed output (weighs its layer in bit allocation)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = hidden_states
        out = torch.zeros_like(x)
        if self.capture:
            self._accumulate(x)
        for e in range(len(self.gate)):
            tok, slot = torch.where(top_k_index == e)
            self.routed[e] += tok.numel()
            if tok.numel():
                xe = x[tok]
                y = self._mid(xe, e) @ self.down[e].T
                out.index_add_(0, tok, y * top_k_weights[tok, slot, None].to(y.dtype))
        self.energy += float(out.double().pow(2).sum())
        return out

    def _mid(self, x, e):
        return self.act(torch.cat([x @ self.gate[e].T, x @ self.up[e].T], dim=-1))

    def _accumulate(self, x):
        keep = torch.isfinite(x).all(-1)
        x = x[keep]
        self.dropped += int((~keep).sum())
        self.count += x.shape[0]
        xf = x.float()
        self.h_input += xf.T @ xf
        for e in range(len(self.gate)):
            m = self._mid(x, e).float()
            m = m[torch.isfinite(m).all(-1)]
            self.h_down[e] += m.T @ m

    def hessians(self) -> dict[str, torch.Tensor]:
        """Mean x^T x: 'input' (gate and up of every expert) and 'down.E' per expert, float32."""
        n = max(self.count, 1)
        return {"input": self.h_input / n, **{f"down.{e}": h / n for e, h in enumerate(self.h_down)}}


def _gated(experts: nn.Module):
    """act(gate) * up of transformers' experts module (its own clamp where it has one) on [gate | up]."""
    if hasattr(experts, "_apply_gate"):
        return experts._apply_gate
    act = experts.act_fn

    def gated(gu):
        g, u = gu.chunk(2, dim=-1)
        return act(g) * u
    return gated


class LayerStack:
    """The decoder layers of the source model, materialised one at a time on `device` in `dtype`."""

    def __init__(self, src: Path, shards: dict, experts: list[ExpertProj], device: str, dtype: torch.dtype):
        try:
            from transformers import AutoConfig, AutoModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming, rename_source_key
        except ImportError as e:
            raise ImportError(f"calibration needs transformers>=5 (pip install 'xmoe[calibrate]'), or use "
                              f"--no-calibrate: {e}") from None
        self.src, self.device, self.dtype = src, device, dtype
        config = AutoConfig.from_pretrained(src)
        reason = capture_refusal(config.to_dict())
        if reason:
            raise CheckpointError(f"{src}: calibration cannot run: {reason}; use --no-calibrate")
        with torch.device("meta"):
            base = AutoModel.from_config(config, attn_implementation="sdpa")
        if not all(hasattr(base, a) for a in ("layers", "norm", "embed_tokens")):
            raise CheckpointError(f"{src}: calibration does not support model_type {config.model_type!r} "
                                  f"({type(base).__name__} has no layers/norm/embed_tokens); use --no-calibrate")
        self.layers, self.base = base.layers, base
        base.layers, base.norm = nn.ModuleList(), nn.Identity()
        if hasattr(base, "rotary_emb"):
            base.rotary_emb = type(base.rotary_emb)(config).to(device)
        renamings = [t for t in get_model_conversion_mapping(base) if isinstance(t, WeightRenaming)]
        meta = base.state_dict() | {f"layers.{i}.{k}": v for i, layer in enumerate(self.layers)
                                    for k, v in layer.state_dict().items()}
        self.rename = lambda name: rename_source_key(name, renamings, [], base.base_model_prefix, meta)[0]
        self.location = {t.name: shard for shard, ts in shards.items() for t in ts}
        self.names = self._map_names(experts)
        self.experts = {}  # layer -> {expert: {role: ExpertProj}}
        for p in experts:
            self.experts.setdefault(p.layer, {}).setdefault(p.expert, {})[p.role] = p
        self.acts = {}  # layer -> act(gate) * up of its experts module
        self.paths = {i: self._experts_path(i, base) for i in self.experts}  # e.g. "mlp.experts"

    def _map_names(self, experts: list[ExpertProj]) -> dict[str, tuple[str, str | None]]:
        """The model's name -> (source weight, its scale or None) of every tensor but the routed experts'."""
        routed = {p.source for p in experts} | {p.scale for p in experts if p.scale}
        names = {}
        for name in self.location:
            if name in routed or any(name.endswith("." + s) for s in SCALE_SUFFIXES):
                continue
            stem = name[:-len("weight")] if name.endswith("weight") else None
            scale = next((stem + s for s in SCALE_SUFFIXES if stem and stem + s in self.location), None)
            names[self.rename(name)] = (name, scale)
        return names

    def _experts_path(self, layer: int, base: nn.Module) -> str:
        p = next(iter(next(iter(self.experts[layer].values())).values()))
        target = self.rename(p.source)
        m = re.match(rf"^(?:{re.escape(base.base_model_prefix)}\.)?layers\.{layer}\.(.*?experts)(\.|$)", target)
        if not m:
            raise CheckpointError(f"{self.src}: cannot place expert tensor {p.source} in layer {layer} of "
                                  f"{type(base).__name__} (mapped to {target})")
        return m[1]

    def read(self, name: str) -> torch.Tensor:
        weight, scale = self.names[name]
        with safe_open(str(self.src / self.location[weight]), framework="pt") as f:
            w = f.get_tensor(weight)
            s = f.get_tensor(scale) if scale else None
        return (dequantize(w, s, weight) if s is not None else w).to(self.device, self.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if "embed_tokens.weight" not in self.names:
            raise CheckpointError(f"{self.src}: no embedding table (embed_tokens.weight) found")
        return nn.functional.embedding(tokens.to(self.device), self.read("embed_tokens.weight"))

    def layer(self, i: int, experts: dict | None, capture: bool) -> nn.Module:
        """Layer i with its weights; its routed experts (if any) run from `experts` {expert: {role: (out, in)}}."""
        layer = self.layers[i]
        path = self.paths.get(i)
        if path:
            owner, leaf = self._slot(layer, path)
            if i not in self.acts:
                self.acts[i] = _gated(getattr(owner, leaf))
            setattr(owner, leaf, nn.Module())  # the experts' own (meta) tensors are never materialised
        layer = layer.to_empty(device=self.device).to(self.dtype)
        self._fill(layer, i)
        if path:
            E = len(experts)
            ws = {r: [experts[e][r].to(self.device, self.dtype) for e in range(E)] for r in ("gate", "up", "down")}
            setattr(owner, leaf, CaptureExperts(ws["gate"], ws["up"], ws["down"], self.acts[i], capture))
        return layer

    def _fill(self, layer: nn.Module, i: int) -> None:
        with torch.no_grad():
            for key, t in layer.state_dict().items():
                name = f"layers.{i}.{key}"
                if name not in self.names:
                    raise CheckpointError(f"{self.src}: layer {i}: no source tensor for {name}")
                value = self.read(name)
                if value.shape != t.shape:
                    raise CheckpointError(f"{self.src}: {self.names[name][0]}: shape {tuple(value.shape)}, "
                                          f"the model's {name} is {tuple(t.shape)}")
                t.copy_(value.to(t.dtype))

    @staticmethod
    def _slot(layer: nn.Module, path: str) -> tuple[nn.Module, str]:
        parent, _, leaf = path.rpartition(".")
        return (layer.get_submodule(parent) if parent else layer), leaf

    def release(self, i: int) -> None:
        """Give layer i's memory back (its tensors go back to the meta device)."""
        if i in self.paths:
            owner, leaf = self._slot(self.layers[i], self.paths[i])
            setattr(owner, leaf, nn.Module())
        self.layers[i] = self.layers[i].to("meta")

    @torch.no_grad()
    def forward(self, layer: nn.Module, states: torch.Tensor, batch: int) -> torch.Tensor:
        """(rows, cols, hidden) -> the layer's output, `batch` rows at a time."""
        self.base.layers = nn.ModuleList([layer])
        out = [self.base(inputs_embeds=states[a:a + batch].to(self.device, self.dtype), use_cache=False)
               .last_hidden_state.to(states.device, states.dtype) for a in range(0, states.shape[0], batch)]
        self.base.layers = nn.ModuleList()
        return torch.cat(out)
