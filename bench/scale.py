"""Scaling out, both sides in one run: two servers against one for generation alone, then two
colocated trainer ranks + two servers against one GPU doing both, for GRPO steps.

    # CPU: the tiny model, a tiny workload (shows it runs; both sides share the same 2 cores)
    .venv/bin/python bench/scale.py
    # two GPUs: a random Qwen2.5-0.5B-shaped model
    python3 bench/scale.py --device cuda

1. Generation (`generation_speedup`): the same batch (--prompts x --n completions of exactly
   --max-tokens tokens: ignore_eos) through client.Router over one server, then over two; each
   prompt its own request (split_prompts), collected with as_completed, as train.py's overlap
   schedule does. On GPUs server k runs on GPU k (CUDA_VISIBLE_DEVICES) with
   --gpu-memory-utilization 0.9. Median of --rounds after one warm-up; tokens/s per side.
2. Training (`training_speedup`): train.py for --steps sync-batch steps (the same step on both
   sides: --prompts-per-step x --group-size completions of <= --train-max-tokens tokens):
     one:  `python train.py --num-servers 1`: the server and the trainer on GPU 0 (weights over ipc)
     two:  `torchrun --nproc-per-node 2 train.py --num-servers 2`: rank r and server r on GPU r;
           FSDP2 over the ranks, each training on half of every micro-batch; rank 0 pushes to
           server 0 over ipc and to server 1 over NCCL; requests spread by the Router.
   On the CPU both are the same with gloo. Both sides run with OMP_NUM_THREADS=1, as torchrun
   sets for its ranks. Steps/s from the median step_s of train.py's metrics.jsonl after --warmup
   steps; the median gen_s, train_s and sync_s beside it (sync_s: one server's push against two).
The model: GPU, Qwen2.5-0.5B's shape (896 hidden, 24 layers, 14 heads, 2 KV heads, 4864
intermediate, 151,936 vocabulary, tied), random weights, served in bfloat16 and trained in float32
with bf16 autocast; CPU, client.tiny_model. The random model's rewards are ~0: real gradients'
cost, no learning, which is all a timing benchmark needs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from client import Router, launch_server, stop_server, tiny_model  # noqa: E402
from shapes import QWEN25_05B  # noqa: E402

THREADS = {"OMP_NUM_THREADS": "1"}
WORKLOADS = {
    "cpu": dict(prompts=16, n=4, max_tokens=16, rounds=3, steps=4, warmup=1, prompts_per_step=8),
    "cuda": dict(
        prompts=128, n=8, max_tokens=256, rounds=3, steps=10, warmup=3, prompts_per_step=64
    ),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    for name, default in WORKLOADS["cpu"].items():
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"(CPU default {default})")
    p.add_argument("--group-size", type=int, default=8, help="training: completions per prompt")
    p.add_argument("--train-max-tokens", type=int, default=None, help="default: --max-tokens")
    p.add_argument("--out", default=tempfile.mkdtemp(prefix="bench-scale-"))
    a = p.parse_args()
    for name, default in WORKLOADS[a.device].items():
        if getattr(a, name) is None:
            setattr(a, name, default)
    a.train_max_tokens = a.train_max_tokens or a.max_tokens
    return a


def model_for(a):
    if a.device == "cpu":
        return tiny_model(), "float32"
    path = os.path.join(ROOT, ".cache", "bench-scale-qwen2.5-0.5b-shape")
    # Qwen2's own initialisation scale (tiny_model's 0.1 is for greedy tests without near-ties)
    model = tiny_model(path, dtype="bfloat16", initializer_range=0.02, **QWEN25_05B)
    return model, "bfloat16"


def generation(a, model, dtype):
    """Tokens/s of one server and of two, on the same batch, through the Router."""
    flags = ["--model", model, "--dtype", dtype, "--max-num-seqs", str(a.prompts * a.n)]
    if a.device == "cuda":
        flags += ["--gpu-memory-utilization", "0.9"]

    def launch(k):
        gpu = {"CUDA_VISIBLE_DEVICES": str(k)} if a.device == "cuda" else {}
        log = os.path.join(a.out, f"generation-server{k}.log")
        return launch_server(*flags, log_path=log, env=os.environ | gpu)

    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(launch, range(2)))
    prompts = [f"{i % 10}+{i % 7}=" for i in range(a.prompts)]
    sampling = dict(n=a.n, max_tokens=a.max_tokens, ignore_eos=True, split_prompts=True)
    tokens_per_s = {}
    try:
        for k in (1, 2):
            router = Router([client.base_url for _, client in servers[:k]])
            seconds = []
            for _ in range(1 + a.rounds):
                start = time.perf_counter()
                list(router.as_completed(router.generate(prompts, **sampling)))
                seconds.append(time.perf_counter() - start)
            tokens_per_s[k] = a.prompts * a.n * a.max_tokens / statistics.median(seconds[1:])
            print(f"generation, {k} server(s): {tokens_per_s[k]:,.0f} tokens/s", flush=True)
    finally:
        for proc, _ in servers:
            stop_server(proc)
    return tokens_per_s[2] / tokens_per_s[1]


def training(a, model, dtype, ranks):
    """Steps/s of train.py on `ranks` ranks beside as many servers (median after the warm-up)."""
    out = os.path.join(a.out, f"train-{ranks}")
    flags = ["--model", model, "--dtype", dtype, "--device", a.device, "--out", out]
    flags += ["--num-servers", str(ranks), "--schedule", "sync-batch", "--steps", str(a.steps)]
    flags += ["--prompts-per-step", str(a.prompts_per_step), "--group-size", str(a.group_size)]
    flags += ["--max-tokens", str(a.train_max_tokens), "--micro-batches", "4"]
    flags += ["--bf16"] if a.device == "cuda" else []
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
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    step_s = statistics.median(r["step_s"] for r in rows[a.warmup :])
    keys = ("gen_s", "train_s", "sync_s")
    parts = " ".join(f"{k}={statistics.median(r[k] for r in rows[a.warmup :]):.3f}" for k in keys)
    print(f"  {1 / step_s:.3f} steps/s (median step {step_s:.3f} s: {parts})", flush=True)
    return 1 / step_s


def main():
    a = parse_args()
    model, dtype = model_for(a)
    print(f"device={a.device} model={model} dtype={dtype} out={a.out}")
    print(
        f"generation: {a.prompts} prompts x {a.n} x {a.max_tokens} tokens; "
        f"training: {a.prompts_per_step} prompts x {a.group_size} x <={a.train_max_tokens} tokens"
        f" per step, {a.steps} steps, median after {a.warmup}",
        flush=True,
    )
    generation_speedup = generation(a, model, dtype)
    one, two = training(a, model, dtype, 1), training(a, model, dtype, 2)
    print(f"generation_speedup={generation_speedup:.2f} training_speedup={two / one:.2f}")


if __name__ == "__main__":
    main()
