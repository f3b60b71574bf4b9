"""Multi-turn tool episodes (RolloutEngine) through the real server.

The tiny model's text is noise, so tool calls are made deterministic: the prompt already holds
"<tool>NAME ARGUMENT" and the call ends with `call_end` set to the first character the model
emits greedily after that prompt.

Run: .venv/bin/python -m pytest tests/test_rollout.py
"""

import contextlib
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import tasks
import train
from conftest import MCP_TOOLS, needs_mcp, position_gradients


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def greedy_rollout(client, prompt, copies=None, **options):
    """The episode of `prompt` whose call ends with the first character the model writes greedily
    (with `copies`, the episodes of that many copies of it)."""
    first = client.generate([prompt], temperature=0.0, max_tokens=1)[0][0].text
    prompts = [prompt] * (copies or 1)
    episodes = client.rollout(prompts, temperature=0.0, max_tokens=8, call_end=first, **options)
    return [per[0] for per in episodes] if copies else episodes[0][0]


def segments(episode):
    """Runs of equal loss-mask value: [(mask, token ids)]."""
    runs = []
    for t, m in zip(episode.token_ids, episode.loss_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(t)
        else:
            runs.append((m, [t]))
    return runs


def test_tokens_are_prompt_then_sampled_then_tool_output_exactly(client, tokenizer):
    prompt = "<tool>calc 2+3"
    ep = greedy_rollout(client, prompt, max_turns=3)
    assert ep.tool_calls[0] == {"name": "calc", "argument": "2+3", "result": "5"}
    runs = segments(ep)
    assert runs[0] == (0, tokenizer(prompt).input_ids)
    assert runs[1][0] == 1 and tokenizer.decode(runs[1][1]) == ep.turns[0]["text"]
    assert runs[2] == (0, tokenizer("<result>5</result>").input_ids)
    sampled = [ids for m, ids in runs if m == 1]
    assert len(sampled) == len(ep.turns) >= 2
    # turn 2 is exactly what the engine samples from the token ids so far: nothing re-tokenised
    context = sum((ids for _, ids in runs[:3]), [])
    again = client.generate([context], temperature=0.0, max_tokens=len(sampled[1]))[0][0]
    assert again.token_ids == sampled[1]


def test_logprobs_exactly_on_sampled_tokens(client):
    ep = greedy_rollout(client, "<tool>calc 7*6", max_turns=3)
    assert len(ep.logprobs) == len(ep.token_ids) == len(ep.loss_mask)
    assert all((lp is not None) == bool(m) for lp, m in zip(ep.logprobs, ep.loss_mask))
    assert all(lp <= 0 for lp in ep.logprobs if lp is not None)
    assert {t["version"] for t in ep.turns} == {client.health()["version"]}


@pytest.mark.parametrize(
    "call,error",
    [
        ("calc 2+", "error: SyntaxError"),
        ("nosuch 1", "error: unknown tool 'nosuch'"),
        ("slow 30", "error: tool 'slow' timed out after 5.0 s"),
        ("calc 9**9**9", "error: ValueError: result too large"),
        ("calc 7**(10**7)", "error: ValueError: result too large"),
        ("exits 3", "error: SystemExit: 3"),
        ("leak x", "error: CancelledError"),
    ],
)
def test_failing_unknown_and_slow_tools_answer_with_an_error_text(client, call, error):
    """Whatever a tool does (raises, exits, leaks a CancelledError, or computes a power of hours),
    the episode gets an error text and goes on, and the server serves on."""
    ep = greedy_rollout(client, f"<tool>{call}", max_turns=2)
    assert ep.tool_calls[0]["result"].startswith(error)
    assert len(ep.turns) == 2  # the episode went on after the error
    assert client.health()["status"] == "ok"


def test_a_tool_answer_is_tokenised_as_text_not_as_special_tokens(client, tokenizer):
    """A tool that answers "<|endoftext|>" (the tiny model's control token): the episode holds
    those characters, one token each, never the end-of-text token."""
    ep = greedy_rollout(client, "<tool>reverse >|txetfodne|<", max_turns=2)
    assert ep.tool_calls[0]["result"] == "<|endoftext|>"
    output = segments(ep)[2]
    text = tokenizer("<result><|endoftext|></result>", split_special_tokens=True).input_ids
    assert output == (0, text) and tokenizer.eos_token_id not in output[1]


def test_tools_of_ones_own_are_listed_and_called(client):
    assert {"reverse", "shout"} <= set(client.health()["tools"])
    ep = greedy_rollout(client, "<tool>reverse abc", max_turns=2)
    assert ep.tool_calls[0] == {"name": "reverse", "argument": "abc", "result": "cba"}


def test_tools_outside_the_allowed_list_are_refused(client):
    ep = greedy_rollout(client, "<tool>shout hi", max_turns=2, tools=["calc"])
    assert ep.tool_calls[0]["result"] == "error: tool 'shout' is not available"


def test_max_turns_and_token_budget_stop_an_episode(client):
    # the last turn's call is not made: its answer would come after the episode, unseen
    ep = greedy_rollout(client, "<tool>calc 1+1", max_turns=1)
    assert ep.finish_reason == "max_turns" and len(ep.turns) == 1 and ep.tool_calls == []
    assert ep.loss_mask[-1] == 1
    ep = greedy_rollout(client, "<tool>calc 1+1", max_turns=5, max_episode_tokens=4)
    assert ep.finish_reason == "budget" and len(ep.turns) == 1
    assert sum(1 for m in ep.loss_mask if m) <= 4


def test_a_call_is_read_from_its_own_turn_only(client):
    """A second turn that ends in `call_end` with no `call_start` of its own is the model's answer,
    not a call whose argument runs back over the first call and its result. The model's text is
    noise: try each character it writes as `call_end` until a second turn ends with it."""
    exercised = 0
    for prompt in ("<tool>calc 6*7", "<tool>calc 2+3", "<tool>calc 9-4"):
        first = client.generate([prompt], temperature=0.0, max_tokens=48)[0][0].text
        for call_end in dict.fromkeys(first):
            [[ep]] = client.rollout(
                [prompt], temperature=0.0, max_tokens=48, call_end=call_end, max_turns=3
            )
            if len(ep.turns) >= 2 and ep.turns[1]["text"].endswith(call_end):
                exercised += 1
                assert len(ep.tool_calls) == 1 and ep.finish_reason == "stop", ep.tool_calls
    assert exercised, "no second turn ended with its call_end: try other prompts"


def test_bad_rollout_input_is_a_4xx(client):
    from client import ServerError

    for bad in [
        dict(max_turns=0),
        dict(tools=["nosuch"]),
        dict(call_end=""),
        dict(max_episode_tokens="x"),
        dict(result_format="no place for the answer"),
    ]:
        with pytest.raises(ServerError) as e:
            client.rollout(["a"], **bad)
        assert e.value.status == 400


def test_50_concurrent_episodes_all_finish(client):
    episodes = client.rollout(
        ["<tool>calc 3*3"] * 10, n=5, temperature=1.0, max_tokens=6, max_turns=3, call_end="x"
    )
    assert [len(per_prompt) for per_prompt in episodes] == [5] * 10
    assert all(
        ep.finish_reason in ("stop", "length", "max_turns", "budget")
        for per in episodes
        for ep in per
    )
    assert client.health()["pending_results"] == 0


def test_training_on_episodes_puts_gradient_only_on_sampled_tokens(client, model_path):
    ep = greedy_rollout(client, "<tool>calc 4+4", max_turns=3)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    batch = train.make_batch([[]], [ep.token_ids], pad_id=1, loss_masks=[ep.loss_mask])

    def backward():
        logprobs = train.token_logprobs(model, batch)
        on_policy = torch.zeros_like(logprobs, dtype=torch.bool)
        train.pg_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), batch["mask"], on_policy)[
            0
        ].backward()

    grad = position_gradients(model, backward)
    target_mask = torch.tensor(ep.loss_mask[1:], dtype=torch.bool)  # position t predicts token t+1
    assert (grad[~target_mask] == 0).all()
    assert (grad[target_mask] > 0).all()


