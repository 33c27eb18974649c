"""Run untrusted Python (model-written code) in a separate process: its own session and process group, an
empty temporary working directory, a minimal environment, and limits on CPU time, address space, file size,
open files and child processes. Never in the tool's own process.

This bounds time and memory and keeps stray files out of the user's directories; it is not a security
boundary against deliberately hostile code (no network or filesystem namespace). Run untrusted suites in a
container when that matters."""
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    timeout: float = 10.0           # wall-clock seconds
    memory: int = 1 << 30           # bytes of address space
    file_size: int = 16 << 20       # bytes per written file
    processes: int = 64             # RLIMIT_NPROC: stops fork bombs (counted per user, so not too low)


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str                     # "passed", "failed", "timeout", "memory" or "signal N"
    detail: str                     # the tail of stderr


def _limit(limits: Limits):
    def apply():
        cpu = int(limits.timeout) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory, limits.memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size, limits.file_size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    return apply


def run_python(program: str, limits: Limits = Limits()) -> Outcome:
    """Execute `program` with `python -I` under the limits; passed means exit status 0 within the time."""
    with tempfile.TemporaryDirectory(prefix="xmoe-sandbox-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w") as f:
            f.write(program)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1"}
        # stderr goes to a file, not a pipe: children that inherit a pipe would hold its end open after the
        # program exits, and reading to EOF would wait for them.
        with tempfile.TemporaryFile() as err_file:
            proc = subprocess.Popen([sys.executable, "-I", path], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True,
                                    preexec_fn=_limit(limits))
            try:
                proc.wait(timeout=limits.timeout)
            except subprocess.TimeoutExpired:
                return Outcome(False, "timeout", f"over {limits.timeout:g} s")
            finally:
                _kill_group(proc)   # the program on a timeout; children it left behind in any case
            err_file.seek(max(0, err_file.seek(0, os.SEEK_END) - 2000))
            err = err_file.read()
    tail = err.decode(errors="replace")[-500:]
    if proc.returncode == 0:
        return Outcome(True, "passed", "")
    if "MemoryError" in tail:
        return Outcome(False, "memory", tail)
    if proc.returncode < 0:
        sig = -proc.returncode
        return Outcome(False, "timeout" if sig == signal.SIGXCPU else f"signal {sig}", tail)
    return Outcome(False, "failed", tail)


def _kill_group(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
