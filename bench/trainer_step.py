"""The trainer's own speed: one micro-batch's forward and backward, train.py's way against TRL's
recipe, on the same sequences and weights, alone and (--beside-server) beside an idle server.

    # GPU: Qwen2.5-0.5B's shape, 32 sequences shaped like bench/trl_gpu.py's micro-batches
    python3 bench/trainer_step.py --device cuda
    # the same with a server.py on the GPU, idle, as in bench/trl_gpu.py's layout of ours
    python3 bench/trainer_step.py --device cuda --beside-server
    # GPU: a user's step, 64 prompts x 8 of chat-sums up to 512 tokens: ours by a token budget,
    # TRL's in micro-batches of 32
    python3 bench/trainer_step.py --device cuda --task chat-sums --step 512 --max-tokens 512 \
        --micro-tokens 16384
    # CPU: the tiny model
    .venv/bin/python bench/trainer_step.py

The sequences: prompts of tasks.sums_data, each with 8 completions of its worked solution cut to
0.7-1.3 times its length (one in 20 at --max-tokens, as completions that run to the limit), so
lengths vary as in the sums workload. The weights: train.py's built-in model of --model-size,
untrained (the speed does not depend on them). Both sides in fp32 with bf16 autocast on a GPU,
gradient checkpointing unless --no-checkpointing, attention without cuDNN's kernel (train.load_model
turns it off for the process, as vLLM does in TRL's), the same advantages and the same loss:
  train.py  train.backward (right-padded sequences; the output layer at the completion tokens
            only, 2,048 at a time, each chunk recomputed in backward)
  TRL       GRPOTrainer's recipe before TRL 1.16, written out: prompts left-padded and
            completions right-padded, the model's forward with logits_to_keep = the longest
            completion + 1, log_softmax per sequence, the loss summed over completion tokens
  TRL's own where trl is installed (bench/requirements-trl.txt; 1.16.0 is what bench/trl_gpu.py
            runs): the same batch through trl's own fused output layer (add_fused_lm_head, a
            Triton kernel on GPUs), as GRPOTrainer computes its loss
With --step N, a whole step of N sequences: TRL's recipes in micro-batches of --seqs, their
gradients accumulating (GRPOTrainer's per-device batch), train.py's in its own forwards
(train.forwards: --seqs a forward, or --micro-tokens padded tokens, longest first), whose sizes
are printed.
First the two gradients are compared (more than 5% apart: exit 1). Printed: each side's
milliseconds per micro-batch, median (min-max) of --rounds after two warm-up rounds, the sides
alternating, each first in turn (with --vary, other sequences each round, so that each meets new
lengths as a run does); then `ours_vs_trl=<TRL ms / ours ms>` (above 1: ours is faster), and
`ours_vs_trl_own=` against TRL's own; and train.py's speed, medians of the rounds: `tflops=`
(the FLOPs computed, padding included, train.train_flops), `tflops_useful=` (the sequences' own)
and `mfu=` (tflops over --peak-tflops, else train.PEAK_TFLOPS's by the GPU's name; None on a
CPU). With --profile, one more round of each under torch.profiler:
CPU and GPU time, kernel launches, the costliest operators on the CPU and on the GPU.
With --compile, one more side, "compiled": train.py's, its layers' attention and MLP compiled
by torch.compile (compiled_side), checked for the same gradient and timed after the warm-up
rounds (which compile); then `compiled_vs_eager=<train.py ms / compiled ms>` and the graphs made.
With --pack, one more side, "packed": train.py's, its sequences packed into one row without
padding (bench/packing.py: torch's varlen_attn on a GPU), checked for the same gradient; then
`packed_vs_padded=<train.py ms / packed ms>`; with --compile too, "packed, compiled" and
`packed_compiled_vs_eager=`. Each side of ours prints its own `tflops= tflops_useful= mfu=`
(packed: every FLOP computed is useful).
"""

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import packing  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402
from local import SHAPES, TINY_MODEL_DIR, launch_server, stop_server, tiny_model  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-size", choices=list(SHAPES), help="default: 0.5b on a GPU, else tiny")
    p.add_argument("--seqs", type=int, default=32, help="sequences per micro-batch (8 per prompt)")
    p.add_argument(
        "--step",
        type=int,
        default=0,
        help="sequences of a whole step (8 per prompt), trained in micro-batches: TRL's of --seqs, "
        "ours of --seqs or, with --micro-tokens, by its token budget (0: one micro-batch)",
    )
    p.add_argument(
        "--micro-tokens",
        type=int,
        default=0,
        help="ours: train.py's --train-micro-tokens (padded tokens a forward, longest first)",
    )
    p.add_argument(
        "--task",
        choices=("sums", "chat-sums"),
        default="sums",
        help="whose worked solutions (chat-sums: prompts rendered by the chat template)",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="the longest completion")
    p.add_argument("--rounds", type=int, default=8, help="measured rounds per side")
    p.add_argument("--no-checkpointing", action="store_true", help="keep every activation")
    p.add_argument("--beside-server", action="store_true", help="a server.py on the model first")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="for MFU (default: by GPU name)")
    p.add_argument(
        "--vary", action="store_true", help="new sequences every round, as in a run: new lengths"
    )
    p.add_argument(
        "--profile", action="store_true", help="then profile one round of each (torch.profiler)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="one more side: train.py's, each layer's attention and MLP compiled by torch.compile",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="one more side: train.py's loss, the sequences packed into one row (varlen attention)",
    )
    return p.parse_args(argv)


