"""The OpenAI-compatible routes, driven by the official `openai` client against the real server.

Run: .venv/bin/python -m pytest tests/test_openai.py
"""

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from client import ServerError
from conftest import position_gradients

# train.py's default reward for data of one's own
ANSWER_REWARD = train.Rewards(train.Config(model="m", reward="tasks:answer_reward"))


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(oa):
    [model] = oa.models.list().data
    return model.id


def test_chat_completion_carries_tokens_logprobs_and_version(oa, model_name, server, model_path):
    messages = [{"role": "user", "content": "2+2?"}]
    r = oa.chat.completions.create(
        model=model_name,
        messages=messages,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=2,
    )
    tok = AutoTokenizer.from_pretrained(model_path)
    assert r.prompt_token_ids == tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    assert len(r.choices) == 3 and r.usage.prompt_tokens == len(r.prompt_token_ids)
    for c in r.choices:
        assert c.weight_version == server.health()["version"]
        assert tok.decode(c.token_ids, skip_special_tokens=True) == c.message.content
        assert len(c.logprobs.content) == len(c.token_ids) and all(
            len(t.top_logprobs) == 2 for t in c.logprobs.content
        )
        assert all(
            t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob - 1e-5
            for t in c.logprobs.content
        )


def test_completions_and_streaming_give_the_same_text(oa, model_name):
    r = oa.completions.create(
        model=model_name, prompt="1+1=", n=2, max_tokens=5, seed=7, logprobs=1
    )
    assert [len(c.token_ids) for c in r.choices] == [len(c.logprobs.tokens) for c in r.choices]
    assert all(len(c.token_ids) <= 5 and c.finish_reason in ("stop", "length") for c in r.choices)
    kwargs = dict(
        model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=11
    )
    whole = oa.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(oa.chat.completions.create(stream=True, **kwargs))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_batch_of_one_prompt_is_that_prompt_and_a_batch_of_two_is_a_400(oa, model_name):
    kwargs = dict(model=model_name, max_tokens=6, seed=5, temperature=1.0)
    alone = oa.completions.create(prompt="2+3=", **kwargs)
    for batch in (["2+3="], [alone.prompt_token_ids]):
        r = oa.completions.create(prompt=batch, **kwargs)
        assert r.prompt_token_ids == alone.prompt_token_ids
        assert r.choices[0].token_ids == alone.choices[0].token_ids
    with pytest.raises(openai.BadRequestError, match="each prompt must be"):
        oa.completions.create(prompt=["2+3=", "1+1="], **kwargs)
    assert oa.completions.create(prompt="2+3=", **kwargs).choices[0].token_ids


def test_mistakes_are_4xx_in_openai_shape_and_the_server_keeps_serving(oa, model_name):
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    for bad in (
        dict(n=0),
        dict(temperature="hot"),
        dict(max_tokens=10**6),
        dict(top_logprobs=99, logprobs=True),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": "x"}], **bad
            )
        assert e.value.body["message"] and e.value.status_code == 400, bad
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model=model_name, messages=[{"role": "user"}])  # no content
    with pytest.raises(openai.BadRequestError) as e:
        # longer than --max-model-len
        oa.completions.create(model=model_name, prompt="x" * 3000, max_tokens=2)
    assert "refused" in e.value.body["message"]
    assert oa.completions.create(model=model_name, prompt="ok", max_tokens=2).choices


def test_an_openai_agent_session_merges_into_an_episode_and_trains_on_sampled_tokens_only(
    oa, model_name, server, model_path
):
    """A small agent written with the openai client: call the model, run a Python tool on its text,
    append the result, call again. Its session is one episode, trained like a /rollout episode."""
    agent = openai.OpenAI(
        base_url=server.base_url + "/v1",
        api_key="unused",
        default_headers={"X-Session-ID": "agent-1"},
    )
    messages = [{"role": "user", "content": "Count the letters in your answer."}]
    for turn in range(3):
        reply = agent.chat.completions.create(
            model=model_name, messages=messages, max_tokens=6, seed=turn
        )
        text = reply.choices[0].message.content
        messages += [
            {"role": "assistant", "content": text},
            {"role": "tool", "content": str(sum(map(str.isalpha, text)))},
        ]
    calls, episode = server.session("agent-1")
    assert len(calls) == 3 and episode is not None, calls
    assert [t["version"] for t in episode.turns] == [c["weight_version"] for c in calls]
    assert sum(episode.loss_mask) == sum(len(c["completion_token_ids"]) for c in calls)
    sampled = [t for t, m in zip(episode.token_ids, episode.loss_mask) if m]
    assert sampled == [t for c in calls for t in c["completion_token_ids"]]
    # one GRPO-style step on it: gradient reaches exactly the positions that predict sampled tokens
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    seq = train.to_sample({"answer": "3"}, episode, ANSWER_REWARD)
    grad = position_gradients(
        model,
        lambda: train.backward(
            model,
            [seq],
            torch.tensor([1.0]),
            max(seq.versions),  # the trainer's version: no token is stale
            train.Config(model="m"),
            pad_id=1,
        ),
    )
    predicts_sampled = torch.tensor(episode.loss_mask[1:], dtype=torch.bool)
    assert (grad[~predicts_sampled] == 0).all() and (grad[predicts_sampled] > 0).all()
    server._request("DELETE", "/v1/sessions/agent-1")
    with pytest.raises(ServerError) as e:
        server.session("agent-1")
    assert e.value.status == 404


def test_a_session_that_does_not_continue_itself_has_no_episode(oa, model_name, server):
    agent = openai.OpenAI(
        base_url=server.base_url + "/v1",
        api_key="unused",
        default_headers={"X-Session-ID": "agent-2"},
    )
    for content in ("first question", "an unrelated second question"):
        agent.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": content}], max_tokens=3
        )
    calls, episode = server.session("agent-2")
    assert len(calls) == 2 and episode is None


def test_a_merged_session_keeps_each_calls_weight_version(oa, model_name, server, model_path):
    """An agent's two calls, a weight push between them: the merged episode labels each call's
    sampled tokens with the version that sampled them, as train.to_sample reads them."""
    agent = oa.with_options(default_headers={"X-Session-ID": "agent-3"})
    messages = [{"role": "user", "content": "a question"}]
    reply = agent.chat.completions.create(model=model_name, messages=messages, max_tokens=4)
    # the same weights, pushed: one version more
    server.init_communicator(transport="gloo")
    server.update_model_params(AutoModelForCausalLM.from_pretrained(model_path))
    server.close_communicator()
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "tool", "content": "a tool's answer"},
    ]
    agent.chat.completions.create(model=model_name, messages=messages, max_tokens=4)
    calls, episode = server.session("agent-3")
    assert episode is not None, calls
    versions = train.to_sample({"answer": ""}, episode, ANSWER_REWARD).versions
    sampled = [v for v, m in zip(versions, episode.loss_mask) if m]
    first, second = (len(c["completion_token_ids"]) for c in calls)
    v0 = calls[0]["weight_version"]
    assert sampled == [v0] * first + [v0 + 1] * second
    assert calls[1]["weight_version"] == v0 + 1
    server._request("DELETE", "/v1/sessions/agent-3")
