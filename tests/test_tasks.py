"""The built-in tasks' data and rewards, on the built-in model's tokenizer; chat-sums' warm start
on its chat template. No server: these run in seconds."""

import statistics

import pytest
from transformers import AutoTokenizer

import tasks
import train


@pytest.fixture(scope="module")
def tok(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def test_chat_sums_asks_in_a_chat_message_for_long_worked_solutions_of_varied_length(tok):
    rows = tasks.chat_sums_data(2000, seed=0)
    assert all(
        [message["role"] for message in row["prompt"]] == ["user"] and row["prompt"][0]["content"]
        for row in rows
    )
    lengths = sorted(len(tok(row["solution"]).input_ids) + 1 for row in rows)  # and end-of-text
    quartiles = statistics.quantiles(lengths, n=4)
    # a median of at least 150 tokens, half of them 100 tokens or more apart, and room to write
    # the longest within the task's --max-tokens
    assert quartiles[1] >= 150 and quartiles[2] - quartiles[0] >= 100
    assert lengths[-1] < tasks.TASKS["chat-sums"].defaults["max_tokens"] - 50
    # the same seed, the same rows; another seed, others
    assert tasks.chat_sums_data(5, seed=0) == rows[:5] != tasks.chat_sums_data(5, seed=1)


def test_chat_sums_scores_1_only_where_every_total_and_the_answer_are_right():
    [row] = tasks.chat_sums_data(1, seed=3)
    right = row["solution"]
    assert tasks.chat_sums_reward(right, row) == 1.0
    last_total = row["totals"][-1]
    # the last step's total off by 10: the answer that follows it is wrong too
    wrong_step = right.replace(f"= {last_total}.", f"= {last_total + 10}.")
    assert wrong_step != right and 0 < tasks.chat_sums_reward(wrong_step, row) < 1
    # every total right, the answer not (one line more, or another number)
    assert tasks.chat_sums_reward(right + "\nAdd 1: 1 + 1 = 2.", row) < 1
    assert tasks.chat_sums_reward(right.rpartition(" ")[0] + " 7.", row) < 1
    assert tasks.chat_sums_reward("", row) == 0.0


def test_the_warm_start_on_chat_rows_trains_on_the_chat_templates_rendering(
    tok, model_path, tmp_path, monkeypatch
):
    """What train.warm_start teaches is the conversation as the server is sent it: the template's
    rendering of the row's messages, the assistant's turn opened, then the worked solution."""
    batches = []

    def make_batch(prompt_ids, completion_ids, pad_id):
        batches.append((prompt_ids, completion_ids))
        return real_make_batch(prompt_ids, completion_ids, pad_id)

    real_make_batch = train.make_batch
    monkeypatch.setattr(train, "make_batch", make_batch)
    cfg = train.Config(task="chat-sums", warm_start_steps=1)
    train.warm_start(model_path, str(tmp_path / "warm"), cfg)
    [(prompt_ids, completion_ids)] = batches
    rows = tasks.chat_sums_data(64, train.random.Random(cfg.seed).random())
    for row, prompt, completion in zip(rows, prompt_ids, completion_ids, strict=True):
        assert tok.decode(prompt) == tok.apply_chat_template(
            row["prompt"], tokenize=False, add_generation_prompt=True
        )
        assert tok.decode(prompt).endswith("assistant: ")
        assert tok.decode(completion) == row["solution"] + tok.eos_token
