"""benchmarks/ncu_stalls.py against a small CSV in ncu's per-instruction layout."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ncu_stalls.py"
spec = importlib.util.spec_from_file_location("ncu_stalls", SCRIPT)
ncu_stalls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_stalls)

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_math",'
          '"stall_long_sb (Not Issued)"')


def test_sums_each_kernels_samples_by_reason(tmp_path):
    csv = tmp_path / "source.csv"
    csv.write_text("\n".join([
        '"Kernel Name","gate_up",', HEADER,
        '"0x10","SHFL.IDX PT, R16, R59, R49, 0x1f","9","8","1","7"',
        '"0x20","PRMT R14, R16, 0x4421, RZ","3","","3","0"',
        '"Kernel Name","down",', HEADER,
        '"0x10","LOP3.LUT R15, R57, 0x3b603b60, R50, 0x6c, !PT","4","0","4","0"']))
    (name0, first), (name1, second) = ncu_stalls.kernels(csv)
    assert (name0, name1, len(first), len(second)) == ("gate_up", "down", 2, 1)
    total, reasons = ncu_stalls.stalls(first)
    assert total == 12 and reasons == {"long_sb": 8, "math": 4}, "the Not Issued columns are a subset, not added"
    assert ncu_stalls.stalls(second) == (4, {"long_sb": 0, "math": 4})


def test_refuses_a_csv_without_kernels(tmp_path):
    csv = tmp_path / "details.csv"
    csv.write_text('"ID","Metric Name"\n"0","Duration"\n')
    with pytest.raises(ValueError, match="no kernel found"):
        ncu_stalls.kernels(csv)
