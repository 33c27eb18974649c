"""Running the server: in the foreground for `xmoe serve`, or as a managed child process (tests, load runs)."""
import os
import subprocess
import time
from pathlib import Path

from .launch import describe, engine_command, engine_env
from .options import ServeOptions


def serve(o: ServeOptions) -> None:
    """Print the settings and replace this process with the server (signals then reach vLLM directly)."""
    print(describe(o), flush=True)
    cmd = engine_command(o)
    os.execve(cmd[0], cmd, engine_env(o))


class ServerError(RuntimeError):
    pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies do not count: their parent may never reap them)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # exited while we looked
        if int(group) == pgid and state != "Z":
            return True
    return False


class Server:
    """The server as a child process, logging to `log`; `with Server(...) as s:` waits until /health is 200."""

    def __init__(self, options: ServeOptions, log: Path, startup_timeout: float = 600):
        self.options, self.log_path, self.timeout = options, Path(log), startup_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.options.base_url

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as base_url."""
        return self.options.base_url + "/v1"

    @property
    def api_key(self) -> str | None:
        return self.options.api_key

    @property
    def model(self) -> str:
        return self.options.name

    def start(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            log.write(describe(self.options) + "\n")
            log.flush()
            self.proc = subprocess.Popen(engine_command(self.options), stdout=log, stderr=subprocess.STDOUT,
                                         env=engine_env(self.options), start_new_session=True)
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        import httpx
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with code {self.proc.returncode}; log {self.log_path}:\n"
                                  f"{self.log_tail()}")
            try:
                if httpx.get(self.options.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise ServerError(f"server not healthy after {self.timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM, as Ctrl-C would: vLLM stops its engine processes; then wait until every process of the
        server's session is gone (its engine and resource tracker outlive the API server by a moment)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(self.proc.pid):
            os.killpg(self.proc.pid, 9)  # its own session: this reaches only the server and its children
        self.proc.wait()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
