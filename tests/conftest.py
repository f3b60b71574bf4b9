"""One real server on the tiny model, shared by the whole test session.

Run: make test   (or: .venv/bin/python -m pytest tests)
On a GPU machine the same tests run against a server on the GPU (see the README's GPU section).
"""

import importlib.util
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests use CUDA in this process (ipc weight sync); an engine started here later must spawn its
# workers, as CUDA cannot be initialised again in a forked child
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

from client import launch_server, stop_server, tiny_model  # noqa: E402

HAS_MCP = importlib.util.find_spec("mcp") is not None
needs_mcp = pytest.mark.skipif(not HAS_MCP, reason="the mcp package is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# on a GPU the session server takes little memory: tests start more engines and trainers beside it
GPU_FLAGS = (
    ("--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager")
    if torch.cuda.is_available()
    else ()
)


def position_gradients(model, backward):
    """(T-1,) the gradient reaching each position's final hidden state of a one-sequence batch
    after `backward()`: position t feeds only the logits that predict token t+1."""
    captured = {}

    def keep_hidden(module, inputs, output):
        output.retain_grad()
        captured["hidden"] = output

    hook = model.model.norm.register_forward_hook(keep_hidden)
    backward()
    hook.remove()
    return captured["hidden"].grad[0, :-1].abs().sum(-1)


@pytest.fixture(scope="session")
def model_path():
    return tiny_model()


@pytest.fixture(scope="session")
def server(model_path, tmp_path_factory):
    mcp = (
        (
            "--mcp-server",
            f"{sys.executable} {os.path.join(os.path.dirname(__file__), 'mcp_server.py')}",
        )
        if HAS_MCP
        else ()
    )
    proc, client = launch_server(
        *mcp,
        *GPU_FLAGS,
        "--tool-timeout",
        "2",
        log_path=tmp_path_factory.mktemp("server") / "server.log",
    )
    yield client
    stop_server(proc)


@pytest.fixture
def client(server):
    return server


@pytest.fixture
def restore_weights(server, model_path):
    """Push the tiny model's original weights back after a test that trained the server's."""
    yield
    from transformers import AutoModelForCausalLM

    server.init_communicator()
    server.update_model_params(AutoModelForCausalLM.from_pretrained(model_path))
    server.close_communicator()
