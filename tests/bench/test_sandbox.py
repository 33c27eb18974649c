"""HumanEval programs in the sandbox: a right solution passes, wrong, hanging, memory-hungry and forking ones
fail with the right status, and nothing leaks into the tool's process or working directory."""
import os
import time

import pytest

from xmoe.bench import humaneval
from xmoe.bench.sandbox import Limits, run_python

FAST = Limits(timeout=3.0, memory=512 << 20)


@pytest.fixture(scope="module")
def problem():
    return humaneval.human_eval_problems()[0]


def test_all_164_canonical_solutions_are_well_formed():
    problems = humaneval.human_eval_problems()
    assert len(problems) == 164
    assert all(p["entry_point"] in p["prompt"] for p in problems)


def test_known_correct_completion_passes(problem):
    out = run_python(humaneval.program(problem, problem["canonical_solution"]), FAST)
    assert out.passed and out.status == "passed", out.detail


def test_whole_function_from_chat_reply_passes(problem):
    reply = f"Here it is:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\nDone."
    code = humaneval.code_from_reply(reply)
    assert code.startswith("from typing import List")
    assert run_python(humaneval.program(problem, code), FAST).passed


def test_known_wrong_completion_fails(problem):
    out = run_python(humaneval.program(problem, "    return False\n"), FAST)
    assert not out.passed and out.status == "failed" and "AssertionError" in out.detail


def test_hanging_completion_times_out(problem):
    t0 = time.perf_counter()
    out = run_python(humaneval.program(problem, "    while True:\n        pass\n"), FAST)
    assert not out.passed and out.status == "timeout"
    assert time.perf_counter() - t0 < FAST.timeout + 3


def test_sleeping_completion_times_out_on_wall_clock(problem):
    out = run_python(humaneval.program(problem, "    import time\n    time.sleep(60)\n"), Limits(timeout=1.0))
    assert out.status == "timeout"


def test_memory_hog_is_stopped(problem):
    out = run_python(humaneval.program(problem, "    x = bytearray(4 << 30)\n    return True\n"), FAST)
    assert not out.passed and out.status == "memory", out


def test_children_are_killed_and_files_stay_in_the_temp_dir(tmp_path, problem):
    marker = tmp_path / "alive"
    code = (f"    import subprocess, sys\n"
            f"    subprocess.Popen([sys.executable, '-c', 'import time, pathlib; time.sleep(2); "
            f"pathlib.Path(\"{marker}\").write_text(\"x\")'])\n"
            f"    open('left-behind.txt', 'w').write('x')\n"
            f"    import os\n    os.chdir('/')\n    return False\n")
    out = run_python(humaneval.program(problem, code), FAST)
    assert out.status == "failed"
    time.sleep(3)
    assert not marker.exists()                        # the child died with the process group
    assert not os.path.exists("left-behind.txt")      # written in the sandbox's own temp dir


def test_body_or_function_assembly(problem):
    body = humaneval.program(problem, problem["canonical_solution"])
    assert body.count(f"def {problem['entry_point']}(") == 1
    whole = humaneval.program(problem, problem["prompt"] + problem["canonical_solution"])
    assert whole.count(f"def {problem['entry_point']}(") == 2   # the stub, then the full function overriding it
    assert body.rstrip().endswith(f"check({problem['entry_point']})")
