"""One real server on the tiny model, shared by the whole test session.

Run: make test   (or: .venv/bin/python -m pytest tests)
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from client import launch_server, stop_server  # noqa: E402
from engine import tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def model_path():
    return tiny_model()


@pytest.fixture(scope="session")
def server(model_path, tmp_path_factory):
    mcp = f"{sys.executable} {os.path.join(os.path.dirname(__file__), 'mcp_server.py')}"
    proc, client = launch_server("--mcp-server", mcp, "--tool-timeout", "2",
                                 log_path=tmp_path_factory.mktemp("server") / "server.log")
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
