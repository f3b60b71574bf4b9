"""The server as a rollout service for one's own trainer, tools and agent: what a user who runs
only server.py and client.py meets.

Run: .venv/bin/python -m pytest tests/test_service.py
"""

import asyncio
import json
import random

import openai
import pytest
import requests
from test_rollout import greedy_rollout
from transformers import AutoModelForCausalLM, AutoTokenizer

import server
import train
from conftest import CALC_TOOL
from engine import RolloutEngine, calculator
from local import launch_server


# -- a user's own tool, one flag away --------------------------------------------------------------
def test_a_users_own_tool_is_registered_by_a_flag_and_called(tool_server):
    assert "wordcount" in tool_server.health()["tools"]
    # the built-in format, on a server whose default is its parser's (hermes)
    prompt = "<tool>wordcount one two three"
    ep = greedy_rollout(tool_server, prompt, max_turns=2, call_start="<tool>")
    assert ep.tool_calls[0] == {"name": "wordcount", "argument": "one two three", "result": "3"}
    [[allowed]] = tool_server.rollout(["x"], tools=["wordcount"], max_tokens=2)
    assert allowed.finish_reason


def test_a_tool_flag_that_names_no_function_is_refused_in_one_line(capsys):
    for spec in ("wordcount=tests.my_tools:nosuch", "wordcount=nosuch_module:f"):
        with pytest.raises(SystemExit):
            server.parse_args(["--tool", spec])
        err = capsys.readouterr().err
        # the flag, the spec and why, in one line
        assert "--tool wordcount= " in err and "(module:function)" in err, err


# -- OpenAI function calling ----------------------------------------------------------------------
def test_an_openai_agent_with_function_calling_gets_tool_calls_and_a_token_exact_episode(
    tool_server,
):
    """An agent as most are written: pass `tools`, read `tool_calls`, run the tool, answer with a
    tool message, call again. The session merges into one episode of exactly the sampled tokens."""
    agent = openai.OpenAI(
        base_url=tool_server.base_url + "/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Session-ID": "tools-1"},
    )
    [model] = [m.id for m in agent.models.list().data]
    messages = [{"role": "user", "content": "What is 2+3?"}]
    reply = agent.chat.completions.create(
        model=model, messages=messages, tools=[CALC_TOOL], temperature=0, max_tokens=100
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "calc" and call.id
    arguments = json.loads(call.function.arguments)
    assert arguments == {"expression": "2+3"}
    # the agent appends the reply as it came, and the tool's answer
    messages.append(choice.message)
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": calculator(arguments["expression"])}
    )
    reply = agent.chat.completions.create(
        model=model, messages=messages, tools=[CALC_TOOL], temperature=0, max_tokens=100
    )
    assert (
        reply.choices[0].message.content == "It is 5." and not reply.choices[0].message.tool_calls
    )
    calls, episode = tool_server.session("tools-1")
    assert len(calls) == 2 and episode is not None, calls
    sampled = [t for t, m in zip(episode.token_ids, episode.loss_mask) if m]
    assert sampled == calls[0]["completion_token_ids"] + calls[1]["completion_token_ids"]
    assert episode.token_ids[: len(calls[1]["prompt_token_ids"])] == calls[1]["prompt_token_ids"]
    # the episode is the whole conversation under the chat template, token for token
    tok = AutoTokenizer.from_pretrained(tool_server.health()["model"])
    call_message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": arguments}}],
    }
    whole = messages[:1] + [call_message, messages[2], {"role": "assistant", "content": "It is 5."}]
    text = tok.apply_chat_template(whole, tools=[CALC_TOOL], tokenize=False)
    assert episode.token_ids == tok.encode(text, add_special_tokens=False)[: len(episode.token_ids)]


def test_rollout_reads_a_call_in_the_familys_format_as_v1_does(tool_server):
    """With --tool-call-parser hermes, /rollout's default tags are the parser's, the parser reads
    the model's call, and calc gets its `expression` as a keyword."""
    tok = AutoTokenizer.from_pretrained(tool_server.health()["model"])
    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tok.apply_chat_template(
        messages, tools=[CALC_TOOL], tokenize=False, add_generation_prompt=True
    )
    [[ep]] = tool_server.rollout([prompt], temperature=0.0, max_tokens=100, max_turns=2)
    assert ep.tool_calls[0] == {"name": "calc", "argument": '{"expression": "2+3"}', "result": "5"}
    assert ep.turns[0]["text"].endswith("</tool_call>")


def test_a_conversational_rows_episode_is_the_conversation_under_the_chat_template(
    tool_server, tmp_path
):
    """train.py's tool episode on a conversational row: the prompt shows the tools as the chat
    template does, the tool's answer comes as the template's `tool` message, and the model,
    taught that conversation, answers from it: the episode is it, token for token."""
    path = tool_server.health()["model"]
    cfg = train.Config(model=path, tools="calc", max_turns=2, max_tokens=100, out=str(tmp_path))
    messages = [{"role": "user", "content": "What is 2+3?"}]
    sampling = dict(n=1, temperature=0.0, max_tokens=100)
    [future] = train.submit_prompts(tool_server, [{"prompt": messages}], cfg, **sampling)
    [[ep]] = future.result()
    assert ep.tool_calls == [
        {"name": "calc", "argument": '{"expression": "2+3"}', "result": "5"}
    ], ep
    assert ep.turns[1]["text"].startswith("It is 5.")
    answered = [
        {"role": "assistant", "content": ep.turns[0]["text"]},
        {"role": "tool", "content": "5"},
    ]
    whole = messages + answered + [{"role": "assistant", "content": "It is 5."}]
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(whole, tools=[CALC_TOOL], tokenize=False)
    assert ep.token_ids == tok.encode(text, add_special_tokens=False)[: len(ep.token_ids)]


