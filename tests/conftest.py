"""One real server on the tiny model, shared by the whole test session, and the helpers that start
the other servers side by side.

Run: make test   (or: .venv/bin/python -m pytest tests --durations=10)
On a GPU machine the same tests run against a server on the GPU; `make test-gpu` (or
`python3 -m pytest -m gpu`) runs the ones whose code path differs there (docs/testing.md).
"""

import contextlib
import importlib.util
import io
import os
import runpy
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests use CUDA in this process (ipc weight sync); an engine started here later must spawn its
# workers, as CUDA cannot be initialised again in a forked child
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
# One PyTorch thread in this process and in every process it starts (servers, train.py, benches):
# on a CPU they share a few cores with the engines and with the other xdist worker, and an OpenMP
# team whose second thread waits for a core is many times slower than one thread (a tiny model's
# training step, measured on 2 cores beside another such process: 0.4 s with one thread, 16-29 s
# with two).
if not torch.cuda.is_available():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

from local import launch_server, stop_server, tiny_model  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs: NCCL refuses two ranks on one GPU"
)
# on a GPU the session server takes little memory: tests start more engines and trainers beside it
GPU_FLAGS = (
    ("--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager")
    if torch.cuda.is_available()
    else ()
)


# -- servers started side by side --------------------------------------------------------------
# A server takes ~12 s of one core to start (its engine core and worker forked from it, at one
# thread: engine.Engine; ~30 s spawned, each process importing vLLM) and ~6 s to stop. Much of the
# suite's time is spent there, so servers that do not depend on each other start in background
# threads, two at a time (four with a GPU machine's cores), while other tests run; and they stop
# without the next test waiting for them.
STARTS = ThreadPoolExecutor(4 if torch.cuda.is_available() else 2)


def start_server(*flags, **options):
    """launch_server(*flags, **options) in the background: a Future of (process, Client)."""
    return STARTS.submit(launch_server, *flags, **options)


def stop_in_background(proc):
    """stop_server(proc) in a thread; the test session waits for it before it ends."""
    threading.Thread(target=stop_server, args=(proc,)).start()


def run_in_process(path, *args):
    """`python PATH ARGS` run in this process, where torch and transformers are imported already
    (~5 s a run less): its exit status and output, as subprocess.run gives them. The variables it
    sets in os.environ are undone."""
    argv = [path, *args]
    out, err, environ = io.StringIO(), io.StringIO(), dict(os.environ)
    try:
        with (
            mock.patch.object(sys, "argv", argv),
            # the script's folder first, as python puts it (bench/'s modules import each other)
            mock.patch.object(sys, "path", [os.path.dirname(path), *sys.path]),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            runpy.run_path(path, run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code
        if not isinstance(e.code, int | None):
            # sys.exit("why") prints why and exits 1, as Python does
            err.write(f"{e.code}\n")
            status = 1
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(argv, status or 0, out.getvalue(), err.getvalue())


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


# tools of one's own (tests/my_tools.py): plain ones, an async one that times out, and misbehaving
# ones (tests/test_rollout.py)
SESSION_TOOLS = ("reverse", "shout", "plus", "slow", "hang", "exits", "leak", "big")
# a real MCP server (tests/mcp_tools.py), over stdio, where the mcp package is installed (the GPU
# machines have none)
MCP_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcp_tools.py")
HAS_MCP = importlib.util.find_spec("mcp") is not None
needs_mcp = pytest.mark.skipif(not HAS_MCP, reason="needs the mcp package")


def start_session_server(log_path):
    tools = [f"--tool={name}=tests.my_tools:{name}" for name in SESSION_TOOLS]
    if HAS_MCP:
        tools += ["--mcp", f"arith={sys.executable} {MCP_TOOLS}"]
    # 5 s: a stdio MCP call on the loaded 2-core machine has taken more than 2
    return start_server(*tools, *GPU_FLAGS, "--tool-timeout", "5", log_path=log_path)


@pytest.fixture(scope="session", autouse=True)
def session_server_start(request, model_path, tmp_path_factory):
    """The session server starts with the session (if a collected test uses it), and comes up
    while the first tests run."""
    if any("server" in item.fixturenames for item in request.session.items):
        return start_session_server(tmp_path_factory.mktemp("server") / "server.log")


@pytest.fixture(scope="session")
def server(session_server_start):
    proc, client = session_server_start.result()
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


# -- a server for function calling: a model that writes a hermes-style tool call, and user flags --
# The chat template renders `tools` in a system turn and each tool call as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, the format of vLLM's hermes parser.
TOOL_TEMPLATE = (
    "{% if tools %}system: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% if m.tool_calls %}{% for call in m.tool_calls %}<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# the built-in calc as GET /tools lists it (engine.python_tool_schema): the schema train.py renders
# into a conversational row's prompt
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "The built-in tool: arithmetic on numbers, nothing else (no names, calls or "
        "attributes).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "2+3"}}}
# the two turns the model learns: ask the tool, then answer with its result
TOOL_TURNS = [
    (
        [{"role": "user", "content": "What is 2+3?"}],
        '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>',
    ),
    (
        [
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "5"},
        ],
        "It is 5.",
    ),
]


def tool_calling_model(path, steps=60):
    """The tiny model taught (a few supervised steps) to call `calc` and then answer, under
    TOOL_TEMPLATE; its folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import train

    tok = AutoTokenizer.from_pretrained(tiny_model())
    tok.chat_template = TOOL_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(tiny_model(), dtype=torch.float32)
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                m, tools=[CALC_TOOL], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for m, _ in TOOL_TURNS
    ]
    answers = [tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for _, a in TOOL_TURNS]
    batch = train.make_batch(prompts, answers, tok.pad_token_id)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = -(train.token_logprobs(model, batch) * batch["mask"]).sum() / batch["mask"].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    from local import save_model

    save_model(model, tok, str(path))
    return str(path)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A server on tool_calling_model with vLLM's hermes tool-call parser, a user's own --tool and
    a --served-model-name; its log at `.log_path`."""
    folder = tmp_path_factory.mktemp("tool-server")
    log_path = folder / "server.log"
    proc, client = launch_server(
        "--model",
        tool_calling_model(folder / "model"),
        "--tool-call-parser",
        "hermes",
        "--tool",
        "wordcount=tests.my_tools:word_count",
        "--served-model-name",
        "tiny-tools",
        *GPU_FLAGS,
        log_path=log_path,
    )
    client.log_path = log_path
    yield client
    stop_server(proc)
