"""Random EXL3 experts for vLLM's `--load-format dummy`: a pack's speed without its weights on disk.

A directory holding only `config.json` (with an exl3 `quantization_config`) and a tokenizer then serves
every routed-expert layer as EXL3 at the config's bits and codebook. The decode kernels' time does not
depend on the stored states, so a 40-layer pack is timed without writing or reading 70 GB.
"""
from dataclasses import dataclass

import torch

from ..format.config import QuantConfig
from ..format.layer import marker, padded
from ..format.trellis import check_bits
from ..kernels.ops import Exl3Experts, Exl3Weight


@dataclass(frozen=True)
class DummyExl3:
    K: float
    codebook: str
    seed: int = 0

    @classmethod
    def of(cls, qconfig: QuantConfig) -> "DummyExl3":
        try:
            return cls(check_bits(qconfig.bits), qconfig.codebook)
        except ValueError as err:
            raise ValueError(f"exl3: --load-format dummy needs quantization_config.bits to be one K: {err}") from None

    @property
    def suffixes(self) -> frozenset:
        return frozenset({"trellis", "suh", "svh", *marker(self.codebook)})

    def weight(self, experts: int, in_features: int, out_features: int, device, g: torch.Generator) -> Exl3Weight:
        """`experts` random layers, stacked: uniform trellis states and random-sign scales that keep y = x W
        at the scale of x (the codebooks' values have a std of about 1)."""
        k, n = padded(in_features), padded(out_features)
        trellis = torch.randint(-2 ** 15, 2 ** 15, (experts, k // 16, n // 16, int(16 * self.K)),
                                dtype=torch.int16, device=device, generator=g)
        sign = lambda size: torch.randint(0, 2, (experts, size), device=device, generator=g).half() * 2 - 1  # noqa: E731
        return Exl3Weight(trellis, sign(k) / k ** 0.5, sign(n), self.K, self.codebook, in_features, out_features)

    def experts(self, count: int, hidden: int, intermediate: int, device) -> Exl3Experts:
        g = torch.Generator(device=device).manual_seed(self.seed)
        return Exl3Experts(self.weight(count, hidden, intermediate, device, g),
                           self.weight(count, hidden, intermediate, device, g),
                           self.weight(count, intermediate, hidden, device, g))


def is_dummy_load() -> bool:
    """Whether vLLM is building the model for `--load-format dummy` (random weights, no checkpoint read)."""
    from vllm.config import get_current_vllm_config
    load = getattr(get_current_vllm_config(), "load_config", None)
    return str(getattr(load, "load_format", "")) in ("dummy", "LoadFormat.DUMMY")
