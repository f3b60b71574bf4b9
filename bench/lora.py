"""LoRA against full fine-tuning, side by side in one run, on one server started with --enable-lora:

    .venv/bin/python bench/lora.py                             # CPU: the tiny model
    .venv/bin/python bench/lora.py --server-url http://127.0.0.1:8000 --rounds 1 --steps 2
    python3 bench/lora.py --device cuda --model-size 0.5b      # one GPU: Qwen2.5-0.5B's shape

1. push: Client.update_model_params of the model in full (over gloo on the CPU, CUDA IPC on the
   server's GPU) against the same model's LoRA adapter of --rank on every projection
   (Client.update_adapter, its tensors in a file in /dev/shm and in the request's body): wall
   seconds per push, median (min-max) of --rounds after one warm-up, the bytes each sends, their
   ratio, and the adapter's parts (medians): the client's encoding, the server's reading and
   checking, its load (vLLM's add_lora and the version bumped) and the rest (HTTP).
2. transfer: the adapter's two ways end to end, against an estimate of a third, its tensors
   through the weight transport into the workers, which write the folder: the full push's time
   (its HTTP, collective_rpc, receive and load) less its bytes' broadcast, plus the adapter's
   bytes' broadcast (raw, between two processes) and the folder's writing; its add_lora is not
   counted.
3. GRPO step: train.train for --steps steps of the addition task with every weight trained and
   pushed, then with a LoRA adapter (--rank): seconds per step, median (min-max) of all
   steps but the first, with their train and sync parts; and step 0's mismatch (the trainer's
   logprobs of every sampled token against the server's), the exactness of each side.
The base model is train.py's built-in one of --model-size, warm-started on the addition task
(--warm-start-steps) so that rewards differ inside groups and both sides train; no step ratio is
printed where a side skipped its training (bench/runs.py). A full push to a server started with
--enable-lora serves the base alone, through vLLM's LoRA layers all the same: the full side's
generation is no faster than on a server without them.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402
from runs import refuse_hollow  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from weight_sync import raw_broadcast_seconds  # noqa: E402

import train  # noqa: E402
from client import Client  # noqa: E402
from local import SHAPES, launch_server, stop_server  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="the trainer's: cpu or cuda")
    p.add_argument("--model-size", choices=list(SHAPES), help="default: 0.5b on a GPU, else tiny")
    p.add_argument("--rank", type=int, default=8, help="the adapter's rank")
    p.add_argument(
        "--warm-start-steps", type=int, default=100, help="the base model's, on addition"
    )
    p.add_argument("--rounds", type=int, default=7, help="measured pushes per side")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per side")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8, help="completion length limit")
    p.add_argument("--lr", type=float, help="both sides' (default: 1e-3 tiny, else 2e-5)")
    p.add_argument(
        "--server-url", help="a server on the model with --enable-lora (else one starts)"
    )
    a = p.parse_args(argv)
    a.model_size = a.model_size or ("0.5b" if a.device.startswith("cuda") else "tiny")
    # 1e-3 collapses the 0.5B model's full fine-tuning in a few steps (every reward equal)
    a.lr = a.lr or (1e-3 if a.model_size == "tiny" else 2e-5)
    return a


def spread(times, unit=1e3, digits=1):
    """median (min-max), in ms by default."""
    t = sorted(x * unit for x in times)
    return f"{statistics.median(t):.{digits}f} ({t[0]:.{digits}f}-{t[-1]:.{digits}f})"


def push_seconds(push, rounds):
    """Wall seconds of each of `rounds` calls of push(), after one warm-up."""
    push()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        push()
        times.append(time.perf_counter() - start)
    return times


def adapter_pushes(client, peft, rounds, via):
    """Wall seconds of each adapter push `via` a file or the body, and the medians of its parts:
    the client's encoding, the server's reading and checking, its load, and the rest (HTTP)."""
    parts = {"encode_s": [], "read_s": [], "load_s": [], "http_s": []}

    def push():
        start = time.perf_counter()
        client.update_adapter(peft, via=via)
        wall = time.perf_counter() - start
        update = client.last_update
        for part in ("encode_s", "read_s", "load_s"):
            parts[part].append(update[part])
        parts["http_s"].append(wall - update["encode_s"] - update["read_s"] - update["load_s"])

    times = push_seconds(push, rounds)
    # the parts of the timed pushes: the first is push_seconds' warm-up
    shown = "  ".join(f"{p[:-2]} {statistics.median(t[1:]) * 1e3:.1f}" for p, t in parts.items())
    return times, shown


def folder_write_seconds(adapter, rounds):
    """What the workers of the other way would do after receiving: write the adapter's folder."""
    folder, times = tempfile.mkdtemp(dir="/dev/shm"), []
    for _ in range(rounds):
        start = time.perf_counter()
        save_file(adapter, os.path.join(folder, "adapter_model.safetensors"))
        times.append(time.perf_counter() - start)
    return times


def on_gpu(a):
    return a.device.startswith("cuda")


def step_seconds(client, base, a, out, lora_rank):
    """train.train's metrics of each GRPO step."""
    cfg = train.Config(
        model=base,
        lora_rank=lora_rank,
        steps=a.steps,
        prompts_per_step=a.prompts_per_step,
        micro_batches=2,
        group_size=8,
        max_tokens=a.max_tokens,
        lr=a.lr,
        device=a.device,
        dtype="bfloat16" if on_gpu(a) else "float32",
        bf16=on_gpu(a),
        out=out,
    )
    return train.train(cfg, client)