def test_100_hung_tool_calls_leave_the_other_tools_answering(client):
    # each call of `hang` sleeps for 10 minutes; its slot is given back at its timeout (5 s)
    episodes = greedy_rollout(client, "<tool>hang 1", copies=100, max_turns=2)
    results = {ep.tool_calls[0]["result"] for ep in episodes}
    assert results == {"error: tool 'hang' timed out after 5.0 s"}
    ep = greedy_rollout(client, "<tool>reverse abc", max_turns=2)
    assert ep.tool_calls[0]["result"] == "cba"
    ep = greedy_rollout(client, "<tool>calc 2+3", max_turns=2)
    assert ep.tool_calls[0]["result"] == "5"


def python_process(code):
    """`code` run to its end by this Python in a process of its own, from the repository root."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-c", code]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)


def test_hung_tools_do_not_hold_up_the_process_exit():
    """A process whose tools hang still exits (the server's SIGTERM ends its loop the same way:
    aiohttp then shuts the loop's executor down, which waits for every thread it holds). In a
    process of its own, without an engine: RolloutEngine.call_tool needs none."""
    code = (
        "import asyncio, engine, tests.my_tools as t\n"
        "r = engine.RolloutEngine(None, {'hang': t.hang}, tool_timeout=0.5)\n"
        "async def main():\n"
        "    print(set(await asyncio.gather(*(r.call_tool('hang', '') for _ in range(100)))))\n"
        "asyncio.run(main())\n"
    )
    done = python_process(code)
    assert done.returncode == 0, done.stderr
    assert "timed out after 0.5 s" in done.stdout


def test_timed_out_plain_tools_hold_no_more_threads_than_their_slots():
    """120 calls of a plain tool that hangs, 40 at a time: each that times out leaves its thread
    running (a thread cannot be stopped), but past TOOL_THREADS of them the calls wait for a
    slot and time out there, starting none. In a process of its own, without an engine."""
    code = (
        "import asyncio, threading, engine, tests.my_tools as t\n"
        "r = engine.RolloutEngine(None, {'hang': t.hang}, tool_timeout=0.5)\n"
        "async def main():\n"
        "    before = threading.active_count()\n"
        "    for _ in range(3):\n"
        "        await asyncio.gather(*(r.call_tool('hang', '') for _ in range(40)))\n"
        "    print(threading.active_count() - before, engine.TOOL_THREADS)\n"
        "asyncio.run(main())\n"
    )
    threads, bound = map(int, python_process(code).stdout.split())
    assert threads <= bound, (threads, bound)


def test_a_drain_update_waits_for_whole_tool_episodes(client, model_path):
    """A push in drain mode that lands while the episodes' tool runs (1 s) waits for them to end:
    every turn of an episode samples the same weights. In-flight mode labels each token with its
    version instead: there, an episode spans two."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    first = client.generate(["<tool>slow 1"], temperature=0.0, max_tokens=1)[0][0].text
    client.init_communicator()
    try:
        for mode in ("drain", "in-flight"):
            future = client.rollout(
                ["<tool>slow 1"] * 4, True, temperature=0.0, max_tokens=8, call_end=first
            )
            for _ in range(3):
                client.update_model_params(model, mode=mode)
            episodes = [ep for per in future.result() for ep in per]
            assert all(ep.tool_calls[0]["result"] == "done" for ep in episodes)
            spans = [len({v for v, _ in ep.versions}) for ep in episodes]
            assert (max(spans) == 1) == (mode == "drain"), (mode, spans)
            turns = [{t["version"] for t in ep.turns} for ep in episodes]
            assert all(len(versions) == 1 for versions in turns) == (mode == "drain")
    finally:
        client.close_communicator()


def test_a_tool_output_is_cut_to_the_budget_and_the_context(client, tokenizer):
    prompt = "<tool>big 100000"
    ep = greedy_rollout(client, prompt, max_turns=3, max_episode_tokens=64)
    assert ep.finish_reason == "budget"
    assert len(ep.token_ids) - len(tokenizer(prompt).input_ids) == 64
    # a budget as long as the context: the context cuts it, and the next turn is never refused
    context = client.health()["max_model_len"]
    ep = greedy_rollout(client, prompt, max_turns=3, max_episode_tokens=context)
    assert ep.finish_reason == "length"
    assert len(ep.token_ids) == context - 1


def test_a_fuzz_of_rollouts_with_misbehaving_tools_answers_no_5xx(client):
    from client import ServerError

    rng = random.Random(0)
    calls = ["calc 9**9**9", "calc 2**4096*2**4096", "calc 1/0", "exits 1", "leak x", "hang 1"]
    calls += ["big 50000", "slow 0.1", "nosuch 1", "reverse abc", "calc (((1)))", ""]
    # the character each call's prompt is followed by greedily: with it as call_end, a call is made
    ends = {
        c: client.generate([f"<tool>{c}"], temperature=0.0, max_tokens=1)[0][0].text for c in calls
    }
    futures, statuses = [], []
    for _ in range(40):
        call = rng.choice(calls)
        options = [
            {"max_turns": rng.randint(1, 4), "max_episode_tokens": rng.choice([1, 8, 64, 5000])},
            {"tools": rng.choice([None, [], ["calc"], ["hang", "big"]])},
            {"max_tokens": rng.randint(1, 16), "n": rng.randint(1, 3), "temperature": 1.0},
            {"call_start": rng.choice(["<tool>", "(", "c"]), "call_end": rng.choice(["1", ")"])},
            {"max_turns": rng.choice([-1, "2", 1e9]), "tools": rng.choice(["calc", [1], {}])},
        ]
        body = {k: v for o in rng.sample(options, 2) for k, v in o.items()}
        body = {"max_tokens": 4, "temperature": 0.0, "call_end": ends[call], **body}
        try:
            futures.append(client.rollout([f"<tool>{call}"] * rng.randint(1, 3), True, **body))
        except ServerError as e:
            statuses.append(e.status)
    episodes = []
    for future in futures:
        try:
            episodes += [ep for per in future.result() for ep in per]
        except ServerError as e:
            statuses.append(e.status)
    assert all(status < 500 for status in statuses), statuses
    assert len(futures) > 10 and client.health()["status"] == "ok"
    # the misbehaving tools were called, and the episodes came back
    called = {call["name"] for ep in episodes for call in ep.tool_calls}
    assert len(called - {"slow", "reverse", "calc"}) >= 2, called


@needs_mcp
def test_get_tools_lists_every_tool_as_openai_schemas(client):
    tools = {t["function"]["name"]: t for t in client._request("GET", "/tools")["tools"]}
    assert {"calc", "reverse", "plus", "add", "power"} <= set(tools)
    plus = tools["plus"]["function"]
    assert plus["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert plus["parameters"]["required"] == ["a"] and plus["description"].startswith("a + b")
    # an MCP tool's schema is its server's own
    assert tools["add"]["function"]["parameters"]["required"] == ["a", "b"]


def test_python_tools_of_keyword_arguments_take_json(client):
    ep = greedy_rollout(client, '<tool>plus {"a": 2, "b": 5}', max_turns=2)
    assert ep.tool_calls[0]["result"] == "7"
    ep = greedy_rollout(client, '<tool>plus {"b": 5}', max_turns=2)
    assert ep.tool_calls[0]["result"].startswith("error: TypeError")


@needs_mcp
def test_a_short_run_of_the_power_task_calls_the_mcp_tool(client, restore_weights, tmp_path):
    """train.py --task power, as the README writes it, on the session server, whose --mcp
    arith=... has the `power` tool (before the test below ends that MCP server): the task's own
    --max-tokens and --max-turns hold the call, the warm start teaches it, and the run's episodes
    call the MCP tool, with two arguments, and get its answers."""
    args = ["--task", "power", "--server-url", client.base_url, "--steps", "2"]
    args += ["--out", str(tmp_path)]
    # a third of the default warm start: the call is learnt well before the guesses
    args += ["--warm-start-steps", "30"]
    history = train.main(args)
    assert all(row["tool_share"] > 0 for row in history)
    # the run's calls that the MCP server answered (a call the briefly taught model garbles gets
    # an error text instead)
    assert sum(row["tool_calls"] - row["tool_errors"] for row in history) > 0
    # the run's weights are the server's now: their episodes' calls, each answered or refused
    prompts = [row["prompt"] for row in tasks.power_data(4, 0)]
    episodes = client.rollout(prompts, tools=["power"], n=8, max_turns=2, max_tokens=48)
    calls = [call for group in episodes for ep in group for call in ep.tool_calls]
    # a run's weights call in about 3 of 4 episodes (10 to 13 of 16, nine runs), now and then with
    # a garbled name or argument
    turns = [ep.turns[0] for group in episodes for ep in group][:4]
    answered = [call for call in calls if call["name"] == "power" and call["result"].isdigit()]
    assert answered, (history, turns, calls[:4])
    assert all(call["result"].isdigit() or call["result"].startswith("error") for call in calls)


@needs_mcp
@pytest.mark.parametrize(
    "call,result",
    [
        ('add {"a": 2, "b": 3}', "5"),
        ('power {"base": 3, "exponent": 3}', "27"),
        ('fails {"reason": "no"}', "error: Error executing tool fails"),
        ("add {bad", "error: JSONDecodeError"),
        ("hangs", "error: tool 'hangs' timed out after 5.0 s"),
        ('add {"a": 1, "b": 1}', "2"),
        # arguments named as the server's own function's: they go to the tool as one dict
        ('echo {"name": "a", "session": "b"}', "a b"),
    ],
)
def test_mcp_tools_over_stdio_in_episodes(client, call, result):
    """The session server's --mcp arith=... (tests/mcp_tools.py): called with JSON arguments."""
    ep = greedy_rollout(client, f"<tool>{call}", max_turns=2)
    assert ep.tool_calls[0]["result"].startswith(result)
    assert client.health()["status"] == "ok"


@needs_mcp
def test_a_dead_mcp_server_shows_down_in_health_and_is_started_again(client):
    """The session server's MCP server exits mid-call (`dies`): /health shows it down at once, it
    is started again (after 1 s), and its tools answer again; the other tools never stopped."""
    ep = greedy_rollout(client, "<tool>dies", max_turns=2)
    assert ep.tool_calls[0]["result"].startswith("error: MCPError")
    assert client.health()["mcp"] == {"arith": "down"}
    assert greedy_rollout(client, "<tool>calc 1+1", max_turns=2).tool_calls[0]["result"] == "2"
    deadline = time.monotonic() + 60
    while client.health()["mcp"] != {"arith": "up"}:
        assert time.monotonic() < deadline, "the MCP server was not started again within 60 s"
        time.sleep(0.2)
    ep = greedy_rollout(client, '<tool>add {"a": 1, "b": 1}', max_turns=2)
    assert ep.tool_calls[0]["result"] == "2"


@contextlib.asynccontextmanager
async def mcp_servers(*flags):
    """The MCP servers of the server's `flags`, started and stopped as the server does (mcp_ctx),
    in this process and without an engine: yields (tools, schemas, the MCPServers)."""
    from aiohttp import web

    import server

    app = web.Application()
    app[server.STATE] = server.State(server.parse_args(list(flags)))
    started = server.mcp_ctx(app)
    await anext(started)
    try:
        yield app[server.MCP]
    finally:
        await anext(started, None)


ARITH = f"arith={sys.executable} {MCP_TOOLS}"


@needs_mcp
def test_mcp_env_passes_the_named_variables_to_a_stdio_mcp_server(monkeypatch):
    """--mcp-env NAME: the MCP server sees NAME; a variable not named stays unset there (the mcp
    package passes only PATH, HOME and a few)."""
    import asyncio

    import engine

    monkeypatch.setenv("ASYNC_GRPO_PASSED", "yes")
    monkeypatch.setenv("ASYNC_GRPO_KEPT", "secret")

    async def answers():
        async with mcp_servers("--mcp", ARITH, "--mcp-env", "ASYNC_GRPO_PASSED") as (
            tools,
            schemas,
            _,
        ):
            rollouts = engine.RolloutEngine(None, tools, schemas)
            names = ("ASYNC_GRPO_PASSED", "ASYNC_GRPO_KEPT")
            return [await rollouts.call_tool("getenv", f'{{"variable": "{n}"}}') for n in names]

    assert asyncio.run(answers()) == ["yes", "unset"]


@needs_mcp
def test_a_killed_server_takes_its_busy_stdio_mcp_server_with_it():
    """SIGKILL of a process that started a stdio MCP server as the server does (mcp_ctx) while
    a call of `hangs` keeps that MCP server busy: the MCP server dies too (else it would live
    for the 10 minutes of the call). In a process of its own, without an engine."""
    import psutil

    code = (
        "import asyncio, server\n"
        "from aiohttp import web\n"
        "app = web.Application()\n"
        f"app[server.STATE] = server.State(server.parse_args(['--mcp', {ARITH!r}]))\n"
        "async def main():\n"
        "    await anext(server.mcp_ctx(app))\n"
        "    call = asyncio.ensure_future(app[server.MCP][0]['hangs']({}))\n"
        "    # the call reaches the MCP server\n"
        "    await asyncio.sleep(1)\n"
        "    print('busy', flush=True)\n"
        "    await call\n"
        "asyncio.run(main())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE)
    children = []
    try:
        assert proc.stdout.readline() == b"busy\n"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        proc.kill()
        proc.wait(30)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive
    finally:
        proc.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


@needs_mcp
def test_mcp_tools_over_streamable_http():
    """mcp_ctx connects to an MCP server over streamable HTTP as the server does at start, and
    RolloutEngine calls its tools; in this process (a server on it would start an engine for
    what the stdio test shows already)."""
    import asyncio
    import socket

    import engine
    from client import free_port

    port = free_port()
    mcp = subprocess.Popen([sys.executable, MCP_TOOLS, "--port", str(port)], stderr=subprocess.PIPE)
    for _ in range(300):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.1):
            break
        time.sleep(0.1)

    async def calls():
        async with mcp_servers("--mcp", f"arith=http://127.0.0.1:{port}/mcp") as (
            tools,
            schemas,
            _,
        ):
            rollouts = engine.RolloutEngine(None, tools, schemas, tool_timeout=2.0)
            return [await rollouts.call_tool(name, argument) for name, argument in CALLS]

    try:
        answers = asyncio.run(calls())
    finally:
        mcp.kill()
        mcp.wait()
    assert answers[:3] == [
        "5",
        "error: Error executing tool fails",
        "error: tool 'hangs' timed out after 2.0 s",
    ]
    assert answers[3] == "2" and answers[4].startswith("error: MCPError")


CALLS = [("add", '{"a": 2, "b": 3}'), ("fails", '{"reason": "x"}'), ("hangs", "")]
CALLS += [("add", '{"a": 1, "b": 1}'), ("dies", "")]


def test_train_refuses_tools_the_server_lacks_before_the_first_step(client):
    cfg = train.Config(tools="plus,nosuch", server_url=client.base_url)
    with pytest.raises(SystemExit) as e:
        train.connect(cfg, [client.base_url])
    assert "nosuch" in str(e.value) and "\n" not in str(e.value)
    assert train.episode_tools(cfg) == ["plus", "nosuch"]
    assert train.episode_tools(train.Config(task="calculator")) == ["calc"]
    assert train.episode_tools(train.Config()) == []
    # the episodes call what --tools names, not a hard-coded list (submit_prompts passes it)
    assert train.episode_tools(train.Config(task="calculator", tools="plus")) == ["plus"]


def test_an_mcp_tool_named_as_another_tool_is_refused_at_start():
    """An MCP tool named as a --tool, calc, or another --mcp server's tool (it would replace that
    tool) stops the start in one line that names the cause itself, not the task groups around
    it; in this process, as the start fails before the engine's."""
    import asyncio

    async def start(*flags):
        async with mcp_servers(*flags):
            pass

    for flags in [("--tool", "add=tests.my_tools:plus", "--mcp", ARITH), ("--mcp", ARITH) * 2]:
        with pytest.raises(SystemExit, match="'add' has the name of another tool") as e:
            asyncio.run(start(*flags))
        assert "\n" not in str(e.value) and "ExceptionGroup" not in str(e.value)


def test_train_refuses_tools_the_server_lacks_before_the_warm_start(client, tmp_path, monkeypatch):
    """--server-url is asked for its tools before the built-in model's warm start (minutes on a
    real task) runs: here, in a folder of the test's own, the warm start never made its model."""
    monkeypatch.setattr(train, "TINY_MODEL_DIR", str(tmp_path / "tiny"))
    args = ["--server-url", client.base_url, "--tools", "nosuch", "--warm-start-steps", "3"]
    with pytest.raises(SystemExit, match="nosuch"):
        train.main(args + ["--out", str(tmp_path / "run")])
    assert not os.path.exists(train.builtin_folders(train.parse_config(args))[1])


def test_train_refuses_tools_a_server_it_starts_would_lack_before_anything_runs(tmp_path):
    """Without --server-url, the server train.py would start serves calc and --server-args'
    --tool's: another name of --tools is refused with the flags, before the warm start."""
    own = ["--server-args", "--tool rev=my_tools:reverse", "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match="a server started here has no tool nosuch$"):
        train.main(["--tools", "calc,rev,nosuch", *own])


def test_a_run_whose_tool_calls_fail_counts_them_and_warns(
    client, restore_weights, tmp_path, capsys
):
    """train.py --task power --tools exits: the model calls `power`, which its episodes may not
    call, so every call answers an error; metrics.jsonl counts them and the step warns."""
    args = ["--task", "power", "--tools", "exits", "--server-url", client.base_url]
    args += ["--max-tokens", "48", "--max-turns", "2", "--steps", "1", "--out", str(tmp_path)]
    # the warm start of test_a_short_run_of_the_power_task_calls_the_mcp_tool (built once)
    [row] = train.main(args + ["--warm-start-steps", "30"])
    assert row["tool_errors"] == row["tool_calls"] > 0
    assert "WARNING: " in capsys.readouterr().err
