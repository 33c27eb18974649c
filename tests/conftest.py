from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture
def vectors():
    np = pytest.importorskip("numpy")
    path = SHARED / "reference" / "vectors" / "exl3_decode_K2_K4.npz"
    if not path.exists():
        pytest.fail(f"ground-truth vectors missing: {path}")
    return np.load(path)


def gpu_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
