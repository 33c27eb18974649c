"""docs/RESULTS.md opens with the current figures generated from docs/data/ (benchmarks/results_table.py): they are
up to date with the data, and every file there names its commit and date."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("results_table", ROOT / "benchmarks" / "results_table.py")
results_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_table)


def test_current_figures_match_the_data():
    results_table.main(["--check", str(ROOT / "docs" / "RESULTS.md")])


def test_every_run_is_dated_and_every_gpu_has_its_tables():
    runs = results_table.load(ROOT / "docs" / "data")
    assert runs and all(r["commit"] and r["date"] for r in runs)
    section = results_table.render(ROOT / "docs" / "data")
    for gpu in {r["gpu"] for r in runs}:
        assert f"### {gpu}" in section
    assert "Fused MoE" in section and "| 6 | uniform |" in section
