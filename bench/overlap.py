"""GRPO step time of every schedule against the strongest synchronous one, on one machine.

    .venv/bin/python bench/overlap.py              # 48 prompts x 8 x <=32 tokens per step, N=4: G ~ T
    .venv/bin/python bench/overlap.py --steps 6 --num-layers 6    # a bigger model: T grows faster than G

Core 0 plays the inference GPU: servers are started pinned to it (their children inherit the affinity), with VLLM_CPU_OMP_THREADS_BIND=0.
Core 1 plays the training GPU: this process, one torch thread. `train.train` runs once per schedule
with the same Config except the schedule and `out`, each on the server settings it needs:
  sync-batch        the baseline: the whole step as one batch, then train; unthrottled server
  overlap           the default: the whole step submitted at once, micro-batches of prompts trained
                    on in the order their groups finish; unthrottled server
  overlap K=1       the same with --max-staleness 1: step s+1 generates while step s trains
  overlap-priority  N requests finishing in order on a server throttled to one micro-batch
                    (--max-num-seqs); the older schedule, kept for comparison
Each run first pushes the checkpoint's weights, so all start from one policy.

The workload: a Qwen2 from `engine.tiny_model` that is *not* warm-started, sampling at temperature 1
until its end-of-text token or `--max-tokens`, so completion lengths vary from prompt to prompt (a
long tail at the limit). The reward (last number == a+b) is rarely 1: the gradients are real but
noisy, which is all a timing benchmark needs.

Per schedule, medians over steps after the first `--warmup` of train.py's metrics.jsonl: G
(`gen_s`, the server's generation span), T (`train_s`), S (`sync_s`), idle, step, tokens.
The last lines are `overlap_speedup=<x> bound=<b> efficiency=<x/b>` (x = sync-batch step time over
overlap step time; b = (G+T+S) / (max(G,T) + min(G,T)/N + S) from the sync-batch run) and
`stale_speedup=<x> stale_bound=<(G+T+S) / (max(G,T) + S)>`. Then it draws `--out`/timeline.png: three
steps each of sync-batch, overlap and overlap K=1 on one time axis (train.draw_timeline), the README's figure.
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


def medians(history, warmup):
    """Per-step medians of G, T, S, idle, step, skipping the warm-up steps."""
    rows = history[warmup:]
    keys = {"G": "gen_s", "T": "train_s", "S": "sync_s", "idle": "idle_s", "step": "step_s", "tokens": "tokens"}
    return {k: statistics.median(r[v] for r in rows) for k, v in keys.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per schedule")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each schedule left out of the medians")
    p.add_argument("--hidden-size", type=int, default=256, help="hidden size of the tiny Qwen2 (bigger: T grows faster than G)")
    p.add_argument("--num-layers", type=int, default=4, help="layers of the tiny Qwen2")
    p.add_argument("--prompts-per-step", type=int, default=48, help="prompts per optimizer step")
    p.add_argument("--micro-batches", type=int, default=4, help="N: micro-batches per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="completion length limit")
    p.add_argument("--lr", type=float, default=1e-4, help="small, so the policy (and its completion lengths, i.e. the work per step) stays put")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-overlap"), help="folder for the runs and server.log")
    args = p.parse_args()

    torch.set_num_threads(1)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"  # the server's engine: its OpenMP threads on core 0
    model = tiny_model(path=f"{TINY_MODEL_DIR}-h{args.hidden_size}-l{args.num_layers}",
                       hidden_size=args.hidden_size, num_layers=args.num_layers)
    seqs = train.Config(model=model, prompts_per_step=args.prompts_per_step, micro_batches=args.micro_batches,
                        group_size=args.group_size).micro_batch_seqs  # overlap-priority: one micro-batch at a time
    runs = {"sync-batch": ("sync-batch", 0, ()), "overlap": ("overlap", 0, ()), "overlap K=1": ("overlap", 1, ()),
            "overlap-priority": ("overlap-priority", 0, ("--max-num-seqs", str(seqs)))}
    os.makedirs(args.out, exist_ok=True)
    results, histories = {}, {}
    for flags in sorted({f for _, _, f in runs.values()}):
        os.sched_setaffinity(0, {0})  # the server (a child process inherits this) on core 0
        proc, client = launch_server("--model", model, *flags, log_path=os.path.join(args.out, f"server{'-throttled' if flags else ''}.log"))
        os.sched_setaffinity(0, {1})  # this process is the trainer: core 1
        try:
            for name, (schedule, staleness, needs) in runs.items():
                if needs != flags:
                    continue
                cfg = train.Config(model=model, out=os.path.join(args.out, name.replace(" ", "-")), steps=args.steps, schedule=schedule,
                                   max_staleness=staleness, prompts_per_step=args.prompts_per_step,
                                   micro_batches=args.micro_batches, group_size=args.group_size, max_tokens=args.max_tokens,
                                   lr=args.lr)
                print(json.dumps(vars(cfg)), f"server flags: {' '.join(flags) or 'none'}", flush=True)
                histories[name] = train.train(cfg, client)
                results[name] = medians(histories[name], args.warmup)
        finally:
            stop_server(proc)

    N = args.micro_batches
    print(f"\nmedians over steps {args.warmup}..{args.steps - 1}, seconds per step (N={N}, {args.prompts_per_step} prompts x "
          f"{args.group_size} x <={args.max_tokens} tokens)")
    print(f"{'schedule':<17} {'G':>6} {'T':>6} {'S':>6} {'idle':>6} {'step':>6} {'tokens':>7}")
    for name in runs:
        m = results[name]
        print(f"{name:<17} " + " ".join(f"{m[k]:6.3f}" for k in ("G", "T", "S", "idle", "step")) + f" {m['tokens']:7.0f}")
    base = results["sync-batch"]
    G, T, S = base["G"], base["T"], base["S"]
    x, b = base["step"] / results["overlap"]["step"], train.overlap_bound(G, T, S, N, max_staleness=0)
    print(f"overlap_speedup={x:.3f} bound={b:.3f} efficiency={x / b:.3f}")
    print(f"stale_speedup={base['step'] / results['overlap K=1']['step']:.3f} "
          f"stale_bound={train.overlap_bound(G, T, S, N, max_staleness=1):.3f}")
    print(f"overlap_priority_speedup={base['step'] / results['overlap-priority']['step']:.3f}")
    draw_timelines(histories, results, N, os.path.join(args.out, "timeline.png"))


def draw_timelines(histories, results, N, path):
    """Three steps of sync-batch, overlap and overlap K=1 on one time axis, drawn by train.py's
    own draw_timeline from the runs' metrics, each titled with its medians and its bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["sync-batch", "overlap", "overlap K=1"]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 7), sharex=True)
    base = results["sync-batch"]
    for ax, name in zip(axes, names):
        train.draw_timeline(ax, histories[name], steps=3)
        m, K = results[name], 1 if "K=1" in name else 0
        bound = "" if name == "sync-batch" else \
            f"; bound {train.overlap_bound(base['G'], base['T'], base['S'], N, K):.2f}x, measured {base['step'] / m['step']:.2f}x"
        ax.set_title(f"{name}: step {m['step']:.2f} s (G {m['G']:.2f}, T {m['T']:.2f}, S {m['S']:.2f}){bound}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"timelines: {path}")


if __name__ == "__main__":
    main()
