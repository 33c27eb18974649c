from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2].parent / "shared"


@pytest.fixture
def gsm8k_path() -> Path:
    """GSM8K's test.jsonl (openai/grade-school-math, MIT) beside the repository, as the other shared data."""
    path = SHARED / "data" / "gsm8k" / "test.jsonl"
    if not path.exists():
        pytest.fail(f"GSM8K test set missing: {path}")
    return path
