"""Launch settings as data: the frozen Tuning, its table of per-GPU entries, and its errors."""
import json
from dataclasses import FrozenInstanceError, replace

import pytest
import torch

from xmoe.kernels.tuning import DEFAULT, TABLE, TILES, Tile, Tuning, gpu_key, read_table, tuning_for, write_entry


def test_frozen_with_named_fields():
    with pytest.raises(FrozenInstanceError):
        DEFAULT.dense_rows = 1
    assert hash(DEFAULT) == hash(Tuning()) and DEFAULT.mma_decode == Tile(BM=8, BK=32, BN=128, fill=24)
    assert DEFAULT.idp(16, "mcg") == 0b111 and DEFAULT.idp(16, "mul1") == 0
    assert {getattr(DEFAULT.with_fill(7), f).fill for f in TILES} == {7} and DEFAULT.with_fill(7).dense == DEFAULT.dense


def test_from_dict_round_trips_and_names_bad_fields():
    t = replace(DEFAULT, dense_rows=64, gemv=replace(DEFAULT.gemv, BK=32), mma_idp=((16, "mcg", 1),))
    assert t.changed() == {"dense_rows": 64, "gemv": {"BM": 2, "BK": 32, "BN": 64, "warps": 4, "stages": 1,
                                                       "fill": 32, "swap": False}, "mma_idp": [[16, "mcg", 1]]}
    assert Tuning.from_dict(json.loads(json.dumps(t.changed()))) == t and DEFAULT.changed() == {}
    with pytest.raises(ValueError, match="here: unknown tuning field 'dense_row'"):
        Tuning.from_dict({"dense_row": 1}, "here")
    with pytest.raises(ValueError, match="'gemv'"):
        Tuning.from_dict({"gemv": {"BQ": 1}})
    with pytest.raises(ValueError, match="decoder"):
        Tuning(decoder="fast")


def test_table_entries(tmp_path):
    path = tmp_path / "tuning.json"
    assert read_table(path) == {}
    fast = replace(DEFAULT, split_most=8)
    write_entry(gpu_key((9, 0), 132), fast, {"gpus": "NVIDIA H100"}, path)
    write_entry(gpu_key((8, 9), 128), DEFAULT, {"gpus": "RTX 4090"}, path)
    assert read_table(path) == {"sm_90/132": fast, "sm_89/128": DEFAULT}
    assert not list(tmp_path.glob("*.tmp"))
    path.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="format 99"):
        read_table(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        read_table(path)


def test_shipped_table_reads_and_the_cpu_takes_the_default():
    table = read_table(TABLE)
    assert "sm_90/132" in table and tuning_for("cpu") is DEFAULT
    if torch.cuda.is_available():
        assert isinstance(tuning_for("cuda:0"), Tuning)
