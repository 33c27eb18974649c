"""Which modules of a checkpoint hold EXL3 tensors: read once from the safetensors headers."""
from pathlib import Path

from safetensors import safe_open

from ..format.layer import SUFFIXES, shard_files


def exl3_modules(model_dir: str) -> dict[str, frozenset] | None:
    """{module key: its EXL3 suffixes} for every module that has a `.trellis` tensor; None for a directory
    without safetensors (a config for `--load-format dummy`)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"exl3: {model_dir!r} is not a local model directory; download it first")
    if not any(path.glob("*.safetensors")):
        return None
    names = set()
    for f in shard_files(path)[0]:
        with safe_open(str(path / f), framework="pt") as fh:  # reads the header only
            names.update(fh.keys())
    modules: dict[str, set] = {}
    for name in names:
        key, _, suffix = name.rpartition(".")
        if suffix in SUFFIXES and suffix != "bias":
            modules.setdefault(key, set()).add(suffix)
    return {k: frozenset(v) for k, v in modules.items() if "trellis" in v}
