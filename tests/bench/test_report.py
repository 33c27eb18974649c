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
