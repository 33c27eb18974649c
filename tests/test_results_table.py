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


def test_a_soak_alone_gives_its_own_table_and_no_empty_speed_rows():
    row = {"variant": "exl3-4", "layers": 4, "tensor_bytes": {"total": 2 ** 33}, "loaded_gib": 8.1,
           "soak": {"clients": 16, "seconds": 600.2, "requests": 900, "errors": 0, "output_tok_per_s": 1234.5}}
    lines = results_table.serve_tables([{"rows": [row], "commit": "abc1234", "date": "2026-12-07", "file": "x"}])
    assert "| exl3-4 | 16 | 600 | 900 | 0 | - | 1,234 | abc1234 (2026-12-07) |" in lines  # no empty count: "-"
    row["soak"]["empty"] = 2
    lines = results_table.serve_tables([{"rows": [row], "commit": "abc1234", "date": "2026-12-07", "file": "x"}])
    assert "| exl3-4 | 16 | 600 | 900 | 0 | 2 | 1,234 | abc1234 (2026-12-07) |" in lines
    assert not any(line.startswith("| exl3-4 | - | - | - |") for line in lines)  # untimed: no speed row
