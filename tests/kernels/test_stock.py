"""benchmarks/stock.py's prebuilt extension: an xz-compressed .so is unpacked once, atomically."""
import importlib.util
import lzma
import os
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stock.py"
spec = importlib.util.spec_from_file_location("stock", SCRIPT)
stock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stock)


def test_xz_unpacked_once(tmp_path):
    payload = os.urandom(4096) * 8
    packed = tmp_path / "exllamav3_ext.so.xz"
    packed.write_bytes(lzma.compress(payload))
    out = Path(stock.unpacked(str(packed), str(tmp_path / "build")))
    assert out == tmp_path / "build" / "prebuilt" / "exllamav3_ext.so"
    assert out.read_bytes() == payload
    assert sorted(p.name for p in out.parent.iterdir()) == ["exllamav3_ext.so"]  # no temp file left
    first = out.stat().st_mtime_ns
    assert stock.unpacked(str(packed), str(tmp_path / "build")) == str(out)
    assert out.stat().st_mtime_ns == first  # reused, not written again


def test_xz_newer_than_its_copy_is_unpacked_again(tmp_path):
    packed = tmp_path / "ext.so.xz"
    packed.write_bytes(lzma.compress(b"old"))
    out = Path(stock.unpacked(str(packed), str(tmp_path)))
    packed.write_bytes(lzma.compress(b"new"))
    os.utime(packed, ns=(out.stat().st_mtime_ns + 10**9,) * 2)
    assert Path(stock.unpacked(str(packed), str(tmp_path))).read_bytes() == b"new"


def test_plain_so_path_as_given(tmp_path):
    assert stock.unpacked(str(tmp_path / "ext.so")) == str(tmp_path / "ext.so")
