"""What a conversion will write: the source checkpoint's files, its routed experts, and for every output
shard the ordered list of tensors (EXL3 tensors in place of each quantized expert, the rest unchanged)."""
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..format.codebook import check_codebook
from ..format.layer import INDEX, FormatError, shard_files, stored_layout
from ..format.trellis import check_bits
from .experts import ExpertProj, find_experts
from .st_io import TORCH_DTYPE, CheckpointError, TensorInfo, read_header

SKIP_FILES = (".bin", ".pt", ".pth", ".ckpt", ".safetensors")


INPUTS = ("quantized", "original")


def is_K(bits: float, codebook: str) -> bool:
    """Whether `bits` is a K the codebook stores (half-integer K is mul1's only)."""
    try:
        check_bits(bits)
    except ValueError:
        return False
    return float(bits).is_integer() or codebook == "mul1"


@dataclass(frozen=True)
class ConvertOptions:
    """Options of `xmoe quantize`, validated once here.

    `bits` is K for every expert tensor, or, when it is no K of the codebook (e.g. 2.25) or `allocate` is
    set, the average that the bit allocator spends. `calibrate` encodes against Hessians captured from
    `calibration` (FILE or DIR of text; None: the default mix), `calib_rows` rows of `calib_cols` tokens,
    whose states reach each layer through the layers before as `calib_inputs` ("quantized" or "original")."""
    bits: float = 2
    codebook: str = "mcg"
    encoder: str = "viterbi"
    bits_for: tuple[tuple[str, float], ...] = ()  # (regex over module keys, K); first match wins
    keep: tuple[str, ...] = ()  # regexes of expert modules left at source precision
    experts_regex: str | None = None
    beam_width: int = 64
    seed: int = 0
    calibrate: bool = False
    calibration: str | None = None
    calib_rows: int = 250
    calib_cols: int = 2048
    calib_inputs: str = "quantized"
    allocate: bool = False
    sample_experts: int = 4  # experts per group whose error curves the allocator measures
    sample_strips: int = 4  # 16-column strips per measured tensor

    def __post_init__(self):
        check_codebook(self.codebook)
        if self.allocates:
            if not 1 <= self.bits <= 8:
                raise ValueError(f"--bits {self.bits}: an average bits per weight must lie in 1..8")
        else:
            check_bits(self.bits)
            if not is_K(self.bits, self.codebook):
                raise ValueError(f"--bits {self.bits}: half-integer K needs --codebook mul1")
        for pattern, K in self.bits_for:
            check_bits(K)
            if not is_K(K, self.codebook):
                raise ValueError(f"--bits-for {pattern}={K}: half-integer K needs --codebook mul1")
            re.compile(pattern)
        for pattern in self.keep:
            re.compile(pattern)
        if self.calib_inputs not in INPUTS:
            raise ValueError(f"calibration inputs {self.calib_inputs!r}: expected one of {', '.join(INPUTS)}")
        if self.calib_rows < 1 or self.calib_cols < 16:
            raise ValueError(f"calibration of {self.calib_rows} rows x {self.calib_cols} tokens: need at least "
                             "1 row of 16 tokens")
        if min(self.sample_experts, self.sample_strips) < 1:
            raise ValueError("the allocator samples at least one expert and one strip per group")

    @property
    def allocates(self) -> bool:
        return self.allocate or not is_K(self.bits, self.codebook)

    def rule_bits(self, key: str) -> float | None:
        """K of the first --bits-for rule matching `key`, else None."""
        return next((K for pattern, K in self.bits_for if re.search(pattern, key)), None)

    def bits_of(self, key: str) -> float:
        K = self.rule_bits(key)
        return self.bits if K is None else K

    def kept(self, key: str) -> bool:
        return any(re.search(pattern, key) for pattern in self.keep)


@dataclass
class Plan:
    src: Path
    config: dict
    shards: dict[str, list[TensorInfo]]  # shard file name -> tensors in storage order
    experts: list[ExpertProj]  # the ones to quantize
    bits: dict[str, float | None] = field(default_factory=dict)  # expert key -> K (None: left to the allocator)
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # expert key -> (out, in)

    def fingerprint(self, options: ConvertOptions, calibration: str = "") -> str:
        """Identifies the source files (names, sizes, headers), the options and the calibration tokens' digest;
        a resumed run must match."""
        h = hashlib.sha256(json.dumps(options.__dict__, sort_keys=True, default=str).encode())
        h.update(calibration.encode())
        for name, infos in sorted(self.shards.items()):
            h.update(name.encode())
            for t in infos:
                h.update(f"{t.name}:{t.dtype}:{t.shape}:{t.start}:{t.nbytes}".encode())
        return h.hexdigest()


