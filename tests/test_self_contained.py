"""A clone with nothing beside it finds every file its tests read, and no tracked file reaches outside the
repository for one. Checked on a fresh clone of the committed tree in a temporary directory."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every test that reads a file of tests/data (through the `vectors` and `gsm8k_path` fixtures), except the
# served GSM8K run, which needs a server and reads the same file through the same fixture.
DATA_TESTS = ("tests/format/test_trellis.py::test_exllamav3_ground_truth",
              "tests/bench/test_scoring.py::test_gsm8k_data_file_answers_parse")
# A path built to reach a directory beside or above the repository.
OUTSIDE = re.compile(r"\.\./shared|/work/shared|parents?(\[\d+\])?(\.parent)*\s*/\s*[\"']shared[\"']")


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _checkout_or_skip() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout: there is no committed tree to clone")


def test_no_tracked_file_reads_outside_the_repository():
    _checkout_or_skip()
    me = Path(__file__).relative_to(ROOT).as_posix()
    hits = []
    for name in _git("ls-files").splitlines():
        path = ROOT / name
        if name == me or not path.is_file():
            continue
        text = path.read_bytes()
        if b"\0" in text[:8192]:
            continue  # binary data
        hits += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(text.decode(errors="replace").splitlines(), 1)
                 if OUTSIDE.search(line)]
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_data_files_are_tracked():
    _checkout_or_skip()
    tracked = set(_git("ls-files", "tests/data").splitlines())
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "data").rglob("*") if p.is_file()}
    assert on_disk <= tracked, f"untracked test data (a clone would lack it): {sorted(on_disk - tracked)}"


def test_fresh_clone_finds_its_data(tmp_path):
    """The data tests, run in a clone of HEAD alone in an empty directory, with this interpreter."""
    _checkout_or_skip()
    clone = tmp_path / "clone"
    _git("clone", "--quiet", "--no-checkout", str(ROOT), str(clone), cwd=tmp_path)
    _git("checkout", "--quiet", _git("rev-parse", "HEAD").strip(), cwd=clone)
    env = {**os.environ, "PYTHONPATH": str(clone)}  # the clone's xmoe, not the one installed
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DATA_TESTS],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    tail = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, tail
    assert re.search(r"\b7 passed\b", run.stdout), tail  # 6 decode cases and the GSM8K file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clone"]
