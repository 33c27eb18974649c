from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parent / "data"  # test data carried in the repository (data/README.md)


@pytest.fixture(autouse=True)
def _same_random_numbers():
    """Every test draws the same random inputs on every run, so a tolerance that passes once passes always."""
    torch.manual_seed(0)


@pytest.fixture
def vectors():
    np = pytest.importorskip("numpy")
    path = DATA / "exl3_decode_K2_K4.npz"
    if not path.exists():
        pytest.fail(f"ground-truth vectors missing: {path}")
    return np.load(path)


def gpu_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """One vLLM server for the whole session, on the demo model's `test` variant (built once into the user
    cache, ~2-3 min the first time) with `xmoe serve --demo`'s settings for this machine (its GPU if any), with a random API key that starts with '-', as 1 in 64 random keys do (on
    a command line it must be written `--api-key=KEY`). Yields an `xmoe.serve.server.Server`:
    `.base_url` (ends in /v1), `.url` (the root), `.api_key`, `.model` (the served name), `.options`,
    `.log_tail()`."""
    import secrets

    from xmoe.serve.demo import demo_model
    from xmoe.serve.options import ServeOptions, cuda_gpus, demo_defaults
    from xmoe.serve.server import Server

    model = demo_model("test")
    options = ServeOptions(model, **{**demo_defaults(cuda_gpus()), "served_model_name": "xmoe-demo-test"}, port=free_port(),
                           api_key="-" + secrets.token_urlsafe(16))
    server = Server(options, tmp_path_factory.mktemp("demo-server") / "server.log")
    with server:
        yield server
