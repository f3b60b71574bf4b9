"""The built-in tasks (train.py --task): each one's data, (n, seed) -> rows, and reward,
(completion, row) -> [0, 1], and the `TASKS` table that names them; and rewards for data of one's
own, named by --reward tasks:NAME (math_reward, gsm8k_reward, format_reward)."""

import functools
import itertools
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field


# -- the data --------------------------------------------------------------------------------------
def addition_data(n, seed, digits=5):
    """The built-in task: "3+4=" -> "7", with operands 0..digits-1."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(digits), rng.randrange(digits)) for _ in range(n)]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def calculator_data(n, seed):
    """The built-in tool task: multi-digit arithmetic, with the calculator tool on offer."""
    rng = random.Random(seed)
    qs = [f"{rng.randrange(10, 100)}*{rng.randrange(2, 10)}+{rng.randrange(100)}" for _ in range(n)]
    prompt = "What is {}? Call <tool>calc EXPRESSION</tool>, then answer.\n"
    return [{"prompt": prompt.format(q), "answer": str(eval(q))} for q in qs]


def power_data(n, seed):
    """The MCP tool task: a power of two digits, "7^5=" -> "16807", which the tiny model cannot
    compute but the `power` tool of examples/mcp_arith.py can (called with two arguments)."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(2, 10), rng.randrange(2, 10)) for _ in range(n)]
    call = '<tool>power {{"base":{},"exponent":{}}}</tool>'.format
    return [{"prompt": f"{b}^{e}=", "answer": str(b**e), "call": call(b, e)} for b, e in pairs]


def power_warm_data(n, seed):
    """The power task's warm start: the tool's call with the row's numbers or a guessed answer, at
    random (GRPO finds which pays), and after the tool's result, the result as the answer."""
    rng = random.Random(seed)
    turns = []
    for r in power_data(n, seed):
        first = rng.choice([r["call"], str(rng.randrange(10 ** rng.randrange(2, 9)))])
        answered = f"{r['prompt']}{r['call']}<result>{r['answer']}</result>"
        turns.append({"prompt": r["prompt"], "solution": first})
        turns.append({"prompt": answered, "solution": r["answer"]})
    return turns


def sums_data(n, seed, most=16):
    """The GPU workload's task: add up 2 to `most` numbers of 1-2 digits, writing the running total
    after each one: "Sum 12 7 30:" -> " 12+7=19 19+30=49". The number of steps varies from prompt
    to prompt, and so do the completions' lengths (10-170 tokens), as in real RL."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        terms = [rng.randrange(1, 100) for _ in range(rng.randint(2, most))]
        totals = list(itertools.accumulate(terms))
        steps = [f"{total}+{term}={total + term}" for total, term in zip(totals, terms[1:])]
        row = {"prompt": "Sum " + " ".join(map(str, terms)) + ":", "answer": str(totals[-1])}
        # what the reward checks, and what the warm start teaches
        rows.append(row | {"totals": totals[1:], "solution": " " + " ".join(steps)})
    return rows


def chat_sums_data(n, seed, most=12):
    """The long-completion task, as chat: add up 2 to `most` one-digit numbers, asked in a user
    message and worked out a line a step ("Add 9 to 10: 10 + 9 = 19."), then "The answer is N.".
    Its solutions run 50-320 of the built-in model's tokens, 181 at the median: chain-of-thought
    work whose length varies from prompt to prompt, where generation dominates a step."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        terms = [rng.randrange(1, 10) for _ in range(rng.randint(2, most))]
        totals = list(itertools.accumulate(terms))
        steps = [
            f"Add {term} to {total}: {total} + {term} = {total + term}."
            for total, term in zip(totals, terms[1:])
        ]
        lines = [f"Start at {terms[0]}.", *steps, f"The answer is {totals[-1]}."]
        question = "Add up " + " ".join(map(str, terms)) + ", one number at a time."
        row = {"prompt": [{"role": "user", "content": question}], "answer": str(totals[-1])}
        rows.append(row | {"totals": totals[1:], "solution": "\n".join(lines)})
    return rows


# -- the rewards -----------------------------------------------------------------------------------
def reward(completion: str, answer: str) -> float:
    """The default reward: 1 if the last number in the completion equals the answer, else 0."""
    return float(distance(completion, answer) == 0)


