"""GRPO pieces and short training runs through a real server.

Run: .venv/bin/python -m pytest tests/test_train.py
"""

import contextlib
import dataclasses
import fcntl
import importlib
import importlib.util
import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import types

import psutil
import pytest
import requests
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import plot
import tasks
import train
from client import ServerError
from conftest import needs_cuda, needs_two_gpus


def random_batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (n, 2), generator=g).tolist()
    prompts = [torch.randint(2, 90, (p,), generator=g).tolist() for p, _ in lengths]
    completions = [torch.randint(2, 90, (c,), generator=g).tolist() for _, c in lengths]
    return prompts, completions, torch.randn(n, generator=g)


def step_gradient(model, prompts, completions, advantages, micro_batches, loss_type="dapo"):
    """The trainer's recipe: summed losses per micro-batch, then one division by the step's
    loss_divisor (dapo: all tokens)."""
    model.zero_grad()
    size = len(prompts) // micro_batches
    for i in range(0, len(prompts), size):
        batch = train.make_batch(prompts[i : i + size], completions[i : i + size], pad_id=1)
        logprobs = train.token_logprobs(model, batch)
        on_policy = torch.zeros_like(logprobs, dtype=torch.bool)
        part = advantages[i : i + size]
        loss, _ = train.pg_loss(
            logprobs, logprobs.detach(), part, batch["mask"], on_policy, loss_type=loss_type
        )
        loss.backward()
    seqs = [
        types.SimpleNamespace(mask=[0] * len(p) + [1] * len(c))
        for p, c in zip(prompts, completions)
    ]
    divisor = train.loss_divisor(seqs, types.SimpleNamespace(loss_type=loss_type, max_tokens=8))
    return torch.cat([p.grad.flatten() / divisor for p in model.parameters()])


