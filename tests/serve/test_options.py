"""`xmoe serve` options, command line and environment: checked without starting a server."""
import json
import os

import pytest

from xmoe.cli import main
from xmoe.serve.cli import parse_bytes
from xmoe.serve.launch import describe, engine_command, engine_env
from xmoe.serve.options import ALWAYS_MIDDLEWARE, MIDDLEWARE, ServeOptions


def model_dir(tmp_path, exl3=True, **config):
    config = {"model_type": "mixtral", "intermediate_size": 1536, "max_position_embeddings": 8192, **config}
    if exl3:
        config["quantization_config"] = {"quant_method": "exl3", "bits": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_defaults(tmp_path):
    o = ServeOptions(model_dir(tmp_path))
    assert (o.host, o.port, o.prefix_caching, o.api_key, o.name) == ("127.0.0.1", 8000, True, None, tmp_path.name)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=5), "does not split the experts' intermediate size 1536"),
    (dict(tensor_parallel_size=24), "whole 128-column blocks"),
    (dict(tensor_parallel_size=0), "tensor-parallel-size must be a positive integer"),
    (dict(port=70000), "port must be at most 65535"),
    (dict(max_model_len=9000), "exceeds the model's max_position_embeddings 8192"),
    (dict(kv_cache_bytes=-1), "kv-cache-bytes must be a positive integer"),
    (dict(speculative_method="mtp"), "both a drafter method and a number of draft tokens"),
    (dict(num_speculative_tokens=2), "both a drafter method and a number of draft tokens"),
    (dict(dtype="int4"), "dtype 'int4'"),
    (dict(api_key=" "), "the API key is empty"),
    (dict(shutdown_timeout=-1), "shutdown-timeout must be a whole number of seconds >= 0, got -1"),
])
def test_bad_options_name_the_problem(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServeOptions(model_dir(tmp_path), **kwargs)


def test_tp_dividing_the_blocks_is_accepted(tmp_path):
    for tp in (1, 2, 3, 4, 6, 12):
        assert ServeOptions(model_dir(tmp_path), tensor_parallel_size=tp).tensor_parallel_size == tp


def test_tp_rule_for_unquantized_models_is_plain_divisibility(tmp_path):
    ServeOptions(model_dir(tmp_path, exl3=False, intermediate_size=96), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="does not divide the intermediate size 96"):
        ServeOptions(model_dir(tmp_path, exl3=False, intermediate_size=96), tensor_parallel_size=5)


def test_moe_intermediate_size_wins(tmp_path):
    with pytest.raises(ValueError, match="intermediate size 2048"):
        ServeOptions(model_dir(tmp_path, moe_intermediate_size=2048), tensor_parallel_size=3)


def test_model_directory_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ServeOptions(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="file: not a directory"):
        ServeOptions(tmp_path / "file")
    with pytest.raises(ValueError, match="config.json: missing"):
        ServeOptions(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        ServeOptions(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no moe_intermediate_size or intermediate_size"):
        ServeOptions(tmp_path)


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_engine_command(tmp_path):
    o = ServeOptions(model_dir(tmp_path), served_model_name="m", port=9001, tensor_parallel_size=2,
                     max_model_len=4096, kv_cache_bytes=2 ** 30, max_num_seqs=8, prefix_caching=False,
                     speculative_method="mtp", num_speculative_tokens=3, max_num_batched_tokens=2048, eager=True,
                     tool_call_parser="hermes", api_key="secret", extra_args=("--seed", "1"))
    cmd = engine_command(o)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert (_flag(cmd, "--model"), _flag(cmd, "--served-model-name"), _flag(cmd, "--port")) == (str(tmp_path), "m", "9001")
    assert _flag(cmd, "--tensor-parallel-size") == "2" and _flag(cmd, "--max-model-len") == "4096"
    assert _flag(cmd, "--kv-cache-memory-bytes") == str(2 ** 30) and _flag(cmd, "--max-num-seqs") == "8"
    assert _flag(cmd, "--max-num-batched-tokens") == "2048"
    assert json.loads(_flag(cmd, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 3}
    assert {"--no-enable-prefix-caching", "--enforce-eager", "--enable-auto-tool-choice"} <= set(cmd)
    assert _flag(cmd, "--tool-call-parser") == "hermes" and _flag(cmd, "--middleware") == MIDDLEWARE
    assert _flag(cmd, "--tool-strict-level") == "parameter"  # arguments held to the schema, strict or not
    assert cmd[-2:] == ["--seed", "1"] and _flag(cmd, "--shutdown-timeout") == "10"  # engine exits on its own
    assert "secret" not in " ".join(cmd) and "secret" not in describe(o)  # the key travels in the environment


def test_tool_strict_level_given_after_dashes_wins(tmp_path):
    for extra in (("--tool-strict-level", "auto"), ("--tool-strict-level=auto",)):
        o = ServeOptions(model_dir(tmp_path), tool_call_parser="hermes", extra_args=extra)
        cmd = engine_command(o)
        assert sum(a.startswith("--tool-strict-level") for a in cmd) == 1 and cmd[-len(extra):] == list(extra)
        assert "tool strict level 'auto' (given after --)" in describe(o)
    o = ServeOptions(model_dir(tmp_path))
    assert "--tool-strict-level" not in engine_command(o) and "needs --tool-call-parser" in describe(o)


def test_sized_cache_starts_on_a_gpu_partly_in_use(tmp_path):
    """With the cache sized, the free-memory check at start asks for a sliver of the GPU, not vLLM's 90%."""
    cmd = engine_command(ServeOptions(model_dir(tmp_path), kv_cache_bytes=2 ** 30))
    assert float(_flag(cmd, "--gpu-memory-utilization")) <= 0.05
    assert "--gpu-memory-utilization" not in engine_command(ServeOptions(model_dir(tmp_path)))
    given = ServeOptions(model_dir(tmp_path), kv_cache_bytes=2 ** 30, extra_args=("--gpu-memory-utilization=0.5",))
    assert not any(a == "--gpu-memory-utilization" for a in engine_command(given))


def test_open_server_has_no_key_check_and_prefix_caching_on(tmp_path):
    cmd = engine_command(ServeOptions(model_dir(tmp_path)))
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--middleware"] == list(ALWAYS_MIDDLEWARE)
    assert "--enable-prefix-caching" in cmd and "--enforce-eager" not in cmd


def test_vllm_serves_with_the_entry_point_of_vllm_serve():
    """The module the launcher runs exists in the installed vLLM and is the one its deprecated
    `vllm.entrypoints.openai.api_server` hands over to."""
    import importlib.util
    pytest.importorskip("vllm")
    from xmoe.serve.launch import ENTRYPOINT, entrypoint
    assert entrypoint() == ENTRYPOINT  # vLLM 0.32; 0.26 has only the older module
    spec = importlib.util.find_spec(ENTRYPOINT)
    assert spec is not None and "def main()" in open(spec.origin).read()
    old = importlib.util.find_spec("vllm.entrypoints.openai.api_server")
    assert f"from {ENTRYPOINT} import main" in open(old.origin).read()


@pytest.mark.parametrize("gpus", [0, 2])
def test_dry_run_shows_what_a_start_runs(tmp_path, capsys, monkeypatch, gpus):
    """One code path: the dry run prints exactly what `xmoe serve` prints and runs on the same machine; on a
    machine without a CUDA GPU that is eager, with one core left free, and no CUDA graphs claimed."""
    import xmoe.serve.options as options
    import xmoe.serve.server as server
    monkeypatch.setattr(options, "cuda_gpus", lambda: gpus)
    monkeypatch.setattr("xmoe.serve.launch.cuda_gpus", lambda: gpus)
    model = str(model_dir(tmp_path))
    assert main(["serve", model, "--dry-run"]) == 0
    dry = capsys.readouterr().out
    ran = []
    monkeypatch.setattr(server.os, "execve", lambda path, cmd, env: ran.append(cmd))
    assert main(["serve", model]) == 0
    assert capsys.readouterr().out == dry and dry.rstrip().endswith(" ".join(ran[0]))
    graphs = next(line for line in dry.splitlines() if "CUDA graphs" in line)
    if gpus:
        assert graphs.endswith(" on") and "--enforce-eager" not in ran[0]
    else:
        assert graphs.endswith("none on the CPU; eager") and "--enforce-eager" in ran[0]
        assert f"CPU compute threads       {max(1, len(os.sched_getaffinity(0)) - 1)}" in dry


def test_engine_env(tmp_path):
    base = {"VLLM_API_KEY": "stale", "VLLM_CPU_KVCACHE_SPACE": "4", "PATH": "/bin"}
    env = engine_env(ServeOptions(model_dir(tmp_path), api_key="k", kv_cache_bytes=2 ** 30, cpu_threads=1), base)
    assert env["VLLM_API_KEY"] == "k" and "VLLM_CPU_KVCACHE_SPACE" not in env and env["OMP_NUM_THREADS"] == "1"
    env = engine_env(ServeOptions(model_dir(tmp_path)), base)
    assert "VLLM_API_KEY" not in env and env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["PATH"] == "/bin"


def test_engine_env_turns_the_flashinfer_sampler_off_only_where_flashinfer_is_missing(tmp_path, monkeypatch):
    """A wheelhouse (`xmoe wheelhouse`) leaves FlashInfer out; vLLM's GPU sampler would import it at start."""
    import importlib.util
    find = importlib.util.find_spec
    for present in (True, False):  # missing last: a value the caller set is kept even then
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a, p=present: object() if p and n ==
                            "flashinfer" else (None if n == "flashinfer" else find(n, *a)))
        env = engine_env(ServeOptions(model_dir(tmp_path)), {})
        assert env.get("VLLM_USE_FLASHINFER_SAMPLER") == (None if present else "0")
    assert engine_env(ServeOptions(model_dir(tmp_path)), {"VLLM_USE_FLASHINFER_SAMPLER": "1"}).get(
        "VLLM_USE_FLASHINFER_SAMPLER") == "1"


def test_parse_bytes():
    assert parse_bytes("1073741824") == 2 ** 30 and parse_bytes("8GiB") == 8 * 2 ** 30
    assert parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes("512MiB") == 512 * 2 ** 20
    with pytest.raises(Exception, match="expected a size"):
        parse_bytes("lots")


def test_cli_dry_run_prints_settings_and_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("API_KEY", "from-env")
    assert main(["serve", str(model_dir(tmp_path)), "--dry-run", "--tp", "2", "--kv-cache", "2GiB",
                 "--port", "9100", "--", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel size      2" in out and "2,147,483,648 B" in out
    assert "required on every route but /health" in out and "from-env" not in out
    assert "--port 9100" in out and out.rstrip().endswith("--seed 7")


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing"), "--dry-run"]) == 2
    assert main(["serve", str(model_dir(tmp_path)), "--tp", "5", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("xmoe serve: error: ") for line in err)
    assert "does not exist" in err[0] and "128-column blocks" in err[1]


def test_multimodal_config_reads_the_text_part(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "quantization_config": {"quant_method": "exl3"},
        "text_config": {"moe_intermediate_size": 768, "max_position_embeddings": 4096}}))
    assert ServeOptions(tmp_path, tensor_parallel_size=6).tensor_parallel_size == 6
    with pytest.raises(ValueError, match="intermediate size 768"):
        ServeOptions(tmp_path, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="max_position_embeddings 4096"):
        ServeOptions(tmp_path, max_model_len=5000)


def test_ready_message_is_a_request_to_paste():
    import shlex
    from types import SimpleNamespace

    from xmoe.serve.ready import ready_message
    args = SimpleNamespace(host="0.0.0.0", port=8001, served_model_name=["m"], model="/models/x",
                           api_key=["sekrit-key"])
    message = ready_message(args)
    first, curl = message.splitlines()
    assert first.startswith("xmoe serve: ready at http://127.0.0.1:8001/v1 (model 'm')") and "Ctrl-C" in first
    argv = shlex.split(curl)
    assert argv[:2] == ["curl", "http://127.0.0.1:8001/v1/chat/completions"] and "sekrit" not in message
    assert "Authorization: Bearer $API_KEY" in argv
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == "m" and body["max_tokens"] == 64 and body["temperature"] == 0