def addition_reward(completion: str, row: dict) -> float:
    """The built-in task's reward: an answer off by one earns 2/3 and off by two 1/3, a denser
    signal for the tiny model, which otherwise locks into its first lucky answers."""
    return max(0.0, 1 - distance(completion, row["answer"]) / 3)


def answer_reward(completion: str, row: dict) -> float:
    return reward(completion, row["answer"])


def sums_reward(completion: str, row: dict) -> float:
    """The sums task's reward: each running total the completion writes ("=19"), in order, scores
    1 if right and less the further off it is (0 from twice or nothing), one not written 0; the
    mean over the row's totals. 1 when every step, and so the answer, is right."""
    written = [int(number) for number in re.findall(r"=\s*(\d+)", completion)]
    scores = [max(0.0, 1 - abs(w - total) / total) for w, total in zip(written, row["totals"])]
    return sum(scores) / len(row["totals"])


def chat_sums_reward(completion: str, row: dict) -> float:
    """The chat-sums task's reward: half sums_reward's (each running total), half the answer's
    (the last number); 1, an exact answer, when every total and the answer are right."""
    return (sums_reward(completion, row) + answer_reward(completion, row)) / 2


def math_reward(completion: str, row: dict) -> float:
    """1 if the completion's answer (its last \\boxed{...}, else its last expression) equals the
    row's "answer" as math-verify reads both (fractions, LaTeX, ...), else 0."""
    # math-verify times out by signal.alarm: called from the main thread only (train.py's loop)
    from math_verify import parse, verify

    return float(verify(parse(str(row["answer"])), parse(completion)))


def gsm8k_reward(completion: str, row: dict) -> float:
    """1 if the completion's answer (the last number after its last "####", or in it if it has none)
    is the number after "####" in the row's GSM8K answer ("... #### 1,234"), else 0."""

    # the text after the last "####" (all of it where there is none), without thousands' commas
    def final(text):
        return str(text).split("####")[-1].replace(",", "")

    return reward(final(completion), final(row["answer"]))


# <think>, a reasoning, </think>, then an answer: what an R1-style prompt asks for
FORMAT_PATTERN = r"\s*<think>.*?</think>\s*\S.*"


def format_reward(completion: str, row: dict) -> float:
    """1 if the whole completion matches the row's "format_pattern" (a regular expression, `.`
    matching newlines too), or FORMAT_PATTERN where the row has none; else 0."""
    return float(bool(re.fullmatch(row.get("format_pattern") or FORMAT_PATTERN, completion, re.S)))


# 2-4 numbers, fewer steps to get right than sums': the GPU workload of bench/parity.py
short_sums_data = functools.partial(sums_data, most=4)


@dataclass(frozen=True)
class Task:
    """A built-in task (--task): its data, (n, seed) -> rows; its reward, (completion, row) -> [0,
    1]; the server tools its episodes call (none: one completion per sample); the rows the
    built-in model's warm start learns from; and train.py's flags where not given, {name: value}."""

    data: Callable
    reward: Callable
    tools: tuple = ()
    warm_start_data: Callable = addition_data
    defaults: dict = field(default_factory=dict)


TASKS = {
    "addition": Task(data=addition_data, reward=addition_reward),
    "calculator": Task(data=calculator_data, reward=answer_reward, tools=("calc",)),
    # the call, '<tool>power {"base":7,"exponent":5}</tool>', is 42 of the built-in model's tokens
    "power": Task(
        data=power_data,
        reward=answer_reward,
        tools=("power",),
        warm_start_data=power_warm_data,
        defaults={"max_tokens": 48, "max_turns": 2},
    ),
    "sums": Task(data=sums_data, reward=sums_reward, warm_start_data=sums_data),
    "short-sums": Task(data=short_sums_data, reward=sums_reward, warm_start_data=short_sums_data),
    # the longest solution is 314 tokens: room for a few more written by a model that strays
    "chat-sums": Task(
        data=chat_sums_data,
        reward=chat_sums_reward,
        warm_start_data=chat_sums_data,
        defaults={"max_tokens": 384},
    ),
}


def distance(completion, answer):
    """|the last number in the completion - the answer|, inf where there is none."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", completion)
    try:
        return abs(float(numbers[-1]) - float(answer)) if numbers else math.inf
    except ValueError:
        return math.inf
