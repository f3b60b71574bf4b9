"""Rewards of one's own, as `--reward tests.my_rewards:NAME` names them (the benchmarks' and the
training tests'), or `my_rewards:boxed` with tests/ on PYTHONPATH (the README's example)."""

import os
import re

# how many calls flaky() answers before it raises: a test sets it (or $FLAKY_CALLS)
calls_left = float(os.environ.get("FLAKY_CALLS", "inf"))


def zero(completion, row):
    """Every sample scores 0: no group has an advantage, and a run trains on nothing."""
    return 0.0


def half_where_odd(completion, row):
    """0.5 for a row whose answer is odd; None, does not apply, for the others."""
    return 0.5 if int(row["answer"]) % 2 else None


def two(completion, row):
    """2: out of [0, 1], refused."""
    return 2.0


def trl_correct(completions, answer, **kwargs):
    """TRL's form: a batch of completions (messages for a conversational prompt) and each column
    as a keyword, a list of rewards back."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    assert len(kwargs["prompts"]) == len(texts) == len(answer)
    return [float(text.strip() == str(a)) for text, a in zip(texts, answer)]


def boxed(completion, row):
    """1 if the completion's last \\boxed{...} holds the row's answer, else 0."""
    boxes = re.findall(r"\\boxed\{([^}]*)\}", completion)
    return float(bool(boxes) and boxes[-1].strip() == row["answer"])


def flaky(completion, row):
    """0 for `calls_left` calls, then a KeyError: a reward with a bug."""
    global calls_left
    calls_left -= 1
    if calls_left < 0:
        raise KeyError("solution")
    return 0.0
