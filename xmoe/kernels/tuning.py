"""Launch settings of the EXL3 kernels as data: one frozen Tuning, a default, and a table of per-GPU overrides.

The default holds the settings measured on the H100 and H200 at DeepSeek-V4.1 shapes (docs/kernels.md says why
each is what it is; docs/history/ keeps the measurements). The table (tuning.json beside this file) maps a GPU,
keyed by compute capability and multiprocessor count, to the fields it changes; `benchmarks/moe_kernel.py --sweep
--table` writes entries. Every entry point of ops takes `tuning=` for tests and A/B runs; without one, the table's
entry for the device, else the default.
"""
import json
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

import torch

TABLE = Path(__file__).with_name("tuning.json")
TABLE_FORMAT = 1


@dataclass(frozen=True)
class Tile:
    """One launch shape: rows a chunk (BM), the K and column block (BK, BN), warps and pipeline stages; for the
    grouped GEMMs also the programs a multiprocessor their K split aims for (fill), and for the tiled decoder's
    tl.dot tiles whether they multiply W^T a^T, the decoded weights as the MMA's wide operand (swap)."""
    BM: int
    BK: int
    BN: int
    warps: int = 4
    stages: int = 1
    fill: int = 4
    swap: bool = False


@dataclass(frozen=True)
class Tuning:
    """Every launch setting of the kernels. Row limits are expected rows per chunk (uniform routing), as the
    planner sees a call before its routing exists; registers of 0 leave the choice to ptxas."""
    # The trellis decoder: "tiled" (K = 1, 2, 4, 8 decode whole tiles, grouped_mma where it runs) or "gather"
    # (per-weight gathers at every K, no grouped_mma).
    decoder: str = "tiled"
    # Which kernel takes a call, by expected rows per chunk.
    gemv_max_rows: float = 1.12  # grouped_gemv (CUDA cores), tiled decoder only
    mma_decode_max_rows: float = 8  # grouped_mma in chunks of 8 rows; 0: never
    mma_mid_max_rows: float = 16  # dense layers: grouped_mma in chunks of 16 rows; 0: never
    mma_prefill_max_rows: float = 32  # grouped_mma in chunks of 32 rows; 0: never
    tiled_dot_max_rows: float = 16  # with the tiled decoder, tl.dot keeps calls this small from chunks of 32
    dot_decode_max_rows: float = 16  # tl.dot's decode tile up to here, its prefill tile beyond
    # Tiles per regime.
    gemv: Tile = Tile(BM=2, BK=64, BN=64, fill=32)
    mma_decode: Tile = Tile(BM=8, BK=32, BN=128, fill=24)
    mma_mid: Tile = Tile(BM=16, BK=32, BN=128, fill=16)
    mma_prefill: Tile = Tile(BM=32, BK=16, BN=256, fill=16)
    dot_decode: Tile = Tile(BM=16, BK=64, BN=64, stages=2, swap=True)
    dot_prefill: Tile = Tile(BM=64, BK=64, BN=128)
    gather_decode: Tile = Tile(BM=16, BK=64, BN=32)
    gather_prefill: Tile = Tile(BM=64, BK=16, BN=32)
    # How finely K is cut: at most split_most parts (split_most_moe for a MoE call on grouped_mma's 8-row
    # chunks), each of at least mma_min_steps K steps there.
    split_most: int = 16
    split_most_moe: int = 12
    mma_min_steps: int = 6
    # grouped_mma: one projection takes two column blocks a program where that still fills the GPU (mma_pair);
    # registers and K steps an iteration for two streams (gate and up, or a pair) and for one; registers for
    # chunks wider than 8 rows; the states taken by dp2a, as a bit mask per (bits a lane, codebook).
    mma_pair: bool = True
    mma_registers_two: int = 96
    mma_registers_one: int = 72
    mma_registers_wide: int = 128
    mma_unroll_two: int = 2
    mma_unroll_one: int = 2
    mma_idp: tuple = ((8, "mcg", 0b11111111), (16, "mcg", 0b111), (16, "3inst", 0b111), (24, "mcg", 0b10001000),
                      (24, "3inst", 0b10001000), (32, "mcg", 0b01110111), (32, "3inst", 0b01110111))
    # The dense path (prefill experts decoded once, multiplied by dense_gemm): experts of at least dense_rows rows
    # (dense_rows_untiled where only gluon_mma decodes their K), or all when at most dense_rest others are left;
    # dense_group experts a launch; its tile (stages: at most, as shared memory allows); TMA where there is one.
    dense_rows: int = 128
    dense_rows_untiled: int = 16
    dense_rest: int = 8
    dense_group: int = 32
    dense: Tile = Tile(BM=128, BK=64, BN=256, warps=8, stages=3, fill=0)
    dense_tma: bool = True
    # The rotation and the epilogues: rows and warps a program up to epilogue_few_max_rows rows, and beyond;
    # rows a program of act_epilogue and route_rotate in the first case.
    epilogue_few_max_rows: int = 256
    epilogue_few_rows: int = 16
    epilogue_few_warps: int = 4
    epilogue_many_rows: int = 64
    epilogue_many_warps: int = 4
    act_rows: int = 4
    route_rotate_rows: int = 8
    route_rotate_max_slots: int = 64  # routing and rotation in one launch up to here; 0: never
    combine_stacked_max_tokens: int = 16  # combine_stacked up to here, combine_epilogue beyond
    combine_few_max_tokens: int = 8  # combine_stacked's products of 8 rows, not 16, up to here

    def __post_init__(self):
        if self.decoder not in ("tiled", "gather"):
            raise ValueError(f"tuning: decoder {self.decoder!r}; expected 'tiled' or 'gather'")

    def idp(self, words: int, codebook: str) -> int:
        """The dp2a mask of a grouped_mma launch of `words` bits a lane (mma_idp; 0 for none)."""
        return next((mask for w, cb, mask in self.mma_idp if (w, cb) == (words, codebook)), 0)

    def with_fill(self, fill: int) -> "Tuning":
        """Every grouped GEMM tile aiming for `fill` programs a multiprocessor."""
        return replace(self, **{f: replace(getattr(self, f), fill=fill) for f in TILES})

    def changed(self) -> dict:
        """The fields that differ from the default, as a table entry stores them."""
        default = Tuning()
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    @classmethod
    def from_dict(cls, values: dict, where: str = "tuning") -> "Tuning":
        """The default with `values` (field: value, tiles as dicts of their fields) in place; a ValueError names
        the field and `where` for anything unknown or mistyped."""
        known = {f.name: f for f in fields(cls)}
        default, out = cls(), {}
        for name, value in values.items():
            if name not in known:
                raise ValueError(f"{where}: unknown tuning field {name!r}")
            base = getattr(default, name)
            try:
                if isinstance(base, Tile):
                    out[name] = replace(base, **value)
                elif name == "mma_idp":
                    out[name] = tuple((int(w), str(cb), int(m)) for w, cb, m in value)
                else:
                    out[name] = type(base)(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: tuning field {name!r} = {value!r}: {e}") from None
        return cls(**out)


TILES = ("gemv", "mma_decode", "mma_mid", "mma_prefill", "dot_decode", "dot_prefill", "gather_decode",
         "gather_prefill")
DEFAULT = Tuning()


def _plain(value):
    if isinstance(value, Tile):
        return {f.name: getattr(value, f.name) for f in fields(Tile)}
    return [list(v) for v in value] if isinstance(value, tuple) else value


def gpu_key(capability: tuple, sms: int) -> str:
    """A table key: compute capability and multiprocessor count, e.g. "sm_90/132"."""
    return f"sm_{capability[0]}{capability[1]}/{sms}"


def read_table(path: Path = TABLE) -> dict:
    """{gpu key: Tuning} from a table file; ValueError naming the file for anything it cannot use."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if data.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: tuning table format {data.get('format')!r}, this xmoe reads {TABLE_FORMAT}")
    return {key: Tuning.from_dict(entry.get("tuning", {}), f"{path} [{key}]")
            for key, entry in data.get("gpus", {}).items()}


def write_entry(key: str, tuning: Tuning, about: dict, path: Path = TABLE) -> None:
    """Adds or replaces the entry of GPU `key` (its changed fields, and `about`: the GPU's name, commit, date,
    how it was measured), written atomically."""
    data = json.loads(path.read_text()) if path.exists() else {"format": TABLE_FORMAT, "gpus": {}}
    data["gpus"][key] = {**about, "tuning": tuning.changed()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


@lru_cache(maxsize=None)
def tuning_for(device: str) -> Tuning:
    """The table's tuning for a device (its entry for the GPU, else the default); the default off CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return DEFAULT
    props = torch.cuda.get_device_properties(dev)
    return read_table().get(gpu_key((props.major, props.minor), props.multi_processor_count), DEFAULT)
