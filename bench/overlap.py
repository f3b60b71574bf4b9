"""GRPO step time of every schedule and update mode against the strongest synchronous loop.

    # CPU: the tiny model, 48 prompts x 8 x <=64 tokens per step, N=4
    .venv/bin/python bench/overlap.py
    # two GPUs: the 0.5B shape, 64 prompts x 8 x <=256 tokens; one GPU: --device cuda
    python3 bench/overlap.py --device cuda:1

The workload is train.py's own, the longer of its GPU tasks: --task sums (add up 2-16 numbers,
writing each running total: completion lengths vary from prompt to prompt, 10-170 tokens; the
reward scores each total by how close it is, so it varies inside a group) on the built-in model of
--model-size (train.builtin_model: tiny on the CPU, Qwen2.5-0.5B's shape on GPUs), warm-started on
worked sums (cached in .cache/), sampled at temperature 1.

CPU (--device cpu, the default): core 0 plays the inference GPU: the server is started pinned to it
(its children inherit the affinity), with VLLM_CPU_OMP_THREADS_BIND=0. Core 1 plays the training
GPU: this process, one torch thread.
GPUs: no pinning. The server is started on GPU 0 (launch_server's default GPU) with --dtype
bfloat16, --max-num-seqs = the sequences of three steps (every step submitted at once: in-flight
K=2's three), --max-num-batched-tokens 2048 (the engine's own default, which every GPU parity run
so far scheduled at; the server now takes vllm serve's 8,192 on an H100 or H200) and
--gpu-memory-utilization 0.5 (--device cuda:1: this process trains on cuda:1 and pushes over NCCL)
or 0.4 (--device cuda: this process trains on cuda:0 beside the server and pushes over CUDA IPC),
compiled with CUDA graphs (no --enforce-eager). The trainer keeps fp32 master weights with bf16
autocast.
Either way `train.train` runs once per schedule on one server, with the same Config except these:
  sync-batch      the baseline: the whole step as one batch, then train
  overlap         K = 0: the whole step submitted at once, micro-batches of prompts trained on in
                  the order their groups finish; exactly on-policy
  drain K=1       --max-staleness 1: step s+1 generates while step s trains; each push waits for
                  the requests in flight to finish on the old weights (--update-mode drain)
  in-flight K=1   the same, but each push pauses the requests in flight and they go on with the
                  new weights (--update-mode in-flight): generation never waits for a push
  in-flight K=2   two steps ahead: bigger batches for the engine, tokens up to 2 versions old
Each run first pushes the checkpoint's weights, so all start from one policy; the learning rate is
small, so that the policy (and the work per step) stays put.

Per schedule, over the steps after the first `--warmup` of train.py's metrics.jsonl: the median of
G (`gen_s`, the server's generation span), T (`train_s`), S (`sync_s`, the push), idle (the trainer
waiting for samples), tokens, and the step with its min and max; the trainer-server mismatch (mean
|logprob difference| of the sampled tokens); then over those steps together: the engine's idle
seconds per step (the steps' span less the union of the spans in which some request of a
micro-batch was generating: a request paused by an in-flight update counts as generating) and
completion tokens per second. Each run's share of zero-advantage groups and gradient norms is
printed as it ends: a run that skipped more than half its groups, or had a zero gradient, stops
the benchmark there (exit 1), the next runs not started and no speed-up printed (bench/runs.py).
Then `G/T=` of the sync-batch run. The last lines are `<name>_speedup=<x>` for each schedule
(sync-batch's median step over its own), `bound=` (b = (G+T+S) / (max(G,T) + min(G,T)/N + S)
from sync-batch: on-policy overlap's best) and `stale_bound=` ((G+T+S) / (max(G,T) + S)). Then it
draws `--out`/timeline.png: three steps each of sync-batch, overlap, drain K=1 and in-flight K=1
on one time axis (plot.draw_timeline).
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from runs import refuse_hollow  # noqa: E402

import plot  # noqa: E402
import train  # noqa: E402
from client import Client  # noqa: E402
from local import SHAPES, launch_server, stop_server  # noqa: E402


def medians(history, warmup):
    """Per-step medians of G, T, S, idle, step (and its min and max), tokens and the mismatch,
    skipping the warm-up steps; the engine's idle seconds per step and tokens per second over
    those steps."""
    rows = history[warmup:]
    keys = {
        "G": "gen_s",
        "T": "train_s",
        "S": "sync_s",
        "idle": "idle_s",
        "step": "step_s",
        "tokens": "tokens",
    }
    result = {k: statistics.median(r[v] for r in rows) for k, v in keys.items()}
    # measured on the tokens of the current weights: a stale run's steps after its first have none
    mismatch = [r["mismatch_mean"] for r in history if r["mismatch_mean"] is not None]
    result["mismatch"] = statistics.median(mismatch) if mismatch else math.nan
    result["step_min"] = min(r["step_s"] for r in rows)
    result["step_max"] = max(r["step_s"] for r in rows)
    spans = [span for r in rows for k in ("gen", "train", "sync") for span in r["intervals"][k]]
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    busy, reached = 0.0, start
    for a, b in sorted(span for r in rows for span in r["intervals"]["gen"]):
        a, b = max(a, reached), min(b, end)
        busy, reached = busy + max(0.0, b - a), max(reached, b)
    result["engine_idle"] = (end - start - busy) / len(rows)
    result["tokens_per_s"] = sum(r["tokens"] for r in rows) / sum(r["step_s"] for r in rows)
    return result


# the defaults that depend on --device: (CPU, GPU)
DEFAULTS = {
    "model_size": ("tiny", "0.5b"),
    "prompts_per_step": (48, 64),
    "max_tokens": (64, 256),
    "lr": (1e-4, 1e-5),
}


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_device_flag(p)
    p.add_argument("--model-size", choices=list(SHAPES), help="default: tiny on CPU, 0.5b on GPUs")
    p.add_argument("--warm-start-steps", type=int, default=None, help="default: 100 CPU, 400 GPU")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per schedule")
    p.add_argument(
        "--warmup", type=int, default=2, help="first steps of each schedule left out of the medians"
    )
    p.add_argument("--prompts-per-step", type=int, help="default: 48 on CPU, 64 on GPUs")
    p.add_argument("--micro-batches", type=int, default=4, help="N: micro-batches per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, help="completion length limit (64 CPU, 256 GPU)")
    p.add_argument("--lr", type=float, help="default 1e-4 on CPU, 1e-5 on GPUs: small, see above")
    p.add_argument("--reward", default="", help="train.py's --reward (default: the task's)")
    p.add_argument("--runs", default=",".join(RUNS), help="the schedules to run, sync-batch first")
    p.add_argument("--server-url", default="", help="a running server on the model (default: one)")
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "runs", "bench-overlap"),
        help="folder for the runs and server.log",
    )
    args = p.parse_args()
    gpu = args.device != "cpu"
    for name, (on_cpu, on_gpu) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    args.warm_start_steps = args.warm_start_steps or (400 if gpu else 100)
    if args.runs.split(",")[0] != "sync-batch" or not set(args.runs.split(",")) <= set(RUNS):
        p.error(f"--runs: sync-batch first, then any of {', '.join(RUNS)}")

    workload = {"task": "sums", "model_size": args.model_size, "reward": args.reward}
    server_flags, trainer = device_setup(p, args)
    model = train.builtin_model(
        train.Config(**workload, **trainer, warm_start_steps=args.warm_start_steps)
    )
    print_setup(args.device, model)
    histories = run_schedules(args, model, server_flags, trainer | workload)
    report(args, histories)


def add_device_flag(p):
    """--device, the placement device_setup reads (bench/parity.py's too)."""
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "cuda:1"],
        default="cpu",
        help="cpu: server on core 0, trainer on core 1; cuda: both on GPU 0; "
        "cuda:1: server on GPU 0, trainer on GPU 1",
    )


