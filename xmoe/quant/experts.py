"""Finding the routed experts of a checkpoint from its architecture (config.json) and tensor structure.

Each architecture family names where its routed experts live (the MoE container and the projection names).
Per-expert tensors (`...experts.E.gate_proj.weight`) and fused 3-D tensors (`...experts.gate_up_proj`,
(E, 2I, H), gate rows first) are both recognised. Layers at or past num_hidden_layers (MTP / DSpark drafters)
are never matched, nor are shared experts, routers or Engram tables.
"""
import re
from dataclasses import dataclass

from .source import SCALE_SUFFIXES

ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


@dataclass(frozen=True)
class Family:
    containers: tuple[str, ...]
    projections: tuple[str, ...]
    experts_key: tuple[str, ...]  # config.json keys holding the routed-expert count, first found wins


_HF = ("gate_proj", "up_proj", "down_proj")
_DEEPSEEK = Family(("mlp", "ffn"), _HF + ("w1", "w3", "w2"), ("n_routed_experts",))
FAMILIES = {
    "deepseek_v3": _DEEPSEEK, "deepseek_v32": _DEEPSEEK, "deepseek_v4": _DEEPSEEK, "deepseek_v41": _DEEPSEEK,
    "qwen3_moe": Family(("mlp",), _HF, ("num_experts", "num_local_experts")),
    "qwen2_moe": Family(("mlp",), _HF, ("num_experts", "num_local_experts")),
    "mixtral": Family(("block_sparse_moe", "mlp"), ("w1", "w3", "w2") + _HF, ("num_local_experts", "num_experts")),
    "olmoe": Family(("mlp",), _HF, ("num_experts", "num_local_experts")),
}


@dataclass(frozen=True)
class ExpertProj:
    """One routed-expert projection: the module key it is written under and where its weight comes from."""
    key: str  # e.g. model.layers.3.mlp.experts.7.down_proj
    layer: int
    expert: int
    role: str  # gate, up or down
    source: str  # the weight tensor, or the fused 3-D tensor
    scale: str | None  # its scale tensor (FP8 / MXFP4), if any
    rows: tuple[int, int] | None = None  # for a fused tensor: rows of this expert's slice


def _config_int(config: dict, keys: tuple[str, ...], what: str) -> int:
    for k in keys:
        if isinstance(config.get(k), int):
            return config[k]
    raise ValueError(f"config.json: no {what} (looked for {', '.join(keys)})")


def _custom_rules(regex: str):
    pattern = re.compile(regex)
    missing = {"layer", "expert", "proj"} - set(pattern.groupindex)
    if missing:
        raise ValueError(f"--experts-regex needs named groups layer, expert and proj; missing {sorted(missing)}")
    return pattern


def find_experts(config: dict, shapes: dict[str, tuple[int, ...]], experts_regex: str | None = None
                 ) -> list[ExpertProj]:
    """All routed-expert projections, ordered by source tensor name. `shapes` maps every tensor name."""
    arch = config.get("model_type")
    n_layers = _config_int(config, ("num_hidden_layers", "n_layers"), "layer count")
    if experts_regex:
        return _match_custom(_custom_rules(experts_regex), shapes, n_layers)
    if arch not in FAMILIES:
        raise ValueError(
            f"config.json: unknown MoE architecture model_type={arch!r} (known: {', '.join(sorted(FAMILIES))}). "
            "Point the tool at the expert weights with --experts-regex, a regex over tensor names with named "
            r"groups layer, expert and proj, e.g. '^model\.layers\.(?P<layer>\d+)\.moe\.experts\.(?P<expert>\d+)"
            r"\.(?P<proj>w1|w2|w3)\.weight$'")
    fam = FAMILIES[arch]
    n_experts = _config_int(config, fam.experts_key, "routed-expert count")
    c, p = "|".join(fam.containers), "|".join(fam.projections)
    single = re.compile(rf"^(?P<key>(?:model\.)?layers\.(?P<layer>\d+)\.(?:{c})\.experts\.(?P<expert>\d+)"
                        rf"\.(?P<proj>{p}))\.weight$")
    fused = re.compile(rf"^(?P<base>(?:model\.)?layers\.(?P<layer>\d+)\.(?:{c})\.experts)"
                       rf"\.(?P<proj>gate_up_proj|down_proj)$")
    found = []
    for name in sorted(shapes):
        if (m := single.match(name)) and int(m["layer"]) < n_layers:
            found.append(ExpertProj(m["key"], int(m["layer"]), int(m["expert"]), ROLES[m["proj"]], name,
                                    _scale_of(m["key"], shapes)))
        elif (m := fused.match(name)) and int(m["layer"]) < n_layers:
            found.extend(_split_fused(m, name, shapes[name]))
    _check_counts(found, n_experts, arch)
    return found


def _scale_of(key: str, shapes) -> str | None:
    return next((f"{key}.{s}" for s in SCALE_SUFFIXES if f"{key}.{s}" in shapes), None)


def _split_fused(m, name: str, shape: tuple[int, ...]) -> list[ExpertProj]:
    if len(shape) != 3:
        raise ValueError(f"{name}: fused expert tensor must be 3-D (experts, out, in), got shape {shape}")
    layer, out = int(m["layer"]), shape[1]
    if m["proj"] == "down_proj":
        return [ExpertProj(f"{m['base']}.{e}.down_proj", layer, e, "down", name, None, (0, out))
                for e in range(shape[0])]
    if out % 2:
        raise ValueError(f"{name}: gate_up_proj has an odd output size {out}")
    return [ExpertProj(f"{m['base']}.{e}.{proj}", layer, e, role, name, None, rows)
            for e in range(shape[0])
            for proj, role, rows in (("gate_proj", "gate", (0, out // 2)), ("up_proj", "up", (out // 2, out)))]


def _match_custom(pattern, shapes, n_layers) -> list[ExpertProj]:
    found = []
    for name in sorted(shapes):
        if (m := pattern.match(name)) and int(m["layer"]) < n_layers:
            key = name.removesuffix(".weight")
            role = next((r for s, r in ROLES.items() if s in m["proj"]), m["proj"])
            found.append(ExpertProj(key, int(m["layer"]), int(m["expert"]), role, name, _scale_of(key, shapes)))
    if not found:
        raise ValueError(f"--experts-regex {pattern.pattern!r} matched no tensor")
    return found


def _check_counts(found: list[ExpertProj], n_experts: int, arch: str) -> None:
    if not found:
        raise ValueError(f"no routed experts found for model_type={arch!r}: expected tensors like "
                         "'model.layers.N.mlp.experts.E.gate_proj.weight'; use --experts-regex to name them")
    per_layer: dict[int, set] = {}
    for p in found:
        per_layer.setdefault(p.layer, set()).add(p.expert)
    for layer, experts in sorted(per_layer.items()):
        if len(experts) != n_experts:
            raise ValueError(f"layer {layer}: found {len(experts)} routed experts, config.json says {n_experts}")
