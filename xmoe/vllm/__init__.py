"""The vLLM plugin: registers the `exl3` quantization method (entry point `vllm.general_plugins`), and in the
OpenAI server's process corrects two tool-call behaviours of vLLM's structural-tag path (see tools.py).

vLLM runs the hook in every one of its processes, so registration is idempotent.
"""
_registered = False


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

    register_quantization_config("exl3")(Exl3Config)
    _registered = True
