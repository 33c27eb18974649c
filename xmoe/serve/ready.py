"""The line `xmoe serve` prints once the server answers: its URL and a request to paste. An ASGI middleware
(`--middleware xmoe.serve.ready.ReadyMessage`), because the launcher hands its process over to vLLM's server,
and the server's startup (after the engine is built and the socket bound) is the moment it is ready."""
import json
import os
import shlex
import sys

PROMPT = "What is the capital of France?"


def ready_message(args) -> str:
    """What to print for vLLM's parsed server arguments `args`."""
    host = args.host if args.host not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
    url = f"http://{host}:{args.port}/v1"
    model = (args.served_model_name or [args.model])[0]
    # greedy: sampled (the demo's default, 0.2), a model as small as the demo's wanders off half the time
    body = json.dumps({"model": model, "max_tokens": 64, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPT}]})
    auth = ' -H "Authorization: Bearer $API_KEY"' if _keyed(args) else ""
    return (f"xmoe serve: ready at {url} (model {model!r}); stop it with Ctrl-C. Try:\n"
            f"  curl {url}/chat/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}")


def _keyed(args) -> bool:
    if getattr(args, "api_key", None):
        return True
    from vllm import envs
    return bool(envs.VLLM_API_KEY)


def announce(text: str) -> None:
    """Straight to the stdout file descriptor: vLLM 0.26 prefixes every line written through sys.stdout with its
    process name, which would break the curl line for copying."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())


class ReadyMessage:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def send_and_announce(message):
            await send(message)
            if message["type"] == "lifespan.startup.complete":
                args = getattr(getattr(scope.get("app"), "state", None), "args", None)
                if args is not None:
                    announce(ready_message(args))

        return await self.app(scope, receive, send_and_announce)
