"""The vLLM plugin: registers the `exl3` quantization method (entry point `vllm.general_plugins`), and in the
OpenAI server's process corrects two tool-call behaviours of vLLM's structural-tag path (see tools.py).

vLLM runs the hook in every one of its processes, so registration is idempotent.
"""
import logging

_registered = False


class _ToVllm(logging.Handler):
    """Hands each record to vLLM's logger, whose handlers vLLM sets up when it likes (at import or at start-up)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def share_vllm_logging() -> None:
    """xmoe's log records (the kernels' warm-up, the loader) go where vLLM's own go, at INFO: Python's default
    would show warnings only, and a user waiting on start-up should see what it is doing. A logger that has
    handlers or a level already (set by the user, or by an earlier call) is left as it is."""
    ours = logging.getLogger("xmoe")
    if ours.handlers or ours.level != logging.NOTSET:
        return
    ours.addHandler(_ToVllm())
    ours.setLevel(logging.INFO)
    ours.propagate = False


def register() -> None:
    global _registered
    from .tools import patch_tool_arguments

    patch_tool_arguments()  # idempotent; each call looks again whether this is the server, with tool parsers loaded
    if _registered:
        return
    import vllm
    from vllm.model_executor.layers.quantization import register_quantization_config

    from .compat import check_version
    from .config import Exl3Config

    check_version(vllm.__version__)
    share_vllm_logging()

    register_quantization_config("exl3")(Exl3Config)
    _registered = True