def test_a_call_the_parser_cannot_read_answers_an_error():
    """A call between the parser's tags that it cannot read is the episode's error text."""
    rollouts = RolloutEngine(engine=None, read_call=lambda text: None)
    name, argument, keywords = rollouts.parse_call('{"name": oops', "<tool>", "</tool>")
    answer = asyncio.run(rollouts.call_tool(name, argument, keywords=keywords))
    assert answer.startswith("error: no tool call could be read") and "oops" in answer


def test_tools_without_a_parser_or_forcing_a_call_are_a_400(tool_server, server):
    for client, extra in ((server, {}), (tool_server, {"tool_choice": "required"})):
        oa = openai.OpenAI(base_url=client.base_url + "/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(
                model=oa.models.list().data[0].id,
                messages=[{"role": "user", "content": "hi"}],
                tools=[CALC_TOOL],
                max_tokens=2,
                **extra,
            )
        assert "--tool-call-parser" in e.value.body["message"]


def test_v1_names_the_model_by_its_served_name(tool_server):
    oa = openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="-", max_retries=0)
    assert [m.id for m in oa.models.list().data] == ["tiny-tools"]
    r = oa.completions.create(model="tiny-tools", prompt="a", max_tokens=2)
    assert r.model == "tiny-tools"


def test_a_weight_push_logs_no_warning(tool_server):
    model = AutoModelForCausalLM.from_pretrained(tool_server.health()["model"])
    tool_server.init_communicator(transport="gloo")
    tool_server.update_model_params(model)
    tool_server.close_communicator()
    log = open(tool_server.log_path).read()
    assert "Failed to load weights" not in log


# -- the rest of the contract ----------------------------------------------------------------------
def test_generate_returns_the_prompts_token_ids(server, model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    [[first, second]] = server.generate(["2+2="], n=2, max_tokens=3, seed=1)
    assert first.prompt_token_ids == second.prompt_token_ids == tok("2+2=").input_ids
    greedy = dict(max_tokens=3, temperature=0.0)
    [[by_text]] = server.generate(["2+2="], **greedy)
    [[by_ids]] = server.generate([first.prompt_token_ids], **greedy)
    assert by_ids.prompt_token_ids == first.prompt_token_ids
    assert by_ids.token_ids == by_text.token_ids


def test_a_server_that_fails_to_start_says_why_in_the_error():
    with pytest.raises(RuntimeError) as e:
        launch_server("--bogus-flag", timeout=120)
    assert "unrecognized arguments: --bogus-flag" in str(e.value)


def test_a_model_path_to_nothing_is_refused_in_one_line(capsys):
    """argparse's usage, then one line: no traceback."""
    with pytest.raises(SystemExit):
        server.parse_args(["--model", "/no/such/model"])
    err = capsys.readouterr().err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith("no model folder /no/such/model, and no hub id (NAME or ORG/NAME) either")
    )
    assert "Traceback" not in err


def test_get_future_without_an_id_names_the_missing_field(server):
    r = server.http.post(server.base_url + "/get_future", json={}, timeout=30)
    assert r.status_code == 400 and "request_id" in r.json()["error"]


def test_a_remote_future_times_out_with_timeout_error_and_says_when_done(server):
    future = server.generate(["slow"], max_tokens=1000, ignore_eos=True, is_async=True)
    assert not future.done()
    with pytest.raises(TimeoutError):
        future.result(timeout=0)
    [[c]] = future.result(timeout=120)
    assert future.done() and len(c.token_ids) == 1000
    assert future.result() == [[c]]


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        server.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "(default: 256)" in out and "(default: 600.0)" in out


def test_streamed_tool_calls_follow_openais_delta_format(tool_server):
    """The openai SDK's stream() helper accumulates the deltas into the message: each streamed tool
    call carries its `index` (without it the helper raised TypeError)."""
    oa = openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="-", max_retries=0)
    with oa.chat.completions.stream(
        model=oa.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is 2+3?"}],
        tools=[CALC_TOOL],
        temperature=0,
        max_tokens=100,
    ) as stream:
        for _ in stream:
            pass
        choice = stream.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {
        "expression": "2+3"
    }


def test_fuzzed_v1_bodies_with_tools_and_streams_never_get_a_5xx(tool_server):
    """Random mixes of tools, tool choices, tool-call messages and streams, valid and not: 4xx or
    200, never a 5xx, and the server still serves."""
    rng = random.Random(2)
    oa = openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="-", max_retries=0)
    model = oa.models.list().data[0].id
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
    junk = {
        "tools": [[CALC_TOOL], [CALC_TOOL] * 3, [{"type": "function"}], [{}], "calc", None, [1]],
        "tool_choice": ["auto", "none", "required", {"type": "function"}, 3, None],
        "stream": [True, False, "yes", None],
        "n": [1, 2, 0, None],
        "messages": [
            [{"role": "user", "content": "What is 2+3?"}],
            [{"role": "assistant", "content": None, "tool_calls": [call]}],
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{"}}]}],
            [{"role": "tool", "content": "5"}],
            [{"role": "assistant", "tool_calls": "x"}],
        ],
    }
    statuses = {}
    for _ in range(60):
        body = {"model": model, "messages": junk["messages"][0], "max_tokens": 8}
        for name in rng.sample(sorted(junk), rng.randint(1, 4)):
            body[name] = rng.choice(junk[name])
        r = requests.post(tool_server.base_url + "/v1/chat/completions", json=body, timeout=120)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.text[:300])
    print(f"tools fuzz: 60 bodies, statuses {dict(sorted(statuses.items()))}")
    assert statuses.get(200) and statuses.get(400)
    assert oa.completions.create(model=model, prompt="ok", max_tokens=2).choices
