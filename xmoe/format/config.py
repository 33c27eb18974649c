"""The `quantization_config` block of an EXL3 checkpoint's config.json."""
from dataclasses import asdict, dataclass, field

from .codebook import check_codebook
from .trellis import check_bits

QUANT_METHOD = "exl3"


@dataclass(frozen=True)
class QuantConfig:
    """What produced a pack. `bits` is the average bits per weight of the quantized layers."""
    bits: float
    codebook: str
    version: str
    producer: str = "xmoe"
    head_bits: int | None = None
    out_scales: str = "always"
    layer_bits: dict[str, float] = field(default_factory=dict)  # module pattern -> K where it differs
    original_quantization_config: dict | None = None

    def __post_init__(self):
        check_codebook(self.codebook)
        if not 1 <= self.bits <= 8:
            raise ValueError(f"quantization_config.bits={self.bits} outside 1..8")
        for pattern, K in self.layer_bits.items():
            try:
                check_bits(K)
            except ValueError as e:
                raise ValueError(f"quantization_config.layer_bits[{pattern!r}]: {e}") from None

    def to_dict(self) -> dict:
        # "producer" is an object {name, version}, the shape vLLM's config reader expects.
        d = {"quant_method": QUANT_METHOD, **asdict(self), "producer": {"name": self.producer, "version": self.version}}
        return {k: v for k, v in d.items() if v not in (None, {})}

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        if d.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method is {d.get('quant_method')!r}, not {QUANT_METHOD!r}")
        known = {f for f in cls.__dataclass_fields__}
        # exllamav3 packs carry fields of their own (calibration, mtp_bits...); they are kept by the
        # caller in config.json and not needed to load, since each tensor describes itself.
        kwargs = {k: v for k, v in d.items() if k in known}
        if isinstance(kwargs.get("producer"), dict):
            kwargs["producer"] = kwargs["producer"].get("name", "unknown")
        kwargs.setdefault("codebook", "3inst")  # very old packs predate the codebook field
        kwargs.setdefault("version", "unknown")
        kwargs.setdefault("producer", "exllamav3")
        return cls(**kwargs)
