"""Install a wheelhouse made by `xmoe wheelhouse` on a host without registry access (standard library only:
xmoe is not installed there yet).

    python3 install.py WHEELHOUSE [MORE_PART_FOLDERS ...] [--target DIR] [--dry-run]

The folders are searched for the pieces that manifest.json names (WHEELHOUSE/part*, and any folder given).
Every wheel is joined from its pieces and checked against its sha256 first; then the wheels whose
distribution is not installed yet go in with `pip install --no-index --no-deps` (the host's own builds of
torch, triton and the rest are never touched).
"""
import argparse
import hashlib
import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(target: str | None) -> set[str]:
    where = {"path": [target]} if target else {}  # path=None is an error on Python 3.12: leave it out
    return {canonical(d.metadata["Name"]) for d in importlib.metadata.distributions(**where) if d.metadata["Name"]}


def find(piece: str, folders: list[Path]) -> Path:
    for folder in folders:
        if (folder / piece).is_file():
            return folder / piece
    raise SystemExit(f"install.py: piece {piece} is in none of {', '.join(map(str, folders))}")


def join(entry: dict, folders: list[Path], dest: Path) -> Path:
    """The wheel of a manifest entry, joined from its pieces into dest and checked."""
    out = dest / entry["wheel"]
    h = hashlib.sha256()
    with open(out, "wb") as f:
        for piece in entry["pieces"]:
            data = find(piece, folders).read_bytes()
            h.update(data)
            f.write(data)
    if h.hexdigest() != entry["sha256"]:
        raise SystemExit(f"install.py: {entry['wheel']} does not match its sha256 (a piece is damaged or missing)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheelhouse", type=Path, help="the folder with manifest.json")
    p.add_argument("folders", type=Path, nargs="*", help="more folders holding parts")
    p.add_argument("--target", help="install into this folder (pip --target) instead of the environment")
    p.add_argument("--dry-run", action="store_true", help="check and list, install nothing")
    args = p.parse_args(argv)
    manifest = json.loads((args.wheelhouse / "manifest.json").read_text())
    folders = [args.wheelhouse, *sorted(args.wheelhouse.glob("part*")), *args.folders]
    have = installed(args.target)
    todo = [e for e in manifest["wheels"] if canonical(e["wheel"].split("-")[0]) not in have]
    print(f"install.py: vLLM {manifest['vllm']}: {len(todo)} of {len(manifest['wheels'])} wheels to install "
          f"({len(manifest['wheels']) - len(todo)} already present)")
    with tempfile.TemporaryDirectory() as tmp:
        wheels = [join(e, folders, Path(tmp)) for e in todo]
        if args.dry_run or not wheels:
            print("\n".join(w.name for w in wheels))
            return 0
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--quiet"]
        cmd += ["--target", args.target] if args.target else []
        return subprocess.run(cmd + [str(w) for w in wheels]).returncode


if __name__ == "__main__":
    sys.exit(main())