def device_setup(p, args):
    """(the server's flags, the trainer's Config fields) for --device, as the docstring says."""
    if args.device == "cpu":
        torch.set_num_threads(1)
        # the server's engine: its OpenMP threads on core 0
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
        return (), {}
    # the server on GPU 0, the trainer on GPU 1 (or 0): no pinning
    if torch.cuda.device_count() < (2 if args.device == "cuda:1" else 1):
        p.error(f"--device {args.device}: {torch.cuda.device_count()} GPUs visible")
    # this process's CUDA work on the trainer's GPU
    torch.cuda.set_device(torch.device(args.device).index or 0)
    # unthrottled: every step submitted at once (in-flight K=2: three); a step schedules at most
    # 2,048 tokens, the engine's own default, as every GPU parity run so far (the server now takes
    # vllm serve's 8,192 on an H100 or H200): the seeds of one report ran alike
    share = "0.5" if args.device == "cuda:1" else "0.4"
    server_flags = (
        *("--dtype", "bfloat16", "--gpu-memory-utilization", share),
        *("--max-num-seqs", str(3 * args.prompts_per_step * args.group_size)),
        *("--max-num-batched-tokens", "2048"),
    )
    return server_flags, {"device": args.device, "dtype": "bfloat16", "bf16": True}


def print_setup(device, model):
    gpu = f" ({torch.cuda.get_device_name(device)})" if device != "cpu" else ""
    print(
        f"device {device}{gpu}; model: {model}, {parameters(model) / 1e6:.0f}M parameters",
        flush=True,
    )


@contextlib.contextmanager
def serving(args, model, server_flags):
    """A Client of --server-url, or of a server started on `model` (its log in --out) and stopped
    at the end; on the CPU that server runs on core 0, and this process then on core 1."""
    if args.server_url:
        yield Client(args.server_url)
        return
    cpu = args.device == "cpu"
    if cpu:
        # the server (a child process inherits this) on core 0
        os.sched_setaffinity(0, {0})
    log_path = os.path.join(args.out, "server.log")
    proc, client = launch_server("--model", model, *server_flags, log_path=log_path)
    if cpu:
        # this process is the trainer: core 1
        os.sched_setaffinity(0, {1})
    try:
        yield client
    finally:
        stop_server(proc)