def sequences(tok, cfg, n, max_tokens, seed=0):
    """(prompts, completions): token ids of n samples of `cfg.task`'s shape, 8 per prompt, each
    prompt as train.py renders it."""
    rng = random.Random(seed)
    prompts, completions = [], []
    for row in tasks.TASKS[cfg.task].data(n // 8, seed):
        prompt = train.rendered_prompt(row, cfg, tokenize=True)
        # a plain prompt comes back as its text
        prompt = tok(prompt).input_ids if isinstance(prompt, str) else prompt
        solution = tok(row["solution"]).input_ids
        for _ in range(8):
            length = round(len(solution) * rng.uniform(0.7, 1.3))
            length = max_tokens if rng.random() < 0.05 else min(max(length, 4), max_tokens)
            prompts.append(prompt)
            completions.append((solution * 4)[:length])
    return prompts, completions


def samples(prompts, completions):
    """train.Sample of each (prompt, completion), as sampled at version 0."""
    return [
        train.Sample(
            ids=p + c,
            mask=[0] * len(p) + [1] * len(c),
            logprobs=[None] * len(p) + [-1.0] * len(c),
            versions=[0] * len(p + c),
        )
        for p, c in zip(prompts, completions)
    ]


def ours(model, cfg, prompts, completions, advantages, pad_id):
    seqs = samples(prompts, completions)
    train.backward(model, seqs, advantages, 0, cfg, pad_id)
    # the FLOPs computed and useful
    return train.backward_flops(model, seqs, advantages, cfg)


def compiled_side(model, recipe=ours):
    """train.py's side with each decoder layer's attention and MLP compiled by torch.compile
    (regional compilation; sequence lengths dynamic, so that new lengths do not recompile), the
    same parameters; the eager modules are back in place after every call. Not the whole layer:
    transformers records its hidden states there with a ContextVar, where torch.compile breaks
    the graph and, under gradient checkpointing, falls back to running the layer eagerly."""
    parts = [(layer, name) for layer in model.model.layers for name in ("self_attn", "mlp")]
    eager = [getattr(layer, name) for layer, name in parts]
    compiled = [torch.compile(module, dynamic=True) for module in eager]

    def side(*args):
        for (layer, name), module in zip(parts, compiled):
            setattr(layer, name, module)
        try:
            return recipe(*args)
        finally:
            for (layer, name), module in zip(parts, eager):
                setattr(layer, name, module)

    return side


def packed(model, *args):
    """train.py's side, its sequences packed into one row without padding: packing.token_logprobs
    in train.token_logprobs' place (attention by torch's varlen_attn on a GPU)."""
    with packing.patched(model):
        computed, useful = ours(model, *args)
    # no padding: every FLOP computed is the sequences' own
    return torch.stack([useful, useful])


def trl_batch(model, prompts, completions, pad_id):
    """GRPOTrainer's layout: prompts left-padded, completions right-padded; (ids, attention,
    completion mask, longest completion)."""
    P, C = max(map(len, prompts)), max(map(len, completions))
    rows = [
        [pad_id] * (P - len(p)) + p + c + [pad_id] * (C - len(c))
        for p, c in zip(prompts, completions)
    ]
    attention = [
        [0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (C - len(c))
        for p, c in zip(prompts, completions)
    ]
    ids = torch.tensor(rows, device=model.device)
    attention = torch.tensor(attention, device=model.device)
    mask = torch.tensor(
        [[1.0] * len(c) + [0.0] * (C - len(c)) for c in completions], device=model.device
    )
    return ids, attention, mask, C


def trl_recipe(model, cfg, prompts, completions, advantages, pad_id):
    ids, attention, mask, C = trl_batch(model, prompts, completions, pad_id)
    with torch.autocast(model.device.type, torch.bfloat16, enabled=cfg.bf16):
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=C + 1).logits[:, :-1]
    targets = ids[:, -C:]
    logprobs = torch.stack(
        [
            row.float().log_softmax(-1).gather(-1, t[:, None]).squeeze(-1)
            for row, t in zip(logits, targets)
        ]
    )
    (-(logprobs * mask * advantages.to(model.device)[:, None]).sum()).backward()


def trl_own(model, cfg, prompts, completions, advantages, pad_id):
    """GRPOTrainer's own forward (TRL >= 1.16): the model patched by trl's add_fused_lm_head, whose
    output layer and log_softmax run in tiles of a Triton kernel on a GPU, called as
    GRPOTrainer._compute_loss calls it (with the entropy it logs)."""
    ids, attention, mask, C = trl_batch(model, prompts, completions, pad_id)
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :-C] = -100
    with torch.autocast(model.device.type, torch.bfloat16, enabled=cfg.bf16):
        out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    logprobs = out.log_probs[:, -C:]
    (-(logprobs * mask * advantages.to(model.device)[:, None]).sum()).backward()


