import zipfile

import pytest
import torch

from xmoe.quant import calib_data
from xmoe.quant.calib_data import CalibrationError, calibration_rows

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok():
    """Words (and punctuation) of a small vocabulary; everything else is one unknown token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<eos>"] + "the of and to in a is was for on that with as by at from his it an were".split()
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="<eos>")


def test_default_mix(tok):
    rows = calibration_rows(tok, None, 20, 64)  # the exllamav3 wheel, fetched once into the cache
    assert rows.shape == (20, 64) and rows.dtype == torch.int64
    assert torch.equal(rows, calibration_rows(tok, None, 20, 64))  # deterministic
    assert (rows == tok.eos_token_id).any() and (rows == tok.convert_tokens_to_ids("the")).any()


def test_tampered_default_mix_is_refused(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    wheel = calib_data.cache_dir() / "exllamav3-1.6.5-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, _, _ in calib_data.SOURCES:
            z.writestr(calib_data.MEMBER + name, "the of and " * 1000)
    with pytest.raises(CalibrationError, match=r"exllamav3-1\.6\.5-py3-none-any\.whl: wiki\.utf8 has sha256 \w+, "
                                               r"expected d53fe0ae\w+; delete the wheel"):
        calibration_rows(tok, None, 4, 16)


def test_user_text_file_and_directory(tok, tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("the of and to " * 100)
    (d / "b.txt").write_text("in a is was " * 100)
    (d / ".hidden").write_bytes(b"\xff\xfe")  # skipped
    rows = calibration_rows(tok, str(d), 8, 32)
    assert rows.shape == (8, 32)
    ids = {tok.convert_tokens_to_ids(w) for w in "the in".split()}
    assert ids <= set(rows.flatten().tolist())  # spread over both files
    assert calibration_rows(tok, str(d / "a.txt"), 1000, 32).shape == (12, 32)  # fewer rows where text is short
    (d / "c.txt").write_bytes(b"caf\xe9")
    with pytest.raises(CalibrationError, match=r"c\.txt: calibration text is not UTF-8"):
        calibration_rows(tok, str(d), 8, 32)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CalibrationError, match="calibration directory holds no files"):
        calibration_rows(tok, str(empty), 8, 32)
