from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"  # tests/data


@pytest.fixture
def gsm8k_path() -> Path:
    """GSM8K's test.jsonl (openai/grade-school-math, MIT), carried in tests/data (its README says more)."""
    path = DATA / "gsm8k" / "test.jsonl"
    if not path.exists():
        pytest.fail(f"GSM8K test set missing: {path}")
    return path