def test_micro_batches_give_the_gradient_of_one_batch(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompts, completions, advantages = random_batch(16, seed=0)
    one = step_gradient(model, prompts, completions, advantages, micro_batches=1)
    four = step_gradient(model, prompts, completions, advantages, micro_batches=4)
    assert one.abs().max() > 0
    assert torch.allclose(one, four, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_any_composition_of_micro_batches_gives_the_same_gradient(model_path, loss_type):
    """The overlap forms micro-batches in completion order: any permutation and split of the step's
    sequences must give the same summed gradient, whatever the --loss-type."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompts, completions, advantages = random_batch(16, seed=1)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(2)).tolist()
    one = step_gradient(model, prompts, completions, advantages, 1, loss_type)
    shuffled = step_gradient(
        model,
        [prompts[i] for i in order],
        [completions[i] for i in order],
        advantages[order],
        8,
        loss_type,
    )
    assert torch.allclose(one, shuffled, atol=1e-6, rtol=1e-4)


def full_log_softmax(model, batch, temperature):
    """The straightforward way: the whole batch's fp32 logits and one log_softmax over them."""
    logits = (
        model(input_ids=batch["input_ids"], attention_mask=batch["attention"])
        .logits[:, :-1]
        .float()
        / temperature
    )
    return torch.gather(torch.log_softmax(logits, -1), 2, batch["input_ids"][:, 1:, None]).squeeze(
        -1
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_their_gradient_are_one_log_softmax(model_path, temperature):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompts, completions, advantages = random_batch(6, seed=4)
    batch = train.make_batch(prompts, completions, pad_id=1)
    results = []
    # chunks straddle rows
    for logprobs in (
        lambda: full_log_softmax(model, batch, temperature),
        lambda: train.token_logprobs(model, batch, temperature, chunk_tokens=7),
    ):
        model.zero_grad()
        lp = logprobs()
        (lp * batch["mask"] * advantages[:, None]).sum().backward()
        results.append((lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (ref, ref_grad), (ours, our_grad) = results
    # at the completion tokens; prompt and padding need no logprob, and get 0
    completion = batch["mask"] > 0
    assert torch.allclose(ours[completion], ref[completion], atol=1e-5)
    assert (ours[~completion] == 0).all() and (~completion).any()
    assert (
        ref_grad.abs().max() > 0 and (our_grad - ref_grad).abs().max() < 1e-5 * ref_grad.abs().max()
    ), (our_grad - ref_grad).abs().max()


def seqs_of(prompts, completions):
    return [
        train.Sample(
            ids=p + c,
            mask=[0] * len(p) + [1] * len(c),
            logprobs=[None] * len(p) + [-1.0] * len(c),
            versions=[0] * len(p + c),
        )
        for p, c in zip(prompts, completions)
    ]


def trainer_gradient(model, seqs, advantages, **memory):
    """train.backward's summed gradient under the memory settings `memory`, per completion token."""
    model.zero_grad()
    cfg = train.Config(model="m", **memory)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    train.backward(model, seqs, advantages, 0, cfg, pad_id=1)
    tokens = train.loss_divisor(seqs, cfg)
    model.gradient_checkpointing_disable()
    return torch.cat([p.grad.flatten() / tokens for p in model.parameters()])


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
)
def test_train_micro_batch_and_checkpointing_change_memory_not_the_gradient(model_path, device):
    """On a GPU too: bf16 autocast and gradient checkpointing run CUDA kernels of their own."""
    model = train.load_model(model_path, device)
    prompts, completions, advantages = random_batch(12, seed=5)
    seqs = seqs_of(prompts, completions)
    whole = trainer_gradient(model, seqs, advantages)
    assert whole.abs().max() > 0
    for memory in (
        {"train_micro_batch": 5},
        {"train_micro_batch": 1},
        {"train_micro_tokens": 20},
        {"train_micro_tokens": 20, "train_micro_batch": 3},
        {"gradient_checkpointing": True},
    ):
        assert torch.allclose(
            trainer_gradient(model, seqs, advantages, **memory), whole, atol=1e-6, rtol=1e-4
        ), memory
    # close, not equal
    bf16 = trainer_gradient(model, seqs, advantages, bf16=True, train_micro_batch=4)
    assert not torch.equal(bf16, whole) and torch.cosine_similarity(bf16, whole, dim=0) > 0.99
    both = trainer_gradient(model, seqs, advantages, bf16=True, gradient_checkpointing=True)
    assert torch.cosine_similarity(both, whole, dim=0) > 0.99


def test_a_training_forward_builds_no_kv_cache(model_path):
    """load_model turns the KV cache off: a forward without gradient checkpointing would copy every
    layer's keys and values into one, and torch.compile would guard on each layer's slot of it."""
    model = train.load_model(model_path)
    assert model(input_ids=torch.tensor([[1, 2, 3]])).past_key_values is None


def test_a_token_budget_packs_longest_first_forwards_up_to_their_padded_size():
    """--train-micro-tokens: each forward pads to at most so many tokens, as many sequences as
    fit; a sequence longer than the budget runs alone; --train-micro-batch caps the count too."""
    lengths = [9, 3, 7, 7, 2, 30, 4, 4, 4, 1]
    seqs = seqs_of([[5] * n for n in lengths], [[6]] * len(lengths))
    advantages = torch.ones(len(seqs))

    def planned(**memory):
        plan = train.forwards(seqs, advantages, train.Config(model="m", **memory))
        return [[len(s.ids) for s in part] for part, _, _ in plan]

    assert planned(train_micro_tokens=20) == [[31], [10, 8], [8, 5], [5, 5, 4, 3], [2]]
    assert planned(train_micro_tokens=20, train_micro_batch=2) == [
        [31],
        [10, 8],
        [8, 5],
        [5, 5],
        [4, 3],
        [2],
    ]
    assert planned() == [sorted((n + 1 for n in lengths), reverse=True)]


def test_groups_with_equal_rewards_get_no_forward_and_leave_the_gradient_unchanged(model_path):
    """backward skips the samples of a group whose rewards are all equal (advantage 0), and the
    step's gradient, divided by all its completion tokens, is that of training on every sample."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompts, completions, _ = random_batch(12, seed=6)
    # three groups of 4: the first and the last have equal rewards (1/3 does not average exactly)
    rewards = torch.tensor([[1.0] * 4, [0.0, 1.0, 1.0, 0.5], [1 / 3] * 4])
    advantages = train.group_advantages(rewards).flatten()
    forwarded = []

    def count(module, args, kwargs, output):
        forwarded.append(len(kwargs["input_ids"]))

    hook = model.model.register_forward_hook(count, with_kwargs=True)
    skipping = trainer_gradient(model, seqs_of(prompts, completions), advantages)
    hook.remove()
    every_sample = step_gradient(model, prompts, completions, advantages, micro_batches=1)
    assert sum(forwarded) == 4
    assert every_sample.abs().max() > 0 and torch.allclose(skipping, every_sample, atol=1e-7)


def test_train_flops_count_the_tiny_models_matmuls_as_counted_by_hand(model_path):
    """6N + 12LHQT FLOPs a token for a forward and backward (PaLM's), N the decoder's matmul
    parameters counted from the tiny model's config; x4/3 where the forward is recomputed; the
    output layer (always recomputed) at the loss mask's tokens. backward_flops: backward's padded
    rows compute more than the sequences' own tokens."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    c = model.config
    H, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    kv = c.num_key_value_heads * H // c.num_attention_heads
    # per layer q and o (H x H), k and v (H x kv), gate, up and down (H x intermediate)
    n = L * (2 * H * H + 2 * H * kv + 3 * H * c.intermediate_size)
    assert n == 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256)
    decoder = sum(T * (6 * n + 12 * L * H * T) for T in (10, 7))
    head = 2 * H * V * 5
    assert train.train_flops(model, [10, 7], 5) == decoder + 4 * head
    assert train.train_flops(model, [10, 7], 5, recompute=True) == decoder * 4 / 3 + 4 * head
    assert train.train_flops(model, [10, 7], 5, grad=False) == decoder / 3 + head
    prompts, completions, advantages = random_batch(4, seed=1)
    seqs = seqs_of(prompts, completions)
    cfg = train.Config(model="m")
    tokens = train.loss_divisor(seqs, cfg)
    flops = train.backward_flops(model, seqs, advantages, cfg)
    lengths = [len(seq.ids) for seq in seqs]
    assert flops.tolist() == [
        train.train_flops(model, [max(lengths)] * 4, tokens),
        train.train_flops(model, lengths, tokens),
    ]
    assert flops[0] > flops[1]


def test_mismatch_kl_estimates_the_kl_of_server_and_trainer_from_server_samples():
    """k3 over tokens the server sampled: its mean is KL(server || trainer)."""
    g = torch.Generator().manual_seed(0)
    server = torch.randn(10, generator=g).log_softmax(0)
    trainer = (server + 0.3 * torch.randn(10, generator=g)).log_softmax(0)
    tokens = torch.multinomial(server.exp(), 200_000, replacement=True, generator=g)
    metrics = train.mismatch_metrics(trainer[tokens] - server[tokens])
    kl = (server.exp() * (server - trainer)).sum().item()
    assert metrics["mismatch_kl"] == pytest.approx(kl, rel=0.03)
    assert metrics["mismatch_max"] == pytest.approx((trainer - server).abs().max().item())


def test_a_mismatch_above_the_threshold_at_the_first_step_warns_naming_the_usual_causes(capsys):
    cfg = train.Config(model="m", mismatch_warning=0.05)
    row = {"step": 0, "truncated": 0.5, "tool_calls": 0, "tool_errors": 0}
    row |= train.mismatch_metrics(torch.tensor([0.2, -0.1]))
    train.warn(row, cfg, first=True)
    warning = capsys.readouterr().err
    assert all(cause in warning for cause in ("WARNING", "tokenizer", "dtype", "post-processing"))
    # a resumed run's first step warns too
    train.warn({**row, "step": 7}, cfg, first=True)
    assert "WARNING" in capsys.readouterr().err
    # below the threshold, or at a later step: silent
    train.warn({**row, **train.mismatch_metrics(torch.tensor([0.01, -0.02]))}, cfg, first=True)
    train.warn({**row, "step": 1}, cfg, first=False)
    assert capsys.readouterr().err == ""


def test_a_first_step_whose_completions_all_hit_max_tokens_warns_naming_the_flag(capsys):
    cfg = train.Config(model="m", max_tokens=4)
    row = {"step": 0, "truncated": 1.0, "mismatch_mean": 0.0, "tool_calls": 0, "tool_errors": 0}
    train.warn(row, cfg, first=True)
    assert "WARNING: every completion of step 0 hit --max-tokens 4" in capsys.readouterr().err
    # some completions end on their own, or a later step: silent
    train.warn({**row, "truncated": 0.9}, cfg, first=True)
    train.warn({**row, "step": 1}, cfg, first=False)
    assert capsys.readouterr().err == ""


def test_a_tokenizer_without_a_pad_token_pads_with_its_end_of_text(model_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = train.load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == tok.eos_token_id is not None
    batch = train.make_batch([[5, 6, 7], [5]], [[8], [9, 10]], loaded.pad_token_id)
    assert batch["input_ids"][1].tolist() == [5, 9, 10, tok.eos_token_id]


def test_a_step_whose_tool_calls_mostly_failed_warns_at_any_step(capsys):
    cfg = train.Config(model="m")
    row = {"step": 7, "truncated": 0.0, "mismatch_mean": 0.0, "tool_calls": 4, "tool_errors": 3}
    train.warn(row, cfg, first=False)
    assert "WARNING: 3 of the step's 4 tool calls failed" in capsys.readouterr().err
    # half of them, or none called: silent
    train.warn({**row, "tool_errors": 2}, cfg, first=False)
    train.warn({**row, "tool_calls": 0, "tool_errors": 0}, cfg, first=False)
    assert capsys.readouterr().err == ""


def test_torchrun_refuses_a_device_that_would_put_every_rank_on_one_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="--device cuda:1 under torchrun"):
        train.Config(model="m", device="cuda:1")
    assert train.Config(model="m", device="cuda").device == "cuda"


def test_torchrun_refuses_lora_in_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--resume and --lora-rank run in one process only"):
        train.Config(model="m", lora_rank=8)


def test_loss_mask_excludes_prompt_and_padding():
    batch = train.make_batch([[5, 6, 7], [5]], [[8, 9], [8, 9, 10]], pad_id=1)  # second row padded
    # targets are input_ids[:, 1:]; the mask is 1 exactly where the target is a completion token
    assert batch["mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]


def test_equal_rewards_give_zero_advantage_and_no_nan():
    rewards = torch.tensor([[1.0] * 8, [0.0] * 8, [0.0, 1.0] * 4])
    adv = train.group_advantages(rewards)
    assert not adv.isnan().any()
    assert adv[:2].abs().max() == 0
    assert adv[2].sum().abs() < 1e-5 and adv[2].abs().min() > 0.5


@pytest.mark.parametrize(
    # two sequences, advantages 1 and -1: -A log p sums to 6 over 3 tokens, and -4 over 1
    "loss_type, expected",
    [("dapo", (6 - 4) / 4), ("grpo", (6 / 3 - 4 / 1) / 2), ("dr_grpo", (6 - 4) / (2 * 5))],
)
def test_each_loss_type_divides_the_loss_as_trl_does(loss_type, expected):
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    on_policy = torch.zeros(2, 3, dtype=torch.bool)
    loss, _ = train.pg_loss(
        logprobs, logprobs, torch.tensor([1.0, -1.0]), mask, on_policy, 2.0, loss_type
    )
    # what backward counts: a prompt token, then the completion's (--max-tokens 5)
    seqs = [types.SimpleNamespace(mask=[0, 1, 1, 1]), types.SimpleNamespace(mask=[0, 1])]
    cfg = types.SimpleNamespace(loss_type=loss_type, max_tokens=5)
    assert loss / train.loss_divisor(seqs, cfg) == pytest.approx(expected)


def test_scale_rewards_divides_by_the_std_of_each_group_the_batch_or_nothing():
    rewards = torch.tensor([[0.0, 1.0], [2.0, 4.0], [1.0, 1.0]])
    # the stds: of the groups sqrt(1/2) and sqrt(2); of all six rewards sqrt(9.5 / 5)
    expected = {"group": [0.5 / 0.5**0.5, 1 / 2**0.5], "batch": [0.5 / 1.9**0.5, 1 / 1.9**0.5]}
    expected["none"] = [0.5, 1.0]
    for scale, (first, second) in expected.items():
        by_hand = torch.tensor([[-first, first], [-second, second], [0.0, 0.0]])
        assert torch.allclose(train.group_advantages(rewards, scale), by_hand, atol=1e-3), scale


def test_reward_reads_the_last_number():
    assert tasks.reward("7", "7") == 1.0 and tasks.reward("so 3+4 = 7", "7") == 1.0
    assert (
        tasks.reward("8", "7") == 0.0
        and tasks.reward("", "7") == 0.0
        and tasks.reward("7.5", "7") == 0.0
    )
    partial = [tasks.addition_reward(x, {"answer": "7"}) for x in ("7", "8", "5", "10", "")]
    assert partial == pytest.approx([1, 2 / 3, 1 / 3, 0, 0])


def test_math_reward_checks_boxed_fractions_and_latex_by_math_verify():
    assert tasks.math_reward("so \\boxed{\\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert tasks.math_reward("$\\frac{3}{4}$", {"answer": "3/4"}) == 1.0
    assert tasks.math_reward("\\boxed{\\frac{2}{3}}", {"answer": "3/4"}) == 0.0


def test_gsm8k_reward_reads_the_number_after_the_last_hashes():
    row = {"answer": "48 / 2 = 24 clips in May.\n#### 1,234"}
    assert tasks.gsm8k_reward("24 in May, so #### 1234", row) == 1.0
    assert tasks.gsm8k_reward("so 1,234", row) == 1.0
    assert tasks.gsm8k_reward("#### 24", row) == 0.0


def test_format_reward_matches_think_then_an_answer_or_the_rows_own_pattern():
    assert tasks.format_reward("<think>7 and\n5</think> 12", {}) == 1.0
    assert (
        tasks.format_reward("12", {}) == 0.0 and tasks.format_reward("<think>a</think>", {}) == 0.0
    )
    assert tasks.format_reward("ANSWER: 12", {"format_pattern": r"ANSWER: \d+"}) == 1.0


def test_several_rewards_add_by_weight_and_a_none_is_absent_not_zero():
    reward = "tasks:answer_reward,tests.my_rewards:half_where_odd"
    rewards = train.Rewards(train.Config(model="m", reward=reward, reward_weights="1,0.5"))
    assert rewards("so 3", {"prompt": "1+2=", "answer": "3"}) == {
        "reward": 1.25,
        "rewards": [1, 0.5],
    }
    scored = rewards("so 4", {"prompt": "2+2=", "answer": "4"})
    assert scored["reward"] == 1.0 and scored["rewards"][0] == 1.0
    assert math.isnan(scored["rewards"][1])
    # each function's mean over the samples it applies to
    metrics = train.reward_metrics(["right", "odd"], torch.tensor([[1.0, math.nan], [0.0, 0.5]]))
    assert metrics == {"reward/right": 0.5, "reward/odd": 0.5}


def test_each_reward_is_logged_beside_the_sum(
    server, model_path, tmp_path, restore_weights, capsys
):
    reward = "tests.my_rewards:zero,tests.my_rewards:half_where_odd"
    cfg = tiny_run(model_path, tmp_path, steps=2, reward=reward, reward_weights="1,2")
    history = train.train(cfg, server)
    for row in history:
        # half_where_odd's mean is over the rows with an odd answer: 0.5, never diluted by 0s
        assert row["reward/zero"] == 0.0 and row["reward/half_where_odd"] in (0.5, None)
        assert 0 <= row["reward"] <= 1
    logged = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["reward/zero"] for row in logged] == [0.0, 0.0]
    # TensorBoard's scalars
    assert plot.scalars(logged[0])["reward/zero"] == 0.0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert "reward/zero 0.00" in lines[0] and "reward/half_where_odd" in lines[0]


def test_the_sums_reward_scores_each_running_total_by_how_close_it_is():
    row = {"prompt": "Sum 12 7 30:", "answer": "49", "totals": [19, 49]}
    assert tasks.sums_reward(" 12+7=19 19+30=49", row) == 1.0
    # the second total 5 off
    assert tasks.sums_reward(" 12+7=19 19+30=54", row) == pytest.approx((1 + (1 - 5 / 49)) / 2)
    # a total not written scores 0, one off by its own value or more too
    assert tasks.sums_reward(" 12+7=19", row) == 0.5
    assert tasks.sums_reward(" 12+7=38 38+30=98", row) == 0.0
    assert tasks.sums_reward("", row) == 0.0


def test_sums_prompts_take_from_1_to_15_steps_so_completion_lengths_vary():
    rows = tasks.sums_data(1000, seed=0)
    steps = {len(r["totals"]) for r in rows}
    assert steps == set(range(1, 16))
    # every solution's last total is the answer, and the reward that grades it reads it back
    assert all(r["solution"].endswith("=" + r["answer"]) for r in rows)
    lengths = [len(r["solution"]) for r in rows]
    assert max(lengths) > 5 * min(lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["overlap", "sync-batch"])
def test_every_schedule_is_on_policy(server, model_path, tmp_path, restore_weights, schedule):
    v0 = server.health()["version"]
    cfg = train.Config(
        model=model_path,
        steps=3,
        prompts_per_step=8,
        micro_batches=4,
        group_size=4,
        out=str(tmp_path),
        schedule=schedule,
    )
    history = train.train(cfg, server)  # raises if any sample's version differs from the step's
    # v0 + 1: the trainer's initial push
    assert [h["version"] for h in history] == [v0 + 1, v0 + 2, v0 + 3]
    assert server.health()["version"] == v0 + 4
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["gen_s"] > 0 and r["train_s"] > 0 and r["sync_s"] > 0 for r in rows)
    # the same weights on both sides, float32: trainer and server agree on every sampled token
    atol = 1e-2 if torch.cuda.is_available() else 1e-4
    assert all(
        r["mismatch_kl"] >= 0 and r["mismatch_mean"] <= r["mismatch_max"] < atol for r in rows
    )
    assert all(0 <= r["frac_reward_zero_std"] <= 1 for r in rows)


def fingerprint(server, model_path, out, **settings):
    """8 seeded steps of `settings`' schedule into `out`: each step's prompts (their crc32), its
    rewards and the final parameters (from the checkpoint)."""
    cfg = train.Config(model=model_path, out=str(out), steps=8, prompts_per_step=8, group_size=4)
    cfg = dataclasses.replace(cfg, seed_requests=True, **settings)
    history = train.train(cfg, server)
    prompts = [h["prompts_crc32"] for h in history]
    rewards = [h["reward"] for h in history]
    return prompts, rewards, load_file(out / "checkpoint" / "model.safetensors")


def test_fingerprint_on_policy_overlap_and_sync_batch_take_the_same_prompts_rewards_weights(
    server, model_path, tmp_path, restore_weights
):
    """At --max-staleness 0 with --seed-requests both schedules sample one policy the same way: the
    same prompts at each step, the same rewards, the same weights after 8 updates. One step stale
    (K = 1) the steps take the same prompts, on older weights: rewards may differ."""
    sync = fingerprint(server, model_path, tmp_path / "sync", schedule="sync-batch")
    overlap = fingerprint(server, model_path, tmp_path / "overlap", schedule="overlap")
    stale = fingerprint(server, model_path, tmp_path / "stale", max_staleness=1)
    assert len(set(sync[0])) == 8
    assert overlap[0] == sync[0] and stale[0] == sync[0]
    assert overlap[1] == sync[1]
    start = load_file(os.path.join(model_path, "model.safetensors"))
    # training moved the weights, by much more than the tolerance
    assert max((sync[2][k] - start[k]).abs().max() for k in start) > 1e-3
    # Equal bit for bit where the groups finished in the order they were submitted (as in the
    # runs measured): the micro-batches and their gradients' sum are then sync-batch's. Another
    # order sums the same gradient in another order, and a weight whose gradient is near AdamW's
    # eps moves by what its last digits decide (up to 9.4e-6 in test_scale.py's two-rank test).
    assert max((overlap[2][k] - sync[2][k]).abs().max() for k in start) < 5e-5


@pytest.fixture(scope="module")
def train_py(model_path, tmp_path_factory):
    """`python train.py` for 3 steps one step stale, with a server it starts itself, given
    --server-args: 4 sequences decoded at a time, of up to 300 tokens, so that each push finds the
    next step's requests in flight longer than --drain-timeout, and their results wait longer than
    --result-ttl. The finished run (subprocess.CompletedProcess) and its --out."""
    out = tmp_path_factory.mktemp("train-py") / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = ["--model", model_path, "--steps", "3", "--max-staleness", "1", "--out", str(out)]
    flags += ["--prompts-per-step", "2", "--micro-batches", "2", "--group-size", "4"]
    flags += ["--max-tokens", "300"]
    server_args = "--max-model-len 400 --drain-timeout 0.2 --result-ttl 1 --max-num-seqs 4"
    flags += ["--server-args", server_args]
    run = subprocess.run(
        [sys.executable, os.path.join(root, "train.py"), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return run, out


def test_train_py_runs_end_to_end_and_stops_its_server(train_py):
    run, out = train_py
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(open(out / "metrics.jsonl").readlines()) == 3
    assert (out / "plot.png").stat().st_size > 10_000
    assert (out / "checkpoint" / "model.safetensors").exists()
    leftovers = [
        p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == []
    # gc.freeze()'s objects are freed again: libtriton reports none of its own as leaked
    assert "nanobind: leaked" not in run.stderr


def test_train_passes_server_args_to_the_server_it_starts(train_py):
    run, out = train_py
    assert run.returncode == 0, run.stderr[-3000:]
    assert "max_seq_len=400" in (out / "server0.log").read_text()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "device", [pytest.param("cuda", marks=needs_cuda), pytest.param("cuda:1", marks=needs_two_gpus)]
)
def test_train_py_trains_on_a_gpu(model_path, tmp_path, device):
    """The README's GPU commands for a few steps: `--device cuda` (the server train.py starts takes
    30% of GPU 0, the trainer the rest; weights over CUDA IPC) and `--device cuda:1` (the trainer on
    GPU 1; NCCL)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = ["--model", model_path, "--device", device, "--out", str(tmp_path)]
    flags += ["--steps", "3", "--prompts-per-step", "8"]
    # eager: compiling the server's model takes a GPU start from ~30 s to ~70 s; a KV cache of a
    # given size: vLLM then skips its memory profiling, which fails when another process (a
    # server stopping in the background) frees GPU memory meanwhile
    flags += ["--server-args", f"--enforce-eager --kv-cache-memory-bytes {1 << 30}"]
    run = subprocess.run(
        [sys.executable, os.path.join(root, "train.py"), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # one version per step (train.py checks every sample's), and the pushed weights are the
    # trainer's: a GPU server's float32 kernels and the trainer's differ by ~3e-3
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["mismatch_max"] < 1e-2 for r in rows)
    # an H200, H100 or A100 has its peak in train.PEAK_TFLOPS
    assert all(0 < r["mfu"] < 1 for r in rows)


@pytest.mark.gpu
def test_server_logprobs_are_the_trainers_at_the_sampling_temperature(server, model_path):
    """The server reports the logprobs of the distribution it sampled from (temperature applied);
    the trainer recomputes the same numbers on the same weights."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = ["3+4=", "hello"]
    results = server.generate(prompts, n=4, temperature=0.7, max_tokens=12, seed=5)
    prompt_ids = [tok(p).input_ids for p in prompts]
    completions = [c for r in results for c in r]
    batch = train.make_batch(
        [p for p in prompt_ids for _ in range(4)], [c.token_ids for c in completions], pad_id=1
    )
    with torch.no_grad():
        ours = train.token_logprobs(model, batch, temperature=0.7)
    # CPU fp32 on both sides agrees to 1e-4; a GPU server's fp32 kernels (TF32 matmuls, its
    # attention) differ from the CPU recomputation by ~3e-3 (measured on an H200)
    atol = 1e-2 if torch.cuda.is_available() else 1e-4
    for row, c in enumerate(completions):
        got = ours[row][batch["mask"][row] == 1]
        assert torch.allclose(got, torch.tensor(c.logprobs), atol=atol), (got, c.logprobs)
    with torch.no_grad():  # and not the untempered ones
        untempered = train.token_logprobs(model, batch)[0][batch["mask"][0] == 1]
    assert not torch.allclose(untempered, torch.tensor(completions[0].logprobs), atol=1e-2)


def test_with_no_stale_samples_the_loss_is_the_plain_policy_gradient():
    g = torch.Generator().manual_seed(3)
    logprobs, old = -torch.rand(4, 6, generator=g), -torch.rand(4, 6, generator=g)
    advantages, mask = torch.randn(4, generator=g), (torch.rand(4, 6, generator=g) > 0.3).float()
    loss, w = train.pg_loss(
        logprobs, old, advantages, mask, stale=torch.zeros(4, 6, dtype=torch.bool)
    )
    # exactly, bit for bit
    assert loss == -(advantages[:, None] * logprobs * mask).sum() and (w == 1).all()


def test_stale_tokens_get_truncated_importance_weights():
    logprobs = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -0.5], [-1.5, -0.5]])
    loss, w = train.pg_loss(
        logprobs,
        old,
        torch.ones(2),
        torch.ones(2, 2),
        # the second sample's first token came before an in-flight update, its second after
        stale=torch.tensor([[True, True], [True, False]]),
        is_cap=1.5,
    )
    # exp(0.5) capped at 1.5
    assert torch.allclose(
        w, torch.tensor([[1.5, torch.exp(torch.tensor(-1.5)).item()], [1.5, 1.0]])
    )
    loss.backward()
    # the weights are constants: no gradient flows through them
    assert torch.allclose(logprobs.grad, -w)


def test_a_request_with_min_version_waits_for_those_weights(server, model_path, restore_weights):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    server.init_communicator(transport="gloo")
    v0 = server.health()["version"]
    held = server.generate(["later"], max_tokens=4, min_version=v0 + 1, is_async=True)
    with pytest.raises(TimeoutError):
        server.get_future(held.request_id, timeout=1)
    # held before the engine, not generating
    assert server.health()["in_flight"] == 0
    assert server.update_model_params(model) == v0 + 1
    [[c]] = held.result(timeout=60)
    assert c.version == v0 + 1 and held.timing["started"] >= held.timing["queued"]
    server.close_communicator()


def test_a_request_an_update_overtakes_past_its_max_version_fails_and_generates_nothing(
    server, model_path, restore_weights
):
    """Held for the next version and bound to it (min_version = max_version), a request whose push
    lands as a later version (a Router's `version`) is refused at /get_future, never run."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    server.init_communicator(transport="gloo")
    v0 = server.health()["version"]
    bound = {"min_version": v0 + 1, "max_version": v0 + 1}
    held = server.generate(["later"], max_tokens=4, is_async=True, **bound)
    finished = requests.get(server.base_url + "/metrics", timeout=30).text
    assert server.update_model_params(model, version=v0 + 2) == v0 + 2
    with pytest.raises(ServerError, match=f"past max_version {v0 + 1}") as refused:
        held.result(timeout=60)
    assert refused.value.status == 422
    # the finished requests and the tokens generated, counted in /metrics, are as they were
    counted = re.compile(r"^asyncgrpo_(?:requests|completion_tokens)_total .*$", re.M)
    after = requests.get(server.base_url + "/metrics", timeout=30).text
    assert counted.findall(after) == counted.findall(finished) != []
    server.close_communicator()


def test_one_step_of_staleness_is_corrected_and_logged(
    server, model_path, tmp_path, restore_weights
):
    cfg = train.Config(
        model=model_path,
        steps=4,
        prompts_per_step=8,
        micro_batches=2,
        group_size=4,
        out=str(tmp_path),
        max_staleness=1,
    )
    history = train.train(cfg, server)  # raises if any sample is more than one version old
    # step 0 samples the initial push's weights
    assert [h["staleness"] for h in history] == [0, 1, 1, 1]
    assert all(h["is_weight_mean"] > 0 and h["is_weight_max"] <= cfg.is_cap for h in history)


def test_one_step_stale_runs_keep_staleness_one_and_one_version_per_step_through_long_drains(
    train_py,
):
    """Long drains (a push refused with 503 after --drain-timeout, and pushed again) and results
    kept past --result-ttl (keep_result) are neither a lost server nor a lost step."""
    run, out = train_py
    assert run.returncode == 0, run.stderr[-3000:]
    history = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [h["version"] for h in history] == [1, 2, 3]
    assert [h["staleness"] for h in history] == [0, 1, 1]


def test_in_flight_updates_keep_every_token_within_max_staleness(
    server, model_path, tmp_path, restore_weights
):
    cfg = train.Config(
        model=model_path,
        steps=5,
        prompts_per_step=8,
        micro_batches=2,
        group_size=4,
        max_tokens=64,
        out=str(tmp_path),
        max_staleness=2,
        update_mode="in-flight",
    )
    # raises if a token is more than 2 versions behind, or a push skips a version
    history = train.train(cfg, server)
    v1 = history[0]["version"]
    assert [h["version"] for h in history] == list(range(v1, v1 + 5))
    # steps 2.. were submitted two pushes before they trained: the bound is reached, and holds
    assert max(h["staleness_max"] for h in history) == 2


def test_pass_at_k_is_the_chance_that_k_of_n_samples_include_a_correct_one():
    from itertools import combinations

    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # every way to pick k of the n samples
                subsets = list(combinations([1] * c + [0] * (n - c), k))
                assert train.pass_at_k(n, c, k) == pytest.approx(
                    sum(map(any, subsets)) / len(subsets)
                ), (n, c, k)


def test_an_n16_evaluation_keeps_every_sample_with_its_prompt(server, tmp_path):
    prompts = ["1+1=", "hello", "What is 2*3?", "x", "42"]
    # each prompt's greedy answer
    alone = [server.generate([p], n=1, temperature=0.0, max_tokens=32)[0][0] for p in prompts]
    many = server.generate(prompts, n=16, temperature=1.0, max_tokens=32, seed=1)
    assert [len(group) for group in many] == [16] * len(prompts)
    assert all(
        c.text and c.token_ids for group in many for c in group if c.finish_reason == "length"
    )
    # exact grouping: greedy samples of each prompt are that prompt's own answer; each row's answer
    # is the last number its prompt's greedy answer wrote (rows whose answer wrote none cannot pass)
    numbers = [train.re.findall(r"-?\d+(?:\.\d+)?", c.text) for c in alone]
    rows = [
        {"prompt": p, "answer": ns[-1] if ns else "no number"} for p, ns in zip(prompts, numbers)
    ]
    cfg = train.Config(model="m", temperature=0.0, max_tokens=32, eval_n=16, out=str(tmp_path))
    result = train.evaluate(server, rows, cfg)
    expected = sum(bool(ns) for ns in numbers) / len(rows)
    assert (
        expected > 0
        and result["pass@1"] == pytest.approx(expected)
        and result["pass@16"] == pytest.approx(expected)
    )
    # someone else's answer
    shifted = [{**row, "answer": rows[(i + 1) % len(rows)]["answer"]} for i, row in enumerate(rows)]
    assert train.evaluate(server, shifted, cfg)["pass@16"] < expected


@pytest.mark.parametrize("task", ["calculator", "dataset"])
def test_eval_only_reports_pass_at_k_per_task(server, model_path, tmp_path, task):
    args = [
        "--eval-only",
        "--server-url",
        server.base_url,
        "--model",
        model_path,
        "--eval-n",
        "4",
        "--eval-prompts",
        "6",
        "--out",
        str(tmp_path),
    ]
    if task == "dataset":
        with open(tmp_path / "data.jsonl", "w") as f:
            for i in range(10):
                f.write(
                    json.dumps(
                        {
                            "prompt": f"{i}+0=",
                            "answer": str(i),
                            "task": "even" if i % 2 == 0 else "odd",
                        }
                    )
                    + "\n"
                )
        args += ["--dataset", str(tmp_path / "data.jsonl")]
    else:
        args += ["--task", "calculator", "--max-tokens", "8", "--max-turns", "2"]
    result = train.main(args)
    tasks = ["calculator"] if task == "calculator" else ["even", "odd"]
    # and the evaluation's seconds
    seconds = result.pop("seconds")
    assert seconds > 0
    assert set(result) == {
        f"{t}{name}@{k}"
        for t in ["", *(t + "/" for t in tasks)]
        for name in ("pass", "maj")
        for k in (1, 2, 4)
    }
    assert (
        all(0 <= v <= 1 for v in result.values())
        and result["pass@1"] <= result["pass@2"] <= result["pass@4"]
    )
    assert json.load(open(tmp_path / "eval.json")) == {
        "model": model_path,
        "version": server.health()["version"],
        "seconds": pytest.approx(seconds),
        **result,
    }


# -- watching a run: metrics, plot, TensorBoard, progress; evaluation's samples --------------------
@pytest.fixture
def default_sigint():
    """Ctrl-C raises KeyboardInterrupt here, whatever a test before it in this process left."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


INTERRUPTING = '''
import os, signal

import tasks


def interrupting(completion, row):
    """The addition reward; once the run has logged 5 steps, Ctrl-C: SIGINT to this process (its
    handler raises KeyboardInterrupt in the main thread, the one that scores)."""
    with open(os.path.join(OUT, "metrics.jsonl")) as f:
        if len(f.readlines()) >= 5:
            # the plot drawn every 3 steps (PLOT_EVERY, in the test) is there before the interrupt
            plot = os.path.join(OUT, "plot.png")
            with open(os.path.join(OUT, "plot-before.txt"), "w") as marker:
                marker.write(str(os.stat(plot).st_mtime_ns) if os.path.exists(plot) else "none")
            os.kill(os.getpid(), signal.SIGINT)
    return tasks.addition_reward(completion, row)
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A module `name` of tmp_path, from `text` with OUT (tmp_path / "run") defined in it."""

    def write(name, text):
        (tmp_path / f"{name}.py").write_text(f"OUT = {str(tmp_path / 'run')!r}\n{text}")
        monkeypatch.syspath_prepend(str(tmp_path))
        sys.modules.pop(name, None)
        return name

    return write


def test_a_run_stopped_by_sigint_leaves_its_metrics_events_and_plot(
    server,
    model_path,
    tmp_path,
    restore_weights,
    reward_module,
    capsys,
    monkeypatch,
    default_sigint,
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    monkeypatch.setattr(plot, "PLOT_EVERY", 3)
    cfg = train.Config(
        model=model_path,
        steps=100,
        prompts_per_step=4,
        micro_batches=2,
        group_size=4,
        eval_every=2,
        eval_prompts=4,
        eval_n=2,
        reward=reward_module("interrupting_reward", INTERRUPTING) + ":interrupting",
        out=str(out),
    )
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg, server)
    server.close_communicator()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["step"] for row in rows] == list(range(5))
    for row in rows:
        assert row["entropy"] > 0 and isinstance(row["loss"], float)
        assert 0 < row["completion_length"] <= row["completion_length_max"] <= cfg.max_tokens
        # a step with completions cut at --max-tokens has one that long
        assert 0 <= row["truncated"] <= 1
        assert row["truncated"] == 0 or row["completion_length_max"] == cfg.max_tokens
        # on-policy: no stale token, weight 1, none clipped
        assert (row["is_weight_mean"], row["is_weight_max"], row["is_clipped"]) == (1, 1, 0)
        # the training phase's speed (none where every group's rewards were equal: nothing
        # trained); no MFU on a CPU, whose peak is not known
        assert 0 <= row["tflops_useful"] <= row["tflops"] and row["mfu"] is None
        assert row["tflops_useful"] > 0 or row["frac_reward_zero_std"] == 1
    assert any(row["truncated"] > 0 for row in rows)
    # drawn after step 2, and again as the run stopped
    drawn_before = (out / "plot-before.txt").read_text()
    assert drawn_before != "none" and (out / "plot.png").stat().st_mtime_ns > int(drawn_before)
    # every number of every row, as TensorBoard itself reads the events
    events = EventAccumulator(str(out), size_guidance={"scalars": 0})
    events.Reload()
    for key in ("reward", "loss", "entropy", "truncated", "is_clipped", "grad_norm"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(row["step"], pytest.approx(row[key], rel=1e-6)) for row in rows], key
    # the held-out evaluations at steps 0, 2 and 4
    assert [e.step for e in events.Scalars("eval/pass@1")] == [0, 2, 4]
    assert [e.value for e in events.Scalars("eval/maj@2")] == [
        pytest.approx(row["eval"]["maj@2"]) for row in rows if "eval" in row
    ]
    samples = [json.loads(line) for line in open(out / "eval_samples.jsonl")]
    assert len(samples) == 3 * 4 * 2
    assert sorted({s["version"] for s in samples}) == [rows[s]["version"] for s in (0, 2, 4)]
    # stdout is no terminal here: a line per step, no bar
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 5 and "reward" in lines[0] and "accuracy" in lines[0]
    assert "step_s" in lines[0] and "tflops" in lines[0] and "mfu" not in lines[0]


def test_on_a_terminal_one_bar_shows_reward_accuracy_and_seconds_per_step(
    server, model_path, tmp_path, restore_weights, monkeypatch, capsys
):
    """stderr on a pseudo-terminal (a real tty device): tqdm's bar, for the steps and for the
    held-out evaluation, instead of lines."""
    master, terminal = os.openpty()
    # 24 rows of 160 columns: a terminal's size (a new pty's is 0 x 0, and tqdm draws nothing)
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))
    monkeypatch.setattr(sys, "stderr", open(terminal, "w"))
    cfg = train.Config(
        model=model_path,
        steps=3,
        prompts_per_step=4,
        micro_batches=2,
        group_size=4,
        eval_every=2,
        eval_prompts=4,
        eval_n=2,
        out=str(tmp_path),
    )
    train.train(cfg, server)
    sys.stderr.close()
    monkeypatch.undo()
    # what the run wrote to the terminal: small, within the pty's buffer
    os.set_blocking(master, False)
    shown = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(master, 65536):
            shown += chunk
    os.close(master)
    shown = shown.decode()
    assert "GRPO" in shown and "held-out" in shown and "3/3" in shown
    assert "reward=" in shown and "accuracy=" in shown and "step_s=" in shown
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


FIRST_CHARACTER = '''
def parity(completion, row):
    """1 where the completion's first character has an even code: answers that repeat (at a low
    temperature, one token) score alike."""
    return float(ord((completion or " ")[0]) % 2 == 0)
'''


def test_eval_only_scores_the_whole_file_saves_every_sample_and_its_pass_and_maj_at_k(
    server, model_path, tmp_path, restore_weights, reward_module, capsys
):
    data = tmp_path / "data.jsonl"
    rows = [
        {"prompt": f"{i}+{i}=", "answer": "0", "task": ["even", "odd"][i % 2]} for i in range(10)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--eval-only", "--server-url", server.base_url, "--model", model_path]
    args += ["--dataset", str(data), "--eval-n", "5", "--pass-k", "1,2,5", "--max-tokens", "1"]
    args += [
        "--temperature",
        "0.3",
        "--reward",
        reward_module("parity", FIRST_CHARACTER) + ":parity",
    ]
    args += ["--out", str(tmp_path / "run")]
    result = train.main(args)
    assert "held-out: 10 prompts x 5 samples" in capsys.readouterr().out
    samples = [json.loads(line) for line in open(tmp_path / "run" / "eval_samples.jsonl")]
    version = server.health()["version"]
    assert len(samples) == 50 and {s["version"] for s in samples} == {version}
    assert {s["prompt"] for s in samples} == {row["prompt"] for row in rows}
    assert all(s["correct"] == (s["reward"] >= 1.0) for s in samples)
    # pass@k and maj@k recomputed from the samples saved, per task and over all
    groups = {}
    for s in samples:
        groups.setdefault(s["prompt"], []).append(s)
    expected = {}
    for task in ("", "even/", "odd/"):
        chosen = [g for g in groups.values() if task in ("", g[0]["task"] + "/")]
        for k in (1, 2, 5):
            passes = []
            majorities = []
            for group in chosen:
                wrong = sum(not s["correct"] for s in group)
                passes.append(1 - math.comb(wrong, k) / math.comb(5, k))
                answers = [s["completion"].strip() for s in group[:k]]
                top = max(answers, key=lambda a: (answers.count(a), -answers.index(a)))
                majorities.append(group[answers.index(top)]["correct"])
            expected[f"{task}pass@{k}"] = sum(passes) / len(passes)
            expected[f"{task}maj@{k}"] = sum(majorities) / len(majorities)
    # and the evaluation's own seconds
    assert result.pop("seconds") > 0
    assert result == pytest.approx(expected)
    assert 0 < result["pass@1"] < 1
    # answers repeat within a prompt: the majority is no one sample's
    assert any(len({s["completion"] for s in g}) < 5 for g in groups.values())
    # seeded: the same samples again
    again = train.main(args)
    resampled = [json.loads(line) for line in open(tmp_path / "run" / "eval_samples.jsonl")]
    assert [s["completion"] for s in resampled] == [s["completion"] for s in samples]
    assert again.pop("seconds") > 0 and again == result


def test_pass_k_and_wandb_are_checked_when_given():
    with pytest.raises(ValueError, match="each k from 1 to --eval-n"):
        train.Config(model="m", pass_k="1,16", eval_n=8)
    with pytest.raises(ValueError, match="a list of k"):
        train.Config(model="m", pass_k="1, 4")
    assert train.pass_ks(train.Config(model="m", eval_n=10)) == [1, 2, 4, 8]
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ValueError, match="wandb is not installed"):
            train.Config(model="m", wandb="my-project")


def tiny_run(model_path, out, **settings):
    """A Config of a tiny run (4 prompts x 2 a step) on the built-in data, into `out`."""
    size = {"prompts_per_step": 4, "micro_batches": 2, "group_size": 2, "max_tokens": 4}
    return train.Config(model=model_path, out=str(out), **size | settings)


# -- conversational rows: prompts of messages, rendered by the chat template -----------------------
CHAT_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_template.jinja")


def chat_rows(count):
    return [
        {"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)}
        for i in range(count)
    ]


def rendered(model_path, messages):
    """`messages` as tests/chat_template.jinja renders them, the assistant's turn opened."""
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.chat_template = open(CHAT_TEMPLATE).read()
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_conversational_rows_are_sampled_after_exactly_the_chat_templates_tokens(
    server, model_path, tmp_path
):
    rows = chat_rows(3)
    cfg = tiny_run(model_path, tmp_path, chat_template=CHAT_TEMPLATE)
    samples = train.collect_each(
        train.submit_rollouts(server, rows, cfg, server.health()["version"])
    )
    tok = AutoTokenizer.from_pretrained(model_path)
    for row, group in zip(rows, samples):
        ids = tok.encode(rendered(model_path, row["prompt"]), add_special_tokens=False)
        assert [c.prompt_token_ids for c in group] == [ids, ids]
        # what the trainer scores: those tokens, then the sampled ones
        assert train.to_sample(row, group[0], train.Rewards(cfg)).ids[: len(ids)] == ids


def test_system_prompt_is_added_only_to_conversations_without_one(model_path, tmp_path):
    cfg = tiny_run(model_path, tmp_path, chat_template=CHAT_TEMPLATE, system_prompt="Add.")
    user = {"role": "user", "content": "1+1="}
    own = {"role": "system", "content": "Sum."}
    added = {"role": "system", "content": "Add."}
    for prompt, messages in [
        ([user], [added, user]),
        ([own, user], [own, user]),
        # a string prompt is the user's message
        ("1+1=", [added, user]),
    ]:
        assert train.rendered_prompt({"prompt": prompt}, cfg) == rendered(model_path, messages)


def test_conversational_rows_without_a_chat_template_are_refused_naming_chat_template(
    model_path, tmp_path
):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(model_path, name), folder / name)
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.chat_template = None
    tok.save_pretrained(folder)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in chat_rows(4)))
    # no server there: the refusal comes before any is reached
    args = ["--model", str(folder), "--dataset", str(data), "--server-url", "http://127.0.0.1:9"]
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--prompts-per-step", "4", "--out", str(tmp_path / "run")])
    assert "has no chat template" in str(e.value.code) and "--chat-template FILE" in str(
        e.value.code
    )


MESSAGES_REWARD = '''
def user_message(completion, row):
    """1 where the row the reward gets still holds its messages."""
    return float(row["prompt"][-1]["role"] == "user")
'''


def test_a_run_on_conversational_rows_keeps_each_eval_samples_prompt_as_the_model_saw_it(
    server, model_path, tmp_path, restore_weights, reward_module
):
    rows = chat_rows(12)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--server-url", server.base_url, "--model", model_path, "--dataset", str(data)]
    args += ["--chat-template", CHAT_TEMPLATE, "--steps", "2", "--prompts-per-step", "4"]
    args += ["--micro-batches", "2", "--group-size", "2", "--max-tokens", "4"]
    args += ["--eval-every", "2", "--eval-prompts", "2", "--eval-n", "2", "--no-checkpoint"]
    args += ["--reward", reward_module("messages", MESSAGES_REWARD) + ":user_message"]
    history = train.main(args + ["--out", str(tmp_path / "run")])
    assert [h["reward"] for h in history] == [1.0, 1.0]
    samples = [json.loads(line) for line in open(tmp_path / "run" / "eval_samples.jsonl")]
    # the first 2 rows are held out: evaluated at step 0 and at the end, 2 samples each
    expected = [rendered(model_path, row["prompt"]) for row in rows[:2]]
    assert [s["prompt"] for s in samples] == [p for p in expected for _ in range(2)] * 2
