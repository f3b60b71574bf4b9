"""GRPO step time of every schedule and update mode against the strongest synchronous loop.

    # 48 prompts x 8 x <=32 tokens per step, N=4: G ~ T
    .venv/bin/python bench/overlap.py
    # a bigger model: T grows faster than G
    .venv/bin/python bench/overlap.py --steps 6 --num-layers 6
    # two GPUs: 64 prompts x 8 x <=128 tokens, ~1.06B params; one GPU: --device cuda
    python3 bench/overlap.py --device cuda:1 --dtype bfloat16

CPU (--device cpu, the default): core 0 plays the inference GPU: the server is started pinned to it
(its children inherit the affinity), with VLLM_CPU_OMP_THREADS_BIND=0. Core 1 plays the training
GPU: this process, one torch thread.
GPUs: no pinning. The server is started on GPU 0 (launch_server's default GPU) with --dtype DTYPE,
--max-num-seqs = the sequences of K+1 steps (vLLM's default there is 128 at a time) and
--gpu-memory-utilization 0.5 (--device cuda:1: this process trains on cuda:1 and pushes over NCCL)
or 0.4 (--device cuda: this process trains on cuda:0 beside the server and pushes over CUDA IPC),
compiled with CUDA graphs (no --enforce-eager). The trainer keeps fp32 master weights with bf16
autocast. The model is bigger than on CPU (by default hidden 2048 x 28 layers, 32 heads of 64, 16
KV heads: ~1.06B parameters, random weights in --dtype) and so is the step (64 prompts x 8 x <=128
tokens), so that generation (G) and training (T) take times of one order per step; the `G/T=` line
shows how close they came: --num-layers, --hidden-size or --max-tokens move them.
Either way `train.train` runs once per schedule on one server, with the same Config except these:
  sync-batch      the baseline: the whole step as one batch, then train
  overlap         K = 0: the whole step submitted at once, micro-batches of prompts trained on in
                  the order their groups finish; exactly on-policy
  drain K=1       --max-staleness 1: step s+1 generates while step s trains; each push waits for
                  the requests in flight to finish on the old weights (--update-mode drain)
  in-flight K=1   the same, but each push pauses the requests in flight and they go on with the
                  new weights (--update-mode in-flight): generation never waits for a push
  in-flight K=2   two steps ahead: bigger batches for the engine, tokens up to 2 versions old
Each run first pushes the checkpoint's weights, so all start from one policy.

The workload: a Qwen2 from `client.tiny_model` that is *not* warm-started, sampling at temperature 1
until its end-of-text token or `--max-tokens`, so completion lengths vary from prompt to prompt (a
long tail at the limit). The reward (last number == a+b) is rarely 1: the gradients are real but
noisy, which is all a timing benchmark needs.

Per schedule, medians over steps after the first `--warmup` of train.py's metrics.jsonl: G
(`gen_s`, the server's generation span), T (`train_s`), S (`sync_s`, the push), idle (the trainer
waiting for samples), step, tokens; then over those steps together: the engine's idle seconds per
step (the steps' span less the union of the spans in which some request of a micro-batch was
generating: a request paused by an in-flight update counts as generating) and completion tokens per
second. Then `G/T=` of the sync-batch run. The last lines are `<name>_speedup=<x>` for each
schedule (sync-batch's step time over its own), `bound=` (b = (G+T+S) / (max(G,T) + min(G,T)/N +
S) from sync-batch: on-policy overlap's best) and `stale_bound=` ((G+T+S) / (max(G,T) + S)). Then
it draws `--out`/timeline.png: three steps each of sync-batch, overlap, drain K=1 and in-flight
K=1 on one time axis (train.draw_timeline).
"""

import argparse
import json
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import train  # noqa: E402
from client import TINY_MODEL_DIR, launch_server, stop_server, tiny_model  # noqa: E402


