"""One real server on the tiny model, shared by the whole test session.

Run: make test   (or: .venv/bin/python -m pytest tests)
"""
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from client import Client  # noqa: E402
from engine import tiny_model  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path, *flags, timeout=300):
    """Start `python server.py` on free ports; return (process, client) once /health answers."""
    port, group_port = free_port(), free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--port", str(port),
                             "--group-port", str(group_port), *flags], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    client = Client(f"http://127.0.0.1:{port}", timeout=120)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # the engine takes ~25 s to start on CPU
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            client.health(timeout=2)
            return proc, client
        except ConnectionError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server did not start in {timeout} s; see {log_path}")


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def model_path():
    return tiny_model()


@pytest.fixture(scope="session")
def server(model_path, tmp_path_factory):
    proc, client = start_server(tmp_path_factory.mktemp("server") / "server.log")
    yield client
    stop_server(proc)


@pytest.fixture
def client(server):
    return server