def in_micro_batches(side, size):
    """`side` (a TRL recipe) on a step's sequences `size` at a time, its gradients accumulating:
    GRPOTrainer's per-device batch size."""

    def run(model, cfg, prompts, completions, advantages, pad_id):
        for i in range(0, len(prompts), size):
            part = slice(i, i + size)
            side(model, cfg, prompts[part], completions[part], advantages[part], pad_id)

    return run


def forward_sizes(prompts, completions, advantages, cfg):
    """The sequences in each of train.py's forwards of a step (train.forwards' plan)."""
    plan = train.forwards(samples(prompts, completions), advantages, cfg)
    return [len(part) for part, _, _ in plan]


def timed_ms(side, *args, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    out = side(*args)
    sync()
    return (time.perf_counter() - start) * 1000, out


def check_same_gradient(model, sides, args, tolerance=0.05):
    """Exit non-zero unless every side computes the gradient train.py's does (relative to its
    norm; bf16 autocast on a GPU rounds): each must do the work it is timed for. A lever (compiled,
    packed) that fails to run here is said and left out of `sides`, the rest still measured."""
    grads = {}
    for name, side in list(sides.items()):
        try:
            side(*args)
        except Exception as e:
            if name in ("train.py", "TRL"):
                raise
            print(f"{name} left out, it failed here: {type(e).__name__}: {str(e)[:300]}")
            del sides[name]
            model.zero_grad(set_to_none=True)
            continue
        grads[name] = torch.cat(
            [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        )
        model.zero_grad(set_to_none=True)
    ours, *others = grads.values()
    for name, theirs in zip(list(sides)[1:], others):
        gap = ((ours - theirs).norm() / theirs.norm()).item()
        label = "the two gradients" if name == "TRL" else f"the gradients of train.py and {name}"
        print(f"{label} differ by {gap:.1e} of their norm")
        if not gap < tolerance:
            sys.exit(f"the gradients of train.py and {name} differ: not the same loss")


def measure(a, path, size, device):
    """{side: [ms per micro-batch of each measured round]}, the sides alternating, and train.py's
    speed_metrics of each round."""
    tok = AutoTokenizer.from_pretrained(path)
    model = train.load_model(path, a.device)
    # a whole step: ours in --seqs' micro-batches or by the token budget
    micro = a.seqs if a.step and not a.micro_tokens else 0
    cfg = train.Config(
        model=path,
        device=a.device,
        bf16=device.type == "cuda",
        peak_tflops=a.peak_tflops,
        task=a.task,
        train_micro_batch=micro,
        train_micro_tokens=a.micro_tokens,
    )
    if not a.no_checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    n = a.step or a.seqs
    prompts, completions = sequences(tok, cfg, n, a.max_tokens)
    advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(0))
    lengths = sorted(map(len, completions))
    print(
        f"{size} model on {a.device}; {a.task}: {len(prompts)} sequences, completions of "
        f"{lengths[0]}-{lengths[-1]} tokens, {sum(map(len, prompts)) + sum(lengths)} in all"
    )
    if a.step:
        plan = forward_sizes(prompts, completions, advantages, cfg)
        budget = (
            f"up to {a.micro_tokens} padded tokens" if a.micro_tokens else f"{a.seqs} a forward"
        )
        print(f"a step: train.py's forwards ({budget}) of {plan} sequences; TRL's of {a.seqs}")
    sides = {"train.py": ours, "TRL": in_micro_batches(trl_recipe, a.seqs)}
    if importlib.util.find_spec("trl"):
        from trl.trainer.utils import add_fused_lm_head

        # only calls with fused_lm_head=True take the patched path: the other sides are unchanged
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        sides["TRL's own"] = in_micro_batches(trl_own, a.seqs)
    if a.compile:
        sides["compiled"] = compiled_side(model)
    if a.pack:
        sides["packed"] = packed
        if a.compile:
            sides["packed, compiled"] = compiled_side(model, packed)
    args = (model, cfg, prompts, completions, advantages, tok.pad_token_id)
    check_same_gradient(model, sides, args)
    times = {name: [] for name in sides}
    # the speed of each side of train.py's (those that return their FLOPs)
    speeds = {name: [] for name in sides}
    for i in range(a.rounds + 2):
        if a.vary:
            prompts, completions = sequences(tok, cfg, n, a.max_tokens, seed=i + 1)
            args = (model, cfg, prompts, completions, advantages, tok.pad_token_id)
        # each side first in turn: whichever runs first in a round follows another recipe's
        # allocations, and always the same side there would put the cost of it on that side
        names = list(sides)[i % len(sides) :] + list(sides)[: i % len(sides)]
        for name in names:
            ms, flops = timed_ms(sides[name], *args, device=device)
            model.zero_grad(set_to_none=True)
            if i >= 2:
                times[name].append(ms)
            if i >= 2 and flops is not None:
                speeds[name].append(train.speed_metrics(flops, ms / 1000, cfg))
    if a.profile:
        for name, side in sides.items():
            profile(name, side, args, device)
    return times, speeds


def profile(name, side, args, device):
    """One round of `side` under torch.profiler: its CPU and GPU time, kernel launches, and the
    operators that took the most CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    with profiler(activities=activities) as prof:
        timed_ms(side, *args, device=device)
    args[0].zero_grad(set_to_none=True)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx"))
    cpu_ms = sum(e.self_cpu_time_total for e in events) / 1000
    gpu_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1000
    print(f"profile {name}: CPU {cpu_ms:.1f} ms, GPU {gpu_ms:.1f} ms, {launches} kernel launches")
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    for e in top:
        print(f"  {e.key[:50]:50s} {e.self_cpu_time_total / 1000:7.1f} ms CPU in {e.count} calls")
    if device.type == "cuda":
        # the kernels (and copies) that took the most GPU time
        top = sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0))[:8]
        for e in top:
            ms = e.self_device_time_total / 1000
            print(f"  {e.key[:50]:50s} {ms:7.1f} ms GPU in {e.count} calls")


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    size = a.model_size or ("0.5b" if device.type == "cuda" else "tiny")
    path = tiny_model(TINY_MODEL_DIR + ("" if size == "tiny" else f"-{size}"), **SHAPES[size])
    server = None
    if a.beside_server:
        flags = ["--model", path]
        if device.type == "cuda":
            flags += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3"]
        server, client = launch_server(*flags)
        client.generate(["Sum 1 2:"], n=8, max_tokens=16)
        print("a server.py on the model, idle from now on", flush=True)
    try:
        times, speeds = measure(a, path, size, device)
    finally:
        if server:
            stop_server(server)
    for name, ms in times.items():
        print(f"{name:9s} {statistics.median(ms):8.1f} ms ({min(ms):.1f}-{max(ms):.1f})")
    # `name=<slower side's ms / faster side's ms>` for each pair of sides that ran
    for name, slower, faster in RATIOS:
        if slower in times and faster in times:
            ratio = statistics.median(times[slower]) / statistics.median(times[faster])
            print(f"{name}={ratio:.3f}")
    if "compiled" in times:
        # graphs torch.compile made: none would mean the compiled side ran eagerly
        from torch._dynamo.utils import counters

        print(f"compiled_graphs={counters['stats']['unique_graphs']}")
    # train.py's own, a line each: `tflops=`, `tflops_useful=`, `mfu=`; then each other side of
    # ours in one line
    for key in SPEED_KEYS:
        print(speed_text(key, [r[key] for r in speeds["train.py"]]))
    for name, rounds in speeds.items():
        if rounds and name != "train.py":
            values = (speed_text(key, [r[key] for r in rounds]) for key in SPEED_KEYS)
            print(f"{name}: {' '.join(values)}")


SPEED_KEYS = ("tflops", "tflops_useful", "mfu")
# the ratios printed: (name, the side divided, the side it is divided by)
RATIOS = (
    ("ours_vs_trl", "TRL", "train.py"),
    ("ours_vs_trl_own", "TRL's own", "train.py"),
    ("compiled_vs_eager", "train.py", "compiled"),
    ("packed_vs_padded", "train.py", "packed"),
    ("packed_compiled_vs_eager", "train.py", "packed, compiled"),
)


def speed_text(key, values):
    """`key=<median>`, or `key=None` (no MFU on a CPU, whose peak is not known)."""
    return f"{key}={statistics.median(values):.4g}" if None not in values else f"{key}=None"


if __name__ == "__main__":
    main()