def medians(history, warmup):
    """Per-step medians of G, T, S, idle, step, tokens, skipping the warm-up steps; the engine's
    idle seconds per step and tokens per second over those steps."""
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
    "hidden_size": (256, 2048),
    "num_layers": (4, 28),
    "prompts_per_step": (48, 64),
    "max_tokens": (32, 128),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "cuda:1"],
        default="cpu",
        help="cpu: server on core 0, trainer on core 1; cuda: both on GPU 0; "
        "cuda:1: server on GPU 0, trainer on GPU 1 (see above)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the model's and the server's weight dtype (the trainer keeps fp32 master weights)",
    )
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per schedule")
    p.add_argument(
        "--warmup", type=int, default=2, help="first steps of each schedule left out of the medians"
    )
    p.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="hidden size of the tiny Qwen2 "
        "(bigger: T grows faster than G; default 256 on CPU, 2048 on GPUs)",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="layers of the tiny Qwen2 (default 4 on CPU, 28 on GPUs)",
    )
    p.add_argument(
        "--prompts-per-step",
        type=int,
        default=None,
        help="prompts per optimizer step (default 48 on CPU, 64 on GPUs)",
    )
    p.add_argument("--micro-batches", type=int, default=4, help="N: micro-batches per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="completion length limit (default 32 on CPU, 128 on GPUs)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=1e-4,
        help="small, so the policy (and its completion lengths, i.e. the work per step) stays put",
    )
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

    h, layers = args.hidden_size, args.num_layers
    if gpu:  # the server on GPU 0, the trainer on GPU 1 (or 0): no pinning
        if torch.cuda.device_count() < (2 if args.device == "cuda:1" else 1):
            p.error(f"--device {args.device}: {torch.cuda.device_count()} GPUs visible")
        torch.cuda.set_device(args.device)  # this process's CUDA work on the trainer's GPU
        # heads of 64 (tiny_model's default is 32):
        # a head size every GPU attention backend has kernels for
        model = tiny_model(
            path=f"{TINY_MODEL_DIR}-h{h}-l{layers}-{args.dtype}-hd64",
            hidden_size=h,
            num_layers=layers,
            dtype=args.dtype,
            num_attention_heads=max(1, h // 64),
            num_key_value_heads=max(1, h // 128),
            head_dim=64,
        )
        # vLLM's default admits 128 sequences at a time here; unthrottled means every step
        # submitted at once (in-flight K=2: three)
        share = "0.5" if args.device == "cuda:1" else "0.4"
        server_flags = (
            *("--dtype", args.dtype, "--gpu-memory-utilization", share),
            *("--max-num-seqs", str(3 * args.prompts_per_step * args.group_size)),
        )
        trainer = {"device": args.device, "dtype": args.dtype, "bf16": True}
        print(
            f"GPUs: cuda:0 {torch.cuda.get_device_name(0)} (the server), "
            f"{args.device} {torch.cuda.get_device_name(args.device)} (the trainer); "
            f"model: {model}, {parameters(model) / 1e6:.0f}M parameters, {args.dtype}",
            flush=True,
        )
    else:
        torch.set_num_threads(1)
        # the server's engine: its OpenMP threads on core 0
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
        model = tiny_model(
            path=f"{TINY_MODEL_DIR}-h{h}-l{layers}"
            + ("" if args.dtype == "float32" else f"-{args.dtype}"),
            hidden_size=h,
            num_layers=layers,
            dtype=args.dtype,
        )
        # the server's default is float32
        server_flags = () if args.dtype == "float32" else ("--dtype", args.dtype)
        trainer = {"dtype": args.dtype}
    histories = run_schedules(args, model, server_flags, trainer, gpu)
    report(args, histories)


# name: (--schedule, --max-staleness, --update-mode)
RUNS = {
    "sync-batch": ("sync-batch", 0, "drain"),
    "overlap": ("overlap", 0, "drain"),
    "drain K=1": ("overlap", 1, "drain"),
    "in-flight K=1": ("overlap", 1, "in-flight"),
    "in-flight K=2": ("overlap", 2, "in-flight"),
}


def run_schedules(args, model, server_flags, trainer, gpu):
    """train.train once per schedule, all against one server; their metrics."""
    os.makedirs(args.out, exist_ok=True)
    if not gpu:
        os.sched_setaffinity(0, {0})  # the server (a child process inherits this) on core 0
    proc, client = launch_server(
        "--model", model, *server_flags, log_path=os.path.join(args.out, "server.log")
    )
    if not gpu:
        os.sched_setaffinity(0, {1})  # this process is the trainer: core 1
    histories = {}
    try:
        for name, (schedule, staleness, update_mode) in RUNS.items():
            cfg = train.Config(
                model=model,
                out=os.path.join(args.out, name.replace(" ", "-")),
                steps=args.steps,
                schedule=schedule,
                max_staleness=staleness,
                update_mode=update_mode,
                prompts_per_step=args.prompts_per_step,
                micro_batches=args.micro_batches,
                group_size=args.group_size,
                max_tokens=args.max_tokens,
                lr=args.lr,
                **trainer,
            )
            print(json.dumps(vars(cfg)), flush=True)
            histories[name] = train.train(cfg, client)
    finally:
        stop_server(proc)
    return histories


def report(args, histories):
    results, N = (
        {name: medians(h, args.warmup) for name, h in histories.items()},
        args.micro_batches,
    )
    print(
        f"\nmedians over steps {args.warmup}..{args.steps - 1}, seconds per step "
        f"(N={N}, {args.prompts_per_step} prompts x {args.group_size} x <={args.max_tokens} tokens)"
    )
    columns = ("G", "T", "S", "idle", "step", "tokens", "engine_idle", "tokens_per_s")
    print(f"{'schedule':<14} " + " ".join(f"{c:>12}" for c in columns))
    for name, m in results.items():
        print(f"{name:<14} " + " ".join(f"{m[c]:12.3f}" for c in columns))
    base = results["sync-batch"]
    G, T, S = base["G"], base["T"], base["S"]
    print(f"G/T={G / T:.2f} (sync-batch: G={G:.3f} s, T={T:.3f} s, S={S:.3f} s per step)")
    print(
        f"bound={train.overlap_bound(G, T, S, N, max_staleness=0):.3f} "
        f"stale_bound={train.overlap_bound(G, T, S, N, max_staleness=1):.3f}"
    )
    for name, m in results.items():
        print(f"{name.replace(' ', '_').replace('=', '')}_speedup={base['step'] / m['step']:.3f}")
    draw_timelines(histories, results, N, os.path.join(args.out, "timeline.png"))


def parameters(model):
    """Parameters of the checkpoint in folder `model` (the tied output layer counted once)."""
    from safetensors import safe_open

    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        # safe_open's handle has keys() but is not iterable itself
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def draw_timelines(histories, results, N, path):
    """Three steps of sync-batch, overlap, drain K=1 and in-flight K=1 on one time axis, drawn by
    train.py's own draw_timeline from the runs' metrics, each titled with its medians and its
    bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["sync-batch", "overlap", "drain K=1", "in-flight K=1"]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 9), sharex=True)
    base = results["sync-batch"]
    for ax, name in zip(axes, names):
        train.draw_timeline(ax, histories[name], steps=3)
        m, K = results[name], RUNS[name][1]
        if name == "sync-batch":
            bound = ""
        else:
            bound_x = train.overlap_bound(base["G"], base["T"], base["S"], N, K)
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
