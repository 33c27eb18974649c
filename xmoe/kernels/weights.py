"""EXL3 weights as the kernels take them: one linear layer, or one projection of all experts stacked."""
import math
from dataclasses import dataclass

import torch

from ..format.layer import check_layer, layer_codebook, marker, scale_vectors


@dataclass(frozen=True)
class Exl3Weight:
    """trellis int16 ([E,] k/16, n/16, 16K); suh fp16 ([E,] k); svh fp16 ([E,] n). k and n are the padded
    (multiple of 128) sizes; in_features/out_features the layer's own."""
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    K: float
    codebook: str
    in_features: int
    out_features: int

    @property
    def k(self) -> int:
        return self.trellis.shape[-3] * 16

    @property
    def n(self) -> int:
        return self.trellis.shape[-2] * 16

    @property
    def experts(self) -> int:
        return self.trellis.shape[0] if self.trellis.dim() == 4 else 0

    def tensors(self, expert: int | None = None) -> dict:
        """The stored tensor set of the layer (or of one expert), as format.decode_weight takes it."""
        pick = (lambda t: t[expert]) if expert is not None else (lambda t: t)
        return {"trellis": pick(self.trellis), "suh": pick(self.suh), "svh": pick(self.svh), **marker(self.codebook)}

    @classmethod
    def from_tensors(cls, tensors: dict, in_features: int | None = None, out_features: int | None = None,
                     name: str = "layer") -> "Exl3Weight":
        k, n, K = check_layer(tensors, name)
        suh, svh = scale_vectors(tensors)
        return cls(tensors["trellis"], suh.half(), svh.half(), K, layer_codebook(tensors, name),
                   in_features or k, out_features or n)

    @classmethod
    def stack(cls, layers: list["Exl3Weight"], name: str = "experts") -> "Exl3Weight":
        """One projection of several experts; all must share shape, K and codebook."""
        first = layers[0]
        for i, w in enumerate(layers):
            if (w.trellis.shape, w.K, w.codebook) != (first.trellis.shape, first.K, first.codebook):
                raise ValueError(f"{name}: expert {i} has trellis {tuple(w.trellis.shape)} K={w.K} {w.codebook}, "
                                 f"expert 0 has {tuple(first.trellis.shape)} K={first.K} {first.codebook}")
        return cls(torch.stack([w.trellis for w in layers]), torch.stack([w.suh for w in layers]),
                   torch.stack([w.svh for w in layers]), first.K, first.codebook, first.in_features,
                   first.out_features)

    def to(self, device) -> "Exl3Weight":
        return Exl3Weight(self.trellis.to(device), self.suh.to(device), self.svh.to(device), self.K, self.codebook,
                          self.in_features, self.out_features)


@dataclass(frozen=True)
class Exl3Experts:
    """gate and up: (hidden -> intermediate), down: (intermediate -> hidden), each stacked over E experts."""
    gate: Exl3Weight
    up: Exl3Weight
    down: Exl3Weight

    def __post_init__(self):
        g, u, d = self.gate, self.up, self.down
        if not (g.experts == u.experts == d.experts > 0):
            raise ValueError(f"experts: gate/up/down stack {g.experts}/{u.experts}/{d.experts} experts")
        if g.trellis.shape != u.trellis.shape or (d.k, d.n) != (g.n, g.k):
            raise ValueError(f"experts: shapes gate {(g.k, g.n)}, up {(u.k, u.n)}, down {(d.k, d.n)} do not chain")
        if (g.K, g.codebook) != (u.K, u.codebook):
            raise ValueError(f"experts: gate is K={g.K} {g.codebook} but up is K={u.K} {u.codebook}")

    @property
    def hidden(self) -> int:
        return self.gate.in_features

    def to(self, device) -> "Exl3Experts":
        return Exl3Experts(self.gate.to(device), self.up.to(device), self.down.to(device))

    @property
    def intermediate(self) -> int:
        return self.gate.out_features

    @property
    def count(self) -> int:
        return self.gate.experts


@dataclass(frozen=True)
class Exl3Slices:
    """Linear layers that read one input (q, k and v; gate and up), cut into column slices of one width and
    stacked like experts: `stack` holds slice s of the merged output columns s w .. (s + 1) w, w = the widths'
    greatest common divisor, with its own layer's suh. One rotation, one grouped GEMM and one epilogue then
    serve every layer of the call, where each layer alone took three launches. `widths`: the layers' outputs."""
    stack: Exl3Weight
    widths: tuple

    @property
    def out_features(self) -> int:
        return sum(self.widths)

    def bounds(self, layer: int) -> tuple:
        """The first and end slice of a layer."""
        first = sum(self.widths[:layer]) // self.stack.n
        return first, first + self.widths[layer] // self.stack.n

    @classmethod
    def of(cls, layers: list, name: str = "layer") -> "Exl3Slices":
        """The slices of `layers` (Exl3Weight), which must share their input, K and codebook and have outputs of
        whole 128-column blocks; ValueError says which does not."""
        first = layers[0]
        for i, w in enumerate(layers):
            if (w.k, w.in_features, w.K, w.codebook) != (first.k, first.in_features, first.K, first.codebook):
                raise ValueError(f"{name}: part {i} takes {w.in_features} inputs at K={w.K} {w.codebook}, part 0 "
                                 f"{first.in_features} at K={first.K} {first.codebook}")
            if w.out_features != w.n:
                raise ValueError(f"{name}: part {i} has {w.out_features} outputs, not a multiple of 128")
        width = math.gcd(*(w.n for w in layers))
        pieces = [w.trellis.unflatten(1, (w.n // width, width // 16)).transpose(0, 1) for w in layers]
        stack = Exl3Weight(torch.cat(pieces).contiguous(),
                           torch.cat([w.suh.expand(w.n // width, -1) for w in layers]).contiguous(),
                           torch.cat([w.svh.view(-1, width) for w in layers]), first.K, first.codebook,
                           first.in_features, width)
        return cls(stack, tuple(w.n for w in layers))