def read_source(src: Path) -> tuple[dict, dict[str, list[TensorInfo]]]:
    """config.json and the tensors of every shard, cross-checked against the index."""
    if not src.exists():
        raise CheckpointError(f"{src}: no such directory")
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory (expected a Hugging Face model directory)")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{src}: no config.json (is this a Hugging Face model directory?)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    try:
        files, weight_map = shard_files(src)
    except FormatError as e:
        raise CheckpointError(str(e)) from None
    shards = {}
    for name in files:
        if not (src / name).is_file():
            raise CheckpointError(f"{src / INDEX}: names shard {name}, which does not exist")
        shards[name] = read_header(src / name)[0]
    if weight_map is not None:
        present = {t.name: shard for shard, infos in shards.items() for t in infos}
        for tensor, shard in sorted(weight_map.items()):
            if present.get(tensor) != shard:
                raise CheckpointError(f"{src / INDEX}: tensor {tensor} is not in {shard}")
    return config, shards


def _logical_shape(p: ExpertProj, info: TensorInfo, scale: TensorInfo | None) -> tuple[int, int]:
    shape = info.shape[1:] if p.rows is not None else info.shape
    if len(shape) != 2:
        raise CheckpointError(f"{p.source}: expert weight must be 2-D, got shape {info.shape}")
    out, inp = (p.rows[1] - p.rows[0], shape[1]) if p.rows else shape
    packed_fp4 = info.dtype in ("U8", "I8") and scale is not None
    return out, inp * 2 if packed_fp4 else inp


def make_plan(src: Path, options: ConvertOptions) -> Plan:
    config, shards = read_source(src)
    infos = {t.name: t for ts in shards.values() for t in ts}
    experts = find_experts(config, {n: t.shape for n, t in infos.items()}, options.experts_regex)
    kept = {p.source for p in experts if options.kept(p.key)}
    for p in experts:
        if p.source in kept and not options.kept(p.key):
            raise ValueError(f"--keep matches only some experts of the fused tensor {p.source}")
    plan = Plan(src, config, shards, [p for p in experts if p.source not in kept])
    groups: dict[tuple, set] = {}
    for p in plan.experts:  # with the allocator, tensors no rule fixes get their K from it later
        plan.bits[p.key] = options.rule_bits(p.key) if options.allocates else options.bits_of(p.key)
        plan.shapes[p.key] = _logical_shape(p, infos[p.source], infos.get(p.scale) if p.scale else None)
        groups.setdefault((p.layer, p.role), set()).add(plan.shapes[p.key])
    for (layer, role), shapes in groups.items():
        if len(shapes) > 1:
            raise CheckpointError(f"layer {layer}: {role} experts have differing shapes {sorted(shapes)}")
    return plan


def exl3_entries(key: str, shape: tuple[int, int], K: float, codebook: str) -> list[tuple[str, str, tuple]]:
    """Header entries of one quantized (out, in) projection, known before it is encoded."""
    return [(f"{key}.{suffix}", TORCH_DTYPE[dtype], s) for suffix, dtype, s in stored_layout(shape[1], shape[0], K, codebook)]


def shard_layout(plan: Plan, codebook: str) -> dict[str, list]:
    """Per output shard: ("copy", TensorInfo) and ("exl3", key, entries) items in source order."""
    by_source: dict[str, list[ExpertProj]] = {}
    for p in plan.experts:
        by_source.setdefault(p.source, []).append(p)
    dropped = {p.scale for p in plan.experts if p.scale}
    layout = {}
    for shard, infos in plan.shards.items():
        items = []
        for t in infos:
            if t.name in by_source:
                items += [("exl3", p.key, exl3_entries(p.key, plan.shapes[p.key], plan.bits[p.key], codebook))
                          for p in sorted(by_source[t.name], key=lambda p: (p.expert, p.role))]
            elif t.name not in dropped:
                items.append(("copy", t))
        layout[shard] = items
    return layout
