"""`xmoe wheelhouse`: cutting wheels into size-limited parts, the standalone installer that joins and checks
them, the stripped vLLM wheel, and what goes into the resolution (the network steps run at build time only)."""
import hashlib
import json
import subprocess
import sys
import zipfile

import pytest

from xmoe.serve import wheelhouse as wh


def fake_wheel(path, name: str, files: dict[str, bytes]):
    whl = path / f"{name}-1.0-py3-none-any.whl"
    record = "".join(f"{f},sha256=x,{len(d)}\n" for f, d in files.items())
    with zipfile.ZipFile(whl, "w") as z:
        for f, d in files.items():
            z.writestr(f, d)
        z.writestr(f"{name}-1.0.dist-info/RECORD", record)
        z.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{name}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return whl


def test_parts_respect_the_limit_and_join_back(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    big = fake_wheel(wheels, "bigpkg", {"bigpkg/blob.bin": bytes(range(256)) * 4000})  # ~1 MB, stored
    small = fake_wheel(wheels, "smallpkg", {"smallpkg/__init__.py": b"x = 1\n"})
    digests = {w.name: hashlib.sha256(w.read_bytes()).hexdigest() for w in (big, small)}
    limit = 300_000
    entries = wh.cut_into_parts(wheels, tmp_path / "out", limit)
    assert {e["wheel"]: e["sha256"] for e in entries} == digests
    assert len(next(e for e in entries if e["wheel"] == big.name)["pieces"]) == -(-big.stat().st_size // limit)
    for part in (tmp_path / "out").glob("part*"):
        assert sum(f.stat().st_size for f in part.iterdir()) <= limit

    manifest = {"vllm": "0.0", "wheels": entries}
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    run = [sys.executable, str(wh.INSTALLER), str(tmp_path / "out"), "--target", str(tmp_path / "site")]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "bigpkg" / "blob.bin").read_bytes() == bytes(range(256)) * 4000
    again = subprocess.run(run + ["--dry-run"], capture_output=True, text=True)
    assert "0 of 2 wheels to install (2 already present)" in again.stdout


def test_a_damaged_piece_is_refused(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "pkg", {"pkg/a.bin": bytes(range(256)) * 2000})
    entries = wh.cut_into_parts(wheels, tmp_path / "out", 200_000)
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"vllm": "0.0", "wheels": entries}))
    piece = next((tmp_path / "out").rglob("*.whl.001"))
    piece.write_bytes(piece.read_bytes()[:-1] + b"!")
    done = subprocess.run([sys.executable, str(wh.INSTALLER), str(tmp_path / "out"), "--dry-run",
                           "--target", str(tmp_path / "site")], capture_output=True, text=True)
    assert done.returncode != 0 and "does not match its sha256" in done.stderr


def test_strip_wheel_drops_files_and_their_record_lines(tmp_path):
    whl = fake_wheel(tmp_path, "vllm", {wh.FA2: b"\0" * 5000, "vllm/__init__.py": b""})
    assert wh.strip_wheel(whl, {wh.FA2}) > 0
    with zipfile.ZipFile(whl) as z:
        assert wh.FA2 not in z.namelist() and "vllm/__init__.py" in z.namelist()
        assert wh.FA2 not in z.read("vllm-1.0.dist-info/RECORD").decode()


def test_resolution_keeps_the_targets_packages(tmp_path):
    freeze = tmp_path / "have.txt"
    freeze.write_text("torch==2.11.0\nTransformers==5.17.0\nnvidia-nccl-cu13==2.28.9\n-e git+x#egg=y\n")
    have = wh.read_freeze(freeze)
    assert have == {"torch": "2.11.0", "transformers": "5.17.0", "nvidia-nccl-cu13": "2.28.9"}
    lines = wh.Target("0.26.0", have=have).overrides()
    assert 'torch; sys_platform == "never"' in lines and "transformers==5.17.0" in lines
    assert 'nvidia-nccl-cu13; sys_platform == "never"' in lines and 'triton; sys_platform == "never"' in lines
    assert 'flashinfer-python; sys_platform == "never"' in lines
    assert wh.Target("0.26.0", platform="manylinux_2_39_x86_64").uv_platform == "x86_64-manylinux_2_39"
    with pytest.raises(ValueError, match="platform"):
        _ = wh.Target("0.26.0", platform="linux").uv_platform
