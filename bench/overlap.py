"""GRPO step time with overlapped rollouts versus the two synchronous schedules, on one server.

    .venv/bin/python bench/overlap.py              # 48 prompts x 8 x <=32 tokens per step, N=4: G ~ T; ~4 min
    .venv/bin/python bench/overlap.py --steps 6 --num-layers 6    # a bigger model: T grows faster than G

Core 0 plays the inference GPU: the server runs under `taskset -c 0` with
VLLM_CPU_OMP_THREADS_BIND=0 (its worker's OpenMP threads: one, on core 0). Core 1 plays the
training GPU: this process, one torch thread. The server starts once; `train.train` then runs
three times against it with the same Config except `mode` (sync, sync-batch, overlap) and `out`.
Each run first pushes the checkpoint's weights into the server, so all three start from one policy.

The workload: a Qwen2 from `engine.tiny_model` that is *not* warm-started. The warm-started
addition model answers in ~2 tokens, so generation would be a sliver of the step; this one
samples up to `--max-tokens` characters at temperature 1, so generation G and training T are
comparable. The reward (last number == a+b) is rarely 1: the gradients are real but noisy,
which is all a timing benchmark needs.

Per mode, medians over steps after the first `--warmup` of train.py's metrics.jsonl:
  G     `gen_s`, generation: overlapped, until the last micro-batch landed; synchronous, the
        trainer's wait for every token
  T, S  `train_s` (forward/backward + optimizer step) and `sync_s` (weight update)
  idle  `idle_s`, the trainer waiting for rollouts;   step  `step_s`
  tokens  completion tokens per step: the three runs should do the same work (hence the small --lr)
The last line is `overlap_speedup=<x> bound=<b> efficiency=<x/b>`: x is the faster synchronous
step time over the overlap step time; b = (G+T+S) / (max(G,T) + min(G,T)/N + S) from that same
synchronous run's G, T, S, the best the overlap can do against it.
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import train  # noqa: E402
from client import launch_server, stop_server  # noqa: E402
from engine import TINY_MODEL_DIR, tiny_model  # noqa: E402

MODES = ["sync", "sync-batch", "overlap"]


def medians(history, warmup):
    """Per-step medians of G, T, S, idle, step, skipping the warm-up steps."""
    rows = history[warmup:]
    keys = {"G": "gen_s", "T": "train_s", "S": "sync_s", "idle": "idle_s", "step": "step_s", "tokens": "tokens"}
    return {k: statistics.median(r[v] for r in rows) for k, v in keys.items()}


def bound(m, N):
    G, T, S = m["G"], m["T"], m["S"]
    return (G + T + S) / (max(G, T) + min(G, T) / N + S)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each mode left out of the medians")
    p.add_argument("--hidden-size", type=int, default=256, help="hidden size of the tiny Qwen2 (bigger: T grows faster than G)")
    p.add_argument("--num-layers", type=int, default=4, help="layers of the tiny Qwen2")
    p.add_argument("--prompts-per-step", type=int, default=48, help="prompts per optimizer step")
    p.add_argument("--micro-batches", type=int, default=4, help="N: micro-batches per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="completion length limit")
    p.add_argument("--lr", type=float, default=1e-4, help="small, so the policy (and its completion lengths, i.e. the work per step) stays put")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-overlap"), help="folder for the runs and server.log")
    args = p.parse_args()

    os.sched_setaffinity(0, {1})  # this process is the trainer: core 1
    torch.set_num_threads(1)
    model = tiny_model(path=f"{TINY_MODEL_DIR}-h{args.hidden_size}-l{args.num_layers}",
                       hidden_size=args.hidden_size, num_layers=args.num_layers)
    seqs = args.prompts_per_step // args.micro_batches * args.group_size  # admission control: one micro-batch at a time
    os.makedirs(args.out, exist_ok=True)
    proc, client = launch_server("--model", model, "--max-num-seqs", str(seqs), prefix=("taskset", "-c", "0"),
                                 env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"},  # the engine's OpenMP threads: core 0
                                 log_path=os.path.join(args.out, "server.log"))
    results = {}
    try:
        for mode in MODES:
            cfg = train.Config(model=model, out=os.path.join(args.out, mode), steps=args.steps, mode=mode,
                               prompts_per_step=args.prompts_per_step, micro_batches=args.micro_batches,
                               group_size=args.group_size, max_tokens=args.max_tokens, lr=args.lr)
            print(json.dumps(vars(cfg)), flush=True)
            results[mode] = medians(train.train(cfg, client), args.warmup)
    finally:
        stop_server(proc)

    N = args.micro_batches
    print(f"\nmedians over steps {args.warmup}..{args.steps - 1}, seconds per step (N={N}, {seqs} sequences per micro-batch)")
    print(f"{'mode':<11} {'G':>6} {'T':>6} {'S':>6} {'idle':>6} {'step':>6} {'tokens':>7}")
    for mode, m in results.items():
        print(f"{mode:<11} " + " ".join(f"{m[k]:6.3f}" for k in ("G", "T", "S", "idle", "step")) + f" {m['tokens']:7.0f}")
    baseline = min(("sync", "sync-batch"), key=lambda mode: results[mode]["step"])  # the strongest synchronous loop
    x = results[baseline]["step"] / results["overlap"]["step"]
    b = bound(results[baseline], N)
    print(f"baseline: {baseline}")
    print(f"overlap_speedup={x:.3f} bound={b:.3f} efficiency={x / b:.3f}")


if __name__ == "__main__":
    main()
