"""Peak memory of one training micro-batch, the straightforward way and train.py's way.

    # GPU: Qwen2.5-0.5B shape, 64 sequences x 600 tokens
    python3 bench/trainer_memory.py --device cuda
    # CPU: 4 of its 24 layers, 8 sequences x 128 tokens
    .venv/bin/python bench/trainer_memory.py

Both sides compute the policy-gradient loss and its backward pass for the same sequences, on a
Qwen2 with random fp32 weights (the GPU default is Qwen2.5-0.5B's shape: 896 hidden, 24 layers,
151,936 vocabulary, tied), each in a fresh process, so neither sees the other's allocations:
  straightforward: every sequence in one forward/backward, the whole batch's fp32 logits and one
                   log_softmax over them, fp32 compute, every activation kept.
  train.py:        train.backward with --train-micro-batch, --bf16 and --gradient-checkpointing, and
                   token_logprobs' chunked output layer (2,048 tokens of logits at a time).
Peak memory counts everything the process holds: the fp32 weights and their gradients too (the same
on both sides). On a GPU it is torch.cuda.max_memory_allocated; on the CPU the peak resident set
size. A side that runs out of memory is reported as such (on the GPU its peak is then more than the
GPU holds, and the ratio an upper bound). Then train.py's way once more, with an AdamW step, for the
memory a whole optimizer step needs. The last line is `memory_ratio=<train.py / straightforward>`.
"""

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def straightforward(model, batch, advantages):
    logits = (
        model(input_ids=batch["input_ids"], attention_mask=batch["attention"])
        .logits[:, :-1]
        .float()
    )
    logprobs = torch.gather(
        torch.log_softmax(logits, -1), 2, batch["input_ids"][:, 1:, None]
    ).squeeze(-1)
    (-(advantages[:, None] * logprobs * batch["mask"].to(logprobs.device)).sum()).backward()


def measure(side, a):
    """Run one side in this process; return its peak memory and the memory held before it, in
    bytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import train

    device = torch.device(a.device)
    torch.manual_seed(0)
    config = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": a.layers})
    with device:
        model = Qwen2ForCausalLM(config)
    prompt = a.tokens // 6
    ids = torch.randint(0, config.vocab_size, (a.seqs, a.tokens)).tolist()
    seqs = [
        train.Sample(
            ids=row,
            mask=[0] * prompt + [1] * (a.tokens - prompt),
            logprobs=[None] * prompt + [-1.0] * (a.tokens - prompt),
            # every token sampled by the weights trained: version 0
            versions=[0] * a.tokens,
        )
        for row in ids
    ]
    advantages = torch.randn(a.seqs)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        # resident now
        resident_pages = int(open("/proc/self/statm").read().split()[1])
        before = resident_pages * os.sysconf("SC_PAGE_SIZE")
    if side == "straightforward":
        batch = train.make_batch([[]] * a.seqs, [s.ids for s in seqs], 0, [s.mask for s in seqs])
        straightforward(model, {k: v.to(device) for k, v in batch.items()}, advantages.to(device))
    else:
        cfg = train.Config(
            model="m", train_micro_batch=a.train_micro_batch, bf16=True, gradient_checkpointing=True
        )
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6) if side == "train.py+adamw" else None
        train.backward(model, seqs, advantages, 0, cfg, pad_id=0)
        if opt:
            opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), before
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, before  # Linux: KiB


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: 24 on cuda, 4 on cpu)"
    )
    p.add_argument(
        "--seqs",
        type=int,
        default=None,
        help="sequences in the micro-batch (default: 64 on cuda, 8 on cpu)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens per sequence (default: 600 on cuda, 128 on cpu)",
    )
    p.add_argument(
        "--train-micro-batch",
        type=int,
        default=None,
        help="train.py's sequences per forward/backward (default: seqs / 8)",
    )
    # internal: run one side, print its peak
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    gpu = a.device.startswith("cuda")
    a.layers, a.seqs, a.tokens = (
        a.layers or (24 if gpu else 4),
        a.seqs or (64 if gpu else 8),
        a.tokens or (600 if gpu else 128),
    )
    a.train_micro_batch = a.train_micro_batch or max(1, a.seqs // 8)
    if a.side:
        try:
            peak, before = measure(a.side, a)
            print(json.dumps({"peak": peak, "before": before}))
        except torch.OutOfMemoryError:
            print(json.dumps({"peak": None, "before": None}))
        return
    print(
        f"{a.layers} layers of Qwen2.5-0.5B's shape, fp32 weights, "
        f"{a.seqs} sequences x {a.tokens} tokens (5/6 of them completion), on {a.device}; "
        f"train.py: --train-micro-batch {a.train_micro_batch} --bf16 "
        f"--gradient-checkpointing, logits in chunks of 2048 tokens"
    )
    capacity = (
        torch.cuda.get_device_properties(0).total_memory
        if gpu
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    peaks = {}
    for side in ("straightforward", "train.py", "train.py+adamw"):
        argv = [
            sys.executable,
            __file__,
            "--device",
            a.device,
            "--layers",
            str(a.layers),
            "--seqs",
            str(a.seqs),
            "--tokens",
            str(a.tokens),
            "--train-micro-batch",
            str(a.train_micro_batch),
            "--side",
            side,
        ]
        run = subprocess.run(argv, capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"{side} failed:\n{run.stderr[-3000:]}")
        result = json.loads(run.stdout.strip().splitlines()[-1])
        peaks[side] = result["peak"]
        if result["peak"]:
            above = (result["peak"] - result["before"]) / 2**30
            shown = (
                f"{result['peak'] / 2**30:.2f} GiB (of which {above:.2f} GiB above "
                f"the weights and process held before it)"
            )
        else:
            shown = f"out of memory (> {capacity / 2**30:.0f} GiB)"
        print(f"{side:16s} peak {shown}", flush=True)
    old, new = peaks["straightforward"], peaks["train.py"]
    print(f"memory_ratio={new / old:.3f}" if old else f"memory_ratio<={new / capacity:.3f}")


if __name__ == "__main__":
    main()
