"""A vLLM OpenAI server on a model directory, for the serving tests, and the greedy check against the
transformers reference."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xmoe.serve.launch import entrypoint, sampler_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from checkpoints import SERVE_BASE, save_word_tokenizer  # noqa: E402
from reference import reference_tokens  # noqa: E402

PROMPTS = [[1, 5, 9, 13, 17], [3, 4, 5], [200, 100, 50, 25]]
N = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# On the CPU: fp32 and eager. On a GPU the kernels take fp16/bf16 and CUDA graphs are on unless --enforce-eager
# is passed; several servers share the GPU, each with a small KV cache.
CPU_ARGS = ("--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4", "--enforce-eager")
GPU_ARGS = ("--dtype", "float16", "--max-model-len", "256", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.1",
            "--kv-cache-memory-bytes", str(256 * 2 ** 20))


class Server:
    """vLLM's OpenAI server (the one `vllm serve` runs) on a model directory, stopped on exit."""

    def __init__(self, model: Path, *args: str, env: dict | None = None, gpu: bool = False):
        self.port = free_port()
        self.log = open(model.parent / f"server-{self.port}.log", "w+")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {})}
        env.update(sampler_env(env))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", entrypoint(), "--model", str(model),
             *(GPU_ARGS if gpu else CPU_ARGS), "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def __enter__(self):
        import httpx
        deadline = time.time() + 600
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
        tail = self.log_text()[-6000:]
        self.__exit__()  # a server that never became healthy must not outlive the test
        pytest.fail(f"vLLM server did not become healthy in 600 s:\n{tail}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def greedy(self, model: Path, prompts=PROMPTS, n: int = N, concurrent: bool = False) -> list[list[int]]:
        """Greedy continuations of `prompts` (token ids), one request after another or all at once."""
        from concurrent.futures import ThreadPoolExecutor

        from openai import OpenAI
        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)

        def one(p):
            # min_tokens keeps eos (t2) out as the reference's min_new_tokens does; special tokens (t0-t2) stay in
            # the text
            r = client.completions.create(model=str(model), prompt=p, max_tokens=n, temperature=0,
                                          extra_body={"ignore_eos": True, "min_tokens": n, "return_token_ids": True,
                                                      "skip_special_tokens": False})
            choice = r.choices[0].model_dump()
            assert choice["text"].split() == [f"t{i}" for i in choice["token_ids"]]  # the word tokenizer
            return choice["token_ids"]

        if not concurrent:
            return [one(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))


def check_served(src: Path, dst: Path, *args: str, env: dict | None = None, prompts=PROMPTS, n: int = N):
    save_word_tokenizer(dst, SERVE_BASE["vocab_size"])
    with Server(dst, *args, env=env) as server:
        got = server.greedy(dst, prompts, n)
    assert got == reference_tokens(src, dst, prompts, n)