# name: (--schedule, --max-staleness, --update-mode)
RUNS = {
    "sync-batch": ("sync-batch", 0, "drain"),
    "overlap": ("overlap", 0, "drain"),
    "drain K=1": ("overlap", 1, "drain"),
    "in-flight K=1": ("overlap", 1, "in-flight"),
    "in-flight K=2": ("overlap", 2, "in-flight"),
}


# the schedules drawn in timeline.png
TIMELINES = ["sync-batch", "overlap", "drain K=1", "in-flight K=1"]


def schedule_config(args, model, name, out, **fields):
    """train.Config of schedule `name` (RUNS') on `args`' workload (steps, prompts, group size,
    tokens, lr), from `model`'s weights into `out`; bench/parity.py's runs too."""
    schedule, staleness, update_mode = RUNS[name]
    return train.Config(
        model=model,
        out=out,
        steps=args.steps,
        schedule=schedule,
        max_staleness=staleness,
        update_mode=update_mode,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        lr=args.lr,
        # a benchmark's run is kept for its metrics: no checkpoint (GBs beyond the tiny model)
        checkpoint=False,
        **fields,
    )


def run_schedules(args, model, server_flags, trainer):
    """train.train once per schedule, all against one server; their metrics."""
    os.makedirs(args.out, exist_ok=True)
    histories = {}
    with serving(args, model, server_flags) as client:
        for name in args.runs.split(","):
            out = os.path.join(args.out, name.replace(" ", "-"))
            cfg = schedule_config(
                args, model, name, out, micro_batches=args.micro_batches, **trainer
            )
            print(json.dumps(vars(cfg)), flush=True)
            histories[name] = train.train(cfg, client)
            # no speed-up from a run that skipped its training: the next runs are not started
            refuse_hollow({name: histories[name][args.warmup :]})
    return histories


def report(args, histories):
    results = {name: medians(h, args.warmup) for name, h in histories.items()}
    N = args.micro_batches
    print(
        f"\nmedians over steps {args.warmup}..{args.steps - 1}, seconds per step "
        f"(N={N}, {args.prompts_per_step} prompts x {args.group_size} x <={args.max_tokens} tokens)"
    )
    columns = ("G", "T", "S", "idle", "step", "step_min", "step_max", "tokens", "mismatch")
    columns += ("engine_idle", "tokens_per_s")
    print(f"{'schedule':<14} " + " ".join(f"{c:>12}" for c in columns))
    for name, m in results.items():
        print(f"{name:<14} " + " ".join(f"{m[c]:12.3f}" for c in columns))
    base = results["sync-batch"]
    G, T, S = base["G"], base["T"], base["S"]
    print(f"G/T={G / T:.2f} (sync-batch: G={G:.3f} s, T={T:.3f} s, S={S:.3f} s per step)")
    print(
        f"bound={overlap_bound(G, T, S, N, max_staleness=0):.3f} "
        f"stale_bound={overlap_bound(G, T, S, N, max_staleness=1):.3f}"
    )
    for name, m in results.items():
        print(f"{name.replace(' ', '_').replace('=', '')}_speedup={base['step'] / m['step']:.3f}")
    if all(name in histories for name in TIMELINES):
        draw_timelines(histories, results, N, os.path.join(args.out, "timeline.png"))


def overlap_bound(gen_s, train_s, sync_s, N, max_staleness):
    """The best speed-up over generating and then training, for these times: on-policy, the
    overlap hides all but one of N micro-batches of the shorter phase; one step stale, all of it."""
    hidden = 0 if max_staleness else min(gen_s, train_s) / N
    return (gen_s + train_s + sync_s) / (max(gen_s, train_s) + hidden + sync_s)


def parameters(model):
    """Parameters of the checkpoint in folder `model` (the tied output layer counted once)."""
    from safetensors import safe_open

    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        # safe_open's handle has keys() but is not iterable itself
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def draw_timelines(histories, results, N, path):
    """Three steps of sync-batch, overlap, drain K=1 and in-flight K=1 on one time axis, drawn by
    plot.py's draw_timeline (train.py's plot) from the runs' metrics, each titled with its
    medians and its bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(TIMELINES), 1, figsize=(10, 9), sharex=True)
    base = results["sync-batch"]
    for ax, name in zip(axes, TIMELINES):
        plot.draw_timeline(ax, histories[name], steps=3)
        m, K = results[name], RUNS[name][1]
        if name == "sync-batch":
            bound = ""
        else:
            bound_x = overlap_bound(base["G"], base["T"], base["S"], N, K)
            bound = f"; bound {bound_x:.2f}x, measured {base['step'] / m['step']:.2f}x"
        ax.set_title(
            f"{name}: step {m['step']:.2f} s "
            f"(G {m['G']:.2f}, T {m['T']:.2f}, S {m['S']:.2f}){bound}",
            fontsize=10,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"timelines: {path}")


if __name__ == "__main__":
    main()