def push_figures(client, base, a):
    """1 and 2: the pushes, and the adapter's two ways."""
    full = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(a.device)
    copy = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(a.device)
    peft = get_peft_model(copy, LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=TARGETS))
    adapter = {k: v.contiguous() for k, v in get_peft_model_state_dict(peft).items()}
    adapter_bytes = sum(t.nbytes for t in adapter.values())
    full_bytes = sum(p.nbytes for p in full.parameters())
    client.init_communicator(device=a.device)
    full_push = push_seconds(lambda: client.update_model_params(full), a.rounds)
    ways = {via: adapter_pushes(client, peft, a.rounds, via) for via in ("file", "body")}
    adapter_push = ways["file"][0]
    print(f"model {a.model_size}, LoRA rank {a.rank} on {','.join(TARGETS)}, {a.device}")
    print(f"push, ms       full {spread(full_push)}  {full_bytes / 1e6:.2f} MB", client.transport)
    for via, (times, parts) in ways.items():
        print(f"               LoRA {spread(times)}  {adapter_bytes / 1e6:.2f} MB via {via}")
        print(f"                    its parts: {parts}")
    times = statistics.median(full_push) / statistics.median(adapter_push)
    size = full_bytes / adapter_bytes
    print(f"               full / LoRA via file: {times:.1f}x the time, {size:.0f}x the bytes")
    transport = client.transport
    client.close_communicator()
    # the other way: a full push's machinery (HTTP, collective_rpc, receive, load) carrying the
    # adapter's bytes instead of the model's, then the workers write the folder (and add_lora)
    if transport == "ipc":
        # one GPU: the workers copy from the trainer's buffer (and NCCL refuses two ranks there)
        sent_full = sent_adapter = 0.0
    else:
        device = "cpu" if transport == "gloo" else a.device
        sent_full = raw_broadcast_seconds(full_bytes, a.rounds, device, device) * 1e3
        sent_adapter = raw_broadcast_seconds(adapter_bytes, a.rounds, device, device) * 1e3
    write = statistics.median(folder_write_seconds(adapter, a.rounds)) * 1e3
    other = statistics.median(full_push) * 1e3 - sent_full + sent_adapter + write
    ms = {via: statistics.median(times) * 1e3 for via, (times, _) in ways.items()}
    ways_ms = f"via file {ms['file']:.1f}, in the body {ms['body']:.1f}"
    print(f"transfer, ms   end to end, add_lora included: {ways_ms}")
    print(
        f"               through {transport}, estimated {other:.1f} (add_lora not included) = "
        f"the full push {statistics.median(full_push) * 1e3:.1f} - its bytes {sent_full:.1f} + "
        f"the adapter's {sent_adapter:.1f} + the folder written {write:.1f}"
    )


def step_figures(client, base, a, work):
    """3: GRPO steps, full against LoRA."""
    runs, steps = {}, {}
    for name, rank in (("full", 0), ("LoRA", a.rank)):
        # the base weights back: the full run trained the server's
        client.init_communicator(device=a.device)
        client.update_model_params(AutoModelForCausalLM.from_pretrained(base).to(a.device))
        client.close_communicator()
        runs[name] = step_seconds(client, base, a, os.path.join(work, name), rank)
        # all steps but the first
        steps[name] = {
            part: [r[part] for r in runs[name][1:]] for part in ("step_s", "train_s", "sync_s")
        }
        shown = "  ".join(f"{part} {spread(t, 1, 3)}" for part, t in steps[name].items())
        print(f"GRPO step, s   {name:<4} {shown}")
        # exactness: the trainer's logprobs of every token sampled at step 0 against the server's
        mean, worst = runs[name][0]["mismatch_mean"], runs[name][0]["mismatch_max"]
        print(f"               step 0's mismatch: mean {mean:.2e}, max {worst:.2e}")
    # no ratio of steps that skipped their training
    refuse_hollow(runs)
    times = statistics.median(steps["full"]["step_s"]) / statistics.median(steps["LoRA"]["step_s"])
    print(f"               full / LoRA: {times:.2f}x the step time")


def main(argv=None):
    a = parse_args(argv)
    warm = train.Config(
        model_size=a.model_size, device=a.device, warm_start_steps=a.warm_start_steps
    )
    base = train.builtin_model(warm)
    # vLLM's LoRA kernels on a GPU take 16-bit weights
    gpu = ["--gpu-memory-utilization", "0.3", "--dtype", "bfloat16"] if on_gpu(a) else []
    max_rank = next(r for r in (8, 16, 32, 64, 128, 256, 512) if r >= a.rank)
    lora = ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "4"]
    # the adapter travels in a request's body: 24 MB of base64 at 0.5B, rank 8
    lora += ["--max-body-mb", "1024"]
    work = tempfile.mkdtemp(prefix="bench-lora-")
    log = os.path.join(work, "server.log")
    if a.server_url:
        proc, client = None, Client(a.server_url)
    else:
        proc, client = launch_server("--model", base, *lora, *gpu, log_path=log)
    try:
        push_figures(client, base, a)
        step_figures(client, base, a, work)
    finally:
        if proc:
            stop_server(proc)


if __name__ == "__main__":
    main()
