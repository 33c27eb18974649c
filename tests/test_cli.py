import subprocess
import sys

from xmoe.cli import main


def test_python_m_matches_entry_point(capsys):
    run = subprocess.run([sys.executable, "-m", "xmoe", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "demo" in run.stdout
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.replace("__main__.py", "xmoe") == run.stdout.replace("__main__.py", "xmoe")


def test_demo_runs(capsys):
    assert main(["demo", "--bits", "2", "--in-features", "128", "--out-features", "128"]) == 0
    out = capsys.readouterr().out
    err = float(out.strip().splitlines()[-1].split()[2])
    assert 0 < err < 0.1


def test_quantize_defaults_to_a_worker_per_core_without_gpus(monkeypatch):
    import os

    import torch

    from xmoe.cli import default_devices
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert default_devices() == ["cpu", "cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert default_devices() == ["cuda:0", "cuda:1"]
