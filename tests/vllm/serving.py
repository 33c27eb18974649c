"""A vLLM OpenAI server on a model directory, for the serving tests, and the greedy check against the
transformers reference."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from checkpoints import SERVE_BASE, save_word_tokenizer  # noqa: E402
from reference import reference_tokens  # noqa: E402

PROMPTS = [[1, 5, 9, 13, 17], [3, 4, 5], [200, 100, 50, 25]]
N = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI server (the one `vllm serve` runs) on a model directory, stopped on exit."""

    def __init__(self, model: Path, *args: str, env: dict | None = None):
        self.port = free_port()
        self.log = open(model.parent / f"server-{self.port}.log", "w+")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model),
             "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4", "--enforce-eager",
             "--host", "127.0.0.1",
             "--port", str(self.port), *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def __enter__(self):
        import httpx
        deadline = time.time() + 400
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                pytest.fail(f"vLLM server exited:\n{self.log.read()[-6000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        pytest.fail("vLLM server did not become healthy in 400 s")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def greedy(self, model: Path) -> list[list[int]]:
        from openai import OpenAI
        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)
        out = []
        for p in PROMPTS:
            # min_tokens keeps eos (t2) out as the reference's min_new_tokens does; special tokens (t0-t2) stay in
            # the text
            r = client.completions.create(model=str(model), prompt=p, max_tokens=N, temperature=0,
                                          extra_body={"ignore_eos": True, "min_tokens": N, "return_token_ids": True,
                                                      "skip_special_tokens": False})
            choice = r.choices[0].model_dump()
            assert choice["text"].split() == [f"t{i}" for i in choice["token_ids"]]  # the word tokenizer
            out.append(choice["token_ids"])
        return out


def check_served(src: Path, dst: Path, *args: str, env: dict | None = None):
    save_word_tokenizer(dst, SERVE_BASE["vocab_size"])
    with Server(dst, *args, env=env) as server:
        got = server.greedy(dst)
    assert got == reference_tokens(src, dst, PROMPTS, N)
