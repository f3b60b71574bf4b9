"""Multi-turn tool episodes (RolloutEngine) through the real server.

The tiny model's text is noise, so tool calls are made deterministic: the prompt already holds
"<tool>NAME ARGUMENT" and the call ends with `call_end` set to the first character the model
emits greedily after that prompt.

Run: .venv/bin/python -m pytest tests/test_rollout.py
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from conftest import position_gradients


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def greedy_rollout(client, prompt, **options):
    # what the model says first
    first = client.generate([prompt], temperature=0.0, max_tokens=1)[0][0].text
    [[episode]] = client.rollout([prompt], temperature=0.0, max_tokens=8, call_end=first, **options)
    return episode


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
        ("slow 30", "error: tool 'slow' timed out after 2.0 s"),
    ],
)
def test_failing_unknown_and_slow_tools_answer_with_an_error_text(client, call, error):
    ep = greedy_rollout(client, f"<tool>{call}", max_turns=2)
    assert ep.tool_calls[0]["result"].startswith(error)
    assert len(ep.turns) == 2  # the episode went on after the error
    assert client.health()["status"] == "ok"


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
