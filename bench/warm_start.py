"""How far a warm start takes the built-in model: held-out exact accuracy after every --every
supervised steps of train.warm_start, each milestone saved where train.builtin_model looks for it
(train.py or bench/parity.py with --warm-start-steps at a milestone then start from it).

    # CPU, seconds: the tiny model on addition
    .venv/bin/python bench/warm_start.py --steps 40 --every 20
    # one H200: the 0.5B shape on short-sums, stopping at the first milestone at 15% or more
    python3 bench/warm_start.py --device cuda --task short-sums --steps 3000 --every 250 \
        --stop-at 0.15
    # one H200: the 0.5B shape on chat-sums, measured by the worked solutions' probability (a
    # forward pass, not sampling: cheap at every milestone), stopping at 15% or after 240 s
    python3 bench/warm_start.py --device cuda --task chat-sums --steps 3000 --every 25 \
        --reference --stop-at 0.15 --stop-after 240

A parity workload (bench/parity.py) starts at 10-40% held-out exact accuracy: a model that never
answers exactly, or always does, shows no parity whatever the schedule. The held-out prompts are
train.py's (--eval-prompts of --task at --seed, none trained on by GRPO); the accuracy is
train.py's pass@1, 8 samples a prompt at temperature 1 with transformers' generate (vLLM samples
the same distribution), and greedy's beside it. The milestones are one run's prefixes: the first
W steps of a longer warm start are the W-step warm start's (the same seed, rows and optimizer),
so a milestone saved here is what train.builtin_model would build for W.
"""

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import tasks  # noqa: E402
import train  # noqa: E402
from local import SHAPES, save_model  # noqa: E402


class Stop(Exception):
    """Raised from the milestone callback once --stop-at is reached."""


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:k]")
    p.add_argument("--model-size", choices=list(SHAPES), help="default: tiny CPU, 0.5b GPU")
    p.add_argument("--task", choices=list(tasks.TASKS), default="addition")
    p.add_argument("--steps", type=int, default=40, help="supervised steps in all")
    p.add_argument("--every", type=int, default=20, help="steps between milestones")
    p.add_argument(
        "--stop-at", type=float, help="stop at the first milestone of this pass@1 or above"
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="measure each milestone by the probability of the held-out rows' worked solutions "
        "(one forward pass, no sampling; tasks whose rows have one) and --stop-at by it",
    )
    p.add_argument(
        "--stop-after", type=float, help="stop at the first milestone after this many seconds"
    )
    p.add_argument("--eval-prompts", type=int, help="held-out prompts (8 CPU, 128 GPU)")
    p.add_argument("--max-tokens", type=int, help="completion length limit (4 CPU, 64 GPU)")
    p.add_argument("--seed", type=int, default=0, help="train.py's --seed")
    args = p.parse_args()
    if not 1 <= args.every <= args.steps:
        p.error("--every must be at least 1 and at most --steps")
    gpu = args.device != "cpu"
    args.model_size = args.model_size or ("0.5b" if gpu else "tiny")
    args.max_tokens = args.max_tokens or (64 if gpu else 4)
    args.eval_prompts = args.eval_prompts or (128 if gpu else 8)
    return args


def main():
    args = parse_args()
    cfg = train.Config(
        task=args.task,
        model_size=args.model_size,
        device=args.device,
        bf16=args.device != "cpu",
        warm_start_steps=args.steps,
        seed=args.seed,
        eval_every=1,
        eval_prompts=args.eval_prompts,
        max_tokens=args.max_tokens,
    )
    base, final = train.builtin_folders(cfg)
    # the base model's chat template renders a conversational row's prompt, as in the warm start
    chat = dataclasses.replace(cfg, model=base)
    _, held_out = train.load_data(cfg)
    rewards = train.Rewards(cfg)
    start = time.time()

    def milestone(step, model, tok):
        if step % args.every and step < args.steps:
            return
        _, path = train.builtin_folders(dataclasses.replace(cfg, warm_start_steps=step))
        if args.reference:
            sampled = reference(model, tok, held_out, chat)
            measured = f"p_reference={sampled:.3f}"
        else:
            sampled, greedy = accuracy(model, tok, held_out, rewards, args.max_tokens, chat)
            measured = f"pass@1={sampled:.3f} greedy={greedy:.3f}"
        seconds = time.time() - start
        print(f"warm start {step}: {measured} ({seconds:.0f} s) {path}", flush=True)
        reached = args.stop_at is not None and sampled >= args.stop_at
        late = args.stop_after is not None and seconds >= args.stop_after
        stop = (reached or late) and step < args.steps
        # the milestone where it stops (with --stop-at or --stop-after: that one alone; 2 GB for
        # the 0.5B shape); the last step's model is saved once warm_start returns
        if step < args.steps and (stop or (args.stop_at is None and args.stop_after is None)):
            save_model(model, tok, path)
        if stop:
            raise Stop

    if os.path.exists(final):
        sys.exit(f"{final} is built already: remove it to measure its warm start again")
    try:
        train.warm_start(base, final, cfg, each=milestone)
    except Stop:
        print("stopped: --stop-at reached or --stop-after passed")


@torch.no_grad()
def reference(model, tok, rows, chat):
    """The mean over `rows` of the probability that a sample at temperature 1 writes the row's
    worked "solution" token for token: pass@1 where that solution is the only exact answer.
    `chat`: train.Config with the base model, whose chat template renders the prompts."""
    batch = train.warm_start_batch(rows, [row["solution"] for row in rows], tok, chat)
    with torch.autocast(model.device.type, torch.bfloat16, enabled=model.device.type != "cpu"):
        logprobs = train.token_logprobs(model, batch)
    return (logprobs * batch["mask"].to(logprobs.device)).sum(1).float().exp().mean().item()


@torch.no_grad()
def accuracy(model, tok, rows, rewards, max_tokens, chat, n=8):
    """(pass@1 of n samples at temperature 1, greedy's exact accuracy) on `rows`, their prompts
    rendered as `reference`'s."""
    model.eval()
    prompts = [train.rendered_prompt(row, chat) for row in rows]
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True).to(model.device)
    settings = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "max_new_tokens": max_tokens,
        "pad_token_id": tok.pad_token_id,
    }
    with torch.autocast(model.device.type, torch.bfloat16, enabled=model.device.type != "cpu"):
        # sampling takes the global generator's numbers: forked, so that the steps after this
        # milestone are those of a warm start that stopped at none
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            sampled = model.generate(
                **settings,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                num_return_sequences=n,
            )
        greedy = model.generate(**settings, do_sample=False)
    model.train()
    width = batch.input_ids.shape[1]
    texts = tok.batch_decode(sampled[:, width:], skip_special_tokens=True)
    rights = [rewards(text, rows[i // n])["reward"] == 1 for i, text in enumerate(texts)]
    greedy_texts = tok.batch_decode(greedy[:, width:], skip_special_tokens=True)
    greedy_rights = [rewards(t, row)["reward"] == 1 for t, row in zip(greedy_texts, rows)]
    return sum(rights) / len(rights), sum(greedy_rights) / len(greedy_rights)


if __name__ == "__main__":
    main()
