"""Scaling out, both sides in one run: two colocated trainer ranks + two servers against one GPU
doing both, for GRPO steps; then two servers against one for generation alone.

    # two GPUs: the 0.5B shape on train.py's sums workload
    python3 bench/scale.py --device cuda
    # CPU: the tiny model (shows it runs; both sides share the same 2 cores)
    .venv/bin/python bench/scale.py

The workload is train.py's own, the longer of its GPU tasks: --task sums (add up 2-16 numbers,
writing each running total: completion lengths vary, and the reward, which scores each total by
how close it is, varies inside a group) on the built-in model of --model-size
(train.builtin_model: Qwen2.5-0.5B's shape on GPUs, tiny on the CPU), warm-started on worked sums
(cached in .cache/), served in bfloat16 and trained in float32 with bf16 autocast on GPUs.

1. Training (`training_speedup`): train.py for --steps sync-batch steps (the same step on both
   sides: --prompts-per-step x --group-size completions of <= --max-tokens tokens):
     one:  `python train.py --num-servers 1`: the server and the trainer on GPU 0 (weights over ipc)
     two:  `torchrun --nproc-per-node 2 train.py --num-servers 2`: rank r and server r on GPU r;
           FSDP2 over the ranks, each training on half of every micro-batch; rank 0 pushes to
           server 0 over ipc and to server 1 over NCCL; requests spread by the Router.
   On the CPU both are the same with gloo. Both sides run with OMP_NUM_THREADS=1, as torchrun
   sets for its ranks. Per side, over the steps after --warmup of train.py's metrics.jsonl: the
   step's median with its min and max, the median gen_s, train_s and sync_s beside it (sync_s: one
   server's push against two), the trainer-server mismatch, the share of zero-advantage groups and
   the gradient norms. A side that skipped more than half its groups, or had a zero gradient,
   stops the benchmark (exit 1) before any speed-up is printed (bench/runs.py).
2. Generation (`generation_speedup`): one batch (--prompts x --n completions of exactly
   --max-tokens tokens: ignore_eos) through client.Router over one server, then over two; each
   prompt its own request, collected with as_completed, as train.py's overlap schedule does. On
   GPUs server k runs on GPU k (CUDA_VISIBLE_DEVICES) with --gpu-memory-utilization 0.9. Median of
   --rounds after one warm-up, with min and max; tokens/s per side.
--server-urls A,B runs both parts on two running servers instead (for tests: train.py then uses
them through --server-url).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from runs import refuse_hollow, spread  # noqa: E402

import tasks  # noqa: E402
import train  # noqa: E402
from client import Router  # noqa: E402
from local import SHAPES, launch_server, stop_server  # noqa: E402

THREADS = {"OMP_NUM_THREADS": "1"}
WORKLOADS = {
    "cpu": dict(prompts=16, n=4, max_tokens=32, rounds=3, steps=4, warmup=1, prompts_per_step=8),
    "cuda": dict(
        prompts=128, n=8, max_tokens=256, rounds=5, steps=12, warmup=2, prompts_per_step=64
    ),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    for name, default in WORKLOADS["cpu"].items():
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"(CPU default {default})")
    p.add_argument("--group-size", type=int, default=8, help="training: completions per prompt")
    p.add_argument("--model-size", choices=list(SHAPES), help="default: tiny on CPU, 0.5b on GPUs")
    p.add_argument("--warm-start-steps", type=int, help="default: 100 on CPU, 400 on GPUs")
    p.add_argument("--lr", type=float, default=1e-5, help="small: the work per step stays put")
    p.add_argument("--reward", default="", help="train.py's --reward (default: the task's)")
    p.add_argument("--server-urls", default="", help="two running servers on the model (tests)")
    p.add_argument("--out", default=tempfile.mkdtemp(prefix="bench-scale-"))
    a = p.parse_args()
    for name, default in WORKLOADS[a.device].items():
        if getattr(a, name) is None:
            setattr(a, name, default)
    gpu = a.device == "cuda"
    a.model_size = a.model_size or ("0.5b" if gpu else "tiny")
    a.warm_start_steps = a.warm_start_steps or (400 if gpu else 100)
    return a


def model_for(a):
    """The warm-started model (train.builtin_model) and the dtype it is served in."""
    gpu = a.device == "cuda"
    cfg = train.Config(task="sums", model_size=a.model_size, device=a.device, bf16=gpu)
    cfg.warm_start_steps = a.warm_start_steps
    return train.builtin_model(cfg), "bfloat16" if gpu else "float32"


def training(a, model, dtype, ranks):
    """train.py on `ranks` ranks beside as many servers: its rows after the warm-up."""
    out = os.path.join(a.out, f"train-{ranks}")
    flags = ["--model", model, "--dtype", dtype, "--device", a.device, "--out", out]
    flags += ["--task", "sums", "--schedule", "sync-batch", "--steps", str(a.steps)]
    flags += ["--prompts-per-step", str(a.prompts_per_step), "--group-size", str(a.group_size)]
    flags += ["--max-tokens", str(a.max_tokens), "--micro-batches", "4", "--lr", str(a.lr)]
    flags += ["--bf16"] if a.device == "cuda" else []
    flags += ["--reward", a.reward] if a.reward else []
    if a.server_urls:
        flags += ["--server-url", ",".join(a.server_urls.split(",")[:ranks])]
    else:
        flags += ["--num-servers", str(ranks)]
    launcher = [sys.executable]
    if ranks > 1:
        # torchrun, from this Python
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    command = [*launcher, os.path.join(ROOT, "train.py"), *flags]
    print(f"training, {ranks} rank(s) + {ranks} server(s): {' '.join(command)}", flush=True)
    # one thread per process on both sides, as torchrun sets for its ranks (and their servers)
    run = subprocess.run(command, capture_output=True, text=True, env=os.environ | THREADS)
    if run.returncode:
        sys.exit(f"train.py failed:\n{run.stderr[-4000:]}")
    history = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = history[a.warmup :]
    parts = " ".join(f"{k}={statistics.median(r[k] for r in rows):.3f}" for k in TIMES)
    # measured on the samples trained on, and on every one at the first step
    mismatch = [r["mismatch_mean"] for r in history if r["mismatch_mean"] is not None]
    print(
        f"  step {spread([r['step_s'] for r in rows])} s: {parts}, "
        f"mismatch_mean={statistics.median(mismatch) if mismatch else math.nan:.4f}",
        flush=True,
    )
    return rows


TIMES = ("gen_s", "train_s", "sync_s")


def generation(a, model, dtype):
    """Tokens/s of one server and of two, on the same batch, through the Router."""
    flags = ["--model", model, "--dtype", dtype, "--max-num-seqs", str(a.prompts * a.n)]
    if a.device == "cuda":
        flags += ["--gpu-memory-utilization", "0.9"]

    def launch(k):
        gpu = {"CUDA_VISIBLE_DEVICES": str(k)} if a.device == "cuda" else {}
        log = os.path.join(a.out, f"generation-server{k}.log")
        return launch_server(*flags, log_path=log, env=os.environ | gpu)

    if a.server_urls:
        servers, urls = [], a.server_urls.split(",")
    else:
        with ThreadPoolExecutor(2) as pool:
            servers = list(pool.map(launch, range(2)))
        urls = [client.base_url for _, client in servers]
    prompts = [row["prompt"] for row in tasks.sums_data(a.prompts, seed=1)]
    sampling = dict(n=a.n, max_tokens=a.max_tokens, ignore_eos=True)
    tokens_per_s = {}
    try:
        for k in (1, 2):
            router = Router(urls[:k])
            seconds = []
            for _ in range(1 + a.rounds):
                start = time.perf_counter()
                list(router.as_completed(router.submit_each(prompts, **sampling)))
                seconds.append(time.perf_counter() - start)
            tokens_per_s[k] = a.prompts * a.n * a.max_tokens / statistics.median(seconds[1:])
            print(
                f"generation, {k} server(s): {tokens_per_s[k]:,.0f} tokens/s "
                f"(seconds {spread(seconds[1:])})",
                flush=True,
            )
    finally:
        for proc, _ in servers:
            stop_server(proc)
    return tokens_per_s[2] / tokens_per_s[1]


def main():
    a = parse_args()
    model, dtype = model_for(a)
    print(f"device={a.device} model={model} dtype={dtype} out={a.out}")
    print(
        f"training: {a.prompts_per_step} prompts x {a.group_size} x <={a.max_tokens} tokens per "
        f"step, {a.steps} steps, medians after {a.warmup}; generation: {a.prompts} prompts x "
        f"{a.n} x {a.max_tokens} tokens",
        flush=True,
    )
    one = training(a, model, dtype, 1)
    refuse_hollow({"1 rank": one})
    two = training(a, model, dtype, 2)
    refuse_hollow({"2 ranks": two})
    speedup = statistics.median(r["step_s"] for r in one) / statistics.median(
        r["step_s"] for r in two
    )
    generation_speedup = generation(a, model, dtype)
    print(f"generation_speedup={generation_speedup:.2f} training_speedup={speedup:.2f}")


if __name__ == "__main__":
    main()
