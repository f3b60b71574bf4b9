"""TRL against train.py on the same GPUs: one GRPO workload, seconds per step side by side.

    # two H200s, the 0.5B-shaped model, every layout (~8 minutes; TRL's wheels: see below)
    python3 bench/trl_gpu.py --out $OUT/trl-gpu
    # longer completions, or the 1.5B-shaped model, if the time allows
    python3 bench/trl_gpu.py --max-tokens 1024 --layouts ours,trl-server
    python3 bench/trl_gpu.py --model-size 1.5b
    # CPU: the same code on a tiny model (train.py's side; TRL's too where it is installed)
    .venv/bin/python bench/trl_gpu.py --smoke

The workload, the same on every side: one of train.py's GPU tasks (--task: sums, add up 2-16
numbers writing each running total, so completion lengths vary; each total scores by how close it
is, tasks.sums_reward, so rewards vary inside a group; or chat-sums, bench/parity.py's: one-digit
numbers as a chat message, a worked line a step, 181 tokens at the median), on its built-in model
of Qwen2.5-0.5B's shape (or 1.5B's; tiny for --smoke) warm-started on that task
(train.builtin_model, --warm-start-steps, cached in .cache/); the same prompts (--work's
prompts.jsonl: the task's rows, a sums prompt as raw text, a chat-sums one as chat messages that
every side renders with the model's chat template; a raw one as one user message for the async
trainer, which takes chat messages only), the same reward (the task's); --prompts-per-step
prompts x --group-size 8 completions of up to --max-tokens tokens, trained in --micro-batches
micro-batches; fp32 master weights, bf16 autocast, gradient checkpointing (unless
--no-checkpointing, on every side), AdamW at --lr, one
optimizer step per batch, no KL (beta = 0), the loss summed over tokens and divided once by the
step's completion tokens (TRL's loss_type "dapo"); every vLLM engine in bfloat16 with
--gpu-memory-utilization, --max-model-len, max_num_seqs = one step's sequences, CUDA graphs
(unless --enforce-eager).
Every run shows that it trained: its share of zero-advantage groups (frac_reward_zero_std, the
name both train.py and TRL log) and its gradient norm at every step; where a run skipped more than
half its groups, had a zero gradient, or did not log them, no speed-up is printed (exit 1).

The layouts, each in its own process (a failure is printed, exactly, and the next one runs):
  ours          one server.py on GPU 0 for all of these; train.train in the child:
                2 GPUs: trainer on cuda:1, weights over NCCL; 1 GPU: trainer on cuda:0, CUDA IPC;
                each with sync-batch, overlap, overlap --max-staleness 1 with drain and with
                in-flight updates, and any --ours-variant; the "packed" variants (named in
                --ours-variants) train on sequences packed without padding (bench/packing.py)
  trl-server    `trl vllm-serve` (vLLM's own server, NCCL weight transfer) on GPU 0, GRPOTrainer on
                GPU 1, as TRL's docs lay them out: the server with CUDA_VISIBLE_DEVICES=0, the
                trainer with CUDA_VISIBLE_DEVICES=1 (to transformers, a process that sees 2 GPUs
                trains on both: n_gpu=2); the weight-sync group at 127.0.0.1 (VLLM_HOST_IP)
  trl-colocate  GRPOTrainer with vLLM in its own process, on GPU 0 alone
  trl-async     `trl vllm-serve` on GPU 0, trl.experimental.async_grpo's AsyncGRPOTrainer on GPU 1
                (the same devices and group as trl-server), --trl-async-max-staleness (default 1;
                TRL's own: 4), token_budget 0 (fixed micro-batches).
                Its tree attention fetches the FlashAttention-3 kernel from the Hub at run time;
                without `kernels` the bench swaps in PyTorch SDPA (one segment at a time): said so.
TRL's vLLM importance-sampling correction (an extra forward per step) is off unless
--trl-is-correction: our on-policy loss has none.

Printed: per side, layout and schedule the median seconds per step after --warmup steps,
samples/s, where the time went (ours: generation span, training, sync, idle; TRL: its vLLM
generate and weight-sync calls, the rest), then the speed-up of each of ours over each TRL layout
(TRL s/step / ours s/step) and the issue's goals. The whole run keeps to --budget-s: each layout
has a time limit (its own, or --layout-limit-s) that leaves --reserve-s for each layout after it; a
layout with under a minute is skipped, one that runs past its limit is stopped, and either is said.
A stopped layout's processes (trainer, vLLM's API server and engine core) first get SIGABRT, and
Python's faulthandler writes every thread's stack into their logs: a hang shows where it waits.
The TRL layouts print a line per step (and per weight sync and generate call) into their logs, and
their NCCL says which transport it took (NCCL_DEBUG=INFO).
TRL's wheels (trl 1.16.0, datasets, dill, multiprocess and what `vllm serve` needs beyond the
GPU kit): bench/requirements-trl.txt.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from runs import refuse_hollow, spread  # noqa: E402

# train.Config overrides per schedule of ours, the likely fastest first (a run cut short by its
# time limit loses the last); --ours-variant adds more (in-flight updates, ...)
OURS_VARIANTS = {
    "in-flight K=1": {"schedule": "overlap", "max_staleness": 1, "update_mode": "in-flight"},
    "overlap K=1": {"schedule": "overlap", "max_staleness": 1},
    "overlap": {"schedule": "overlap"},
    "sync-batch": {"schedule": "sync-batch"},
    # train.token_logprobs on the sequences packed into one row (bench/packing.py), not yet kept
    "in-flight K=1 packed": {
        "schedule": "overlap",
        "max_staleness": 1,
        "update_mode": "in-flight",
        "pack": True,
    },
    "overlap packed": {"schedule": "overlap", "pack": True},
    "sync-batch packed": {"schedule": "sync-batch", "pack": True},
}
# the order they run in, the GPUs each child sees (None: all), and seconds each may take at most;
# `trl vllm-serve` gets CUDA_VISIBLE_DEVICES=0 from its trainer's child (TRL's documented layout)
LAYOUTS = {
    "ours": (None, 330),
    "trl-server": ("1", 170),
    "trl-colocate": ("0", 140),
    "trl-async": ("1", 170),
    "trl-hf": (None, 600),
}
# what each run logs per step to show that it trained (train.py's names, TRL's too)
TRAINED = ("frac_reward_zero_std", "grad_norm")
# TRL's mean completion length per step: its steps' completion tokens, to set beside ours
LENGTH = ("completions/mean_length",)
# a stopped layout's processes get this long to write their stacks before they are killed
DUMP_GRACE_S = 5.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-size", choices=["0.5b", "1.5b"], default="0.5b")
    p.add_argument("--task", choices=["sums", "short-sums", "chat-sums"], default="sums")
    p.add_argument("--warm-start-steps", type=int, default=400, help="train.py's, on --task")
    p.add_argument("--max-tokens", type=int, default=256, help="completion length limit")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="per step: ours' N, TRL's gradient_accumulation_steps",
    )
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="every vLLM engine's")
    p.add_argument("--max-model-len", type=int, default=2048, help="every vLLM engine's")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on any engine")
    p.add_argument(
        "--no-checkpointing", action="store_true", help="every side keeps every activation"
    )
    p.add_argument(
        "--ours-variants",
        default="in-flight K=1,overlap K=1,overlap,sync-batch",
        help="comma-separated schedules of ours to run (OURS_VARIANTS: the packed ones too)",
    )
    p.add_argument(
        "--ours-variant",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE,...",
        help="one more schedule of ours, train.Config fields: "
        "e.g. 'in-flight:update_mode=in-flight'",
    )
    p.add_argument("--trl-is-correction", action="store_true", help="TRL's vLLM IS correction on")
    p.add_argument("--trl-async-max-staleness", type=int, default=1)
    add_layout_args(p)
    p.add_argument("--work", default="/tmp/trl-gpu-bench", help="model, data, checkpoints")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "trl-gpu"), help="logs")
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny model, 3 short steps")
    p.add_argument(
        "--server-url", default="", help="ours: a running server.py on the model (tests)"
    )
    p.add_argument("--layout", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.model_size, a.steps, a.warmup, a.max_tokens = "tiny", 3, 1, 64
        a.prompts_per_step, a.micro_batches, a.budget_s = 4, 2, 3600.0
    if a.prompts_per_step % a.micro_batches:
        p.error("--prompts-per-step must be divisible by --micro-batches")
    return a


def add_layout_args(p):
    """The layouts to run, and the seconds they get."""
    p.add_argument(
        "--layouts",
        default="ours,trl-server,trl-colocate,trl-async",
        help=f"comma-separated, run in this order; of {list(LAYOUTS)} (trl-hf: TRL without vLLM)",
    )
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds for all layouts")
    p.add_argument(
        "--layout-limit-s",
        type=float,
        help="seconds each layout may take at most (default: its own, in LAYOUTS)",
    )
    p.add_argument(
        "--reserve-s",
        type=float,
        default=90.0,
        help="seconds of --budget-s a layout leaves for each layout after it",
    )


# -- the shared model and data ---------------------------------------------------------------------
def build_model(a):
    """The folder every side loads: train.py's built-in model of --model-size (tiny for --smoke),
    warm-started on --task (train.builtin_model; cached in .cache/), float32 weights that
    every engine serves in bfloat16 on GPUs."""
    import torch

    import train

    gpu = torch.cuda.is_available()
    cfg = train.Config(task=a.task, model_size=a.model_size, device="cuda" if gpu else "cpu")
    cfg.bf16, cfg.warm_start_steps = gpu, a.warm_start_steps
    return train.builtin_model(cfg)


def build_data(a, rows=2000):
    """prompts.jsonl: --task's rows (prompt, answer, the running totals the reward checks)."""
    import tasks

    path = os.path.join(a.work, "prompts.jsonl")
    with open(path, "w") as f:
        for row in tasks.TASKS[a.task].data(rows, 1):
            print(json.dumps(row), file=f)
    return path


def seqs_per_micro_batch(a):
    return a.prompts_per_step // a.micro_batches * a.group_size


# -- the children: each layout runs in its own process and prints RESULT / FAILED lines ------------
CHILD_START = time.monotonic()


def emit(kind, **fields):
    print(f"{kind} {json.dumps(fields)}", flush=True)


def progress(message):
    """One line into the layout's log, stamped with the seconds since its process started: where a
    run that hangs got to."""
    print(f"[{time.monotonic() - CHILD_START:7.1f} s] {message}", flush=True)


@contextlib.contextmanager
def reported(side, layout, name):
    """Run one configuration; if it fails, print exactly what failed and carry on."""
    try:
        yield
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        emit(
            "FAILED",
            side=side,
            layout=layout,
            name=name,
            error=f"{type(e).__name__}: {e}"[:2000],
            where=f"{tb.filename}:{tb.lineno} ({tb.name})",
        )
        traceback.print_exc()


def ours_variants(a):
    """{name: train.Config overrides}: the chosen OURS_VARIANTS and every --ours-variant, whose
    values take the type of the Config field they set."""
    import train

    chosen = [n.strip() for n in a.ours_variants.split(",") if n.strip()]
    variants = {n: OURS_VARIANTS[n] for n in chosen}
    types = {f.name: type(f.default) for f in dataclasses.fields(train.Config)}
    for spec in a.ours_variant:
        name, _, assignments = spec.partition(":")
        overrides = {}
        for assignment in filter(None, assignments.split(",")):
            key, _, value = assignment.partition("=")
            kind = types[key.strip()]
            overrides[key.strip()] = value.strip() in ("1", "true") if kind is bool else kind(value)
        variants[name] = overrides
    return variants


def run_ours(a, model, data):
    """One server.py on GPU 0 (or the CPU); train.train against it for every schedule and layout
    (2 GPUs: the trainer on cuda:1, NCCL; 1 GPU: on cuda:0 beside the server, CUDA IPC)."""
    import torch

    import packing
    import train
    from client import Client
    from local import launch_server, stop_server

    gpus = torch.cuda.device_count()
    layouts = [("2 GPUs", "cuda:1"), ("1 GPU", "cuda:0")] if gpus > 1 else [("1 GPU", "cuda:0")]
    layouts = layouts if gpus else [("CPU", "cpu")]
    flags = ["--model", model, "--dtype", "bfloat16" if gpus else "float32", "--seed", "0"]
    flags += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    flags += ["--max-num-seqs", str(a.prompts_per_step * a.group_size)]
    flags += ["--max-model-len", str(a.max_model_len)] + ["--enforce-eager"] * a.enforce_eager
    log = os.path.join(a.out, "ours-server.log")
    if a.server_url:
        proc, client = None, Client(a.server_url)
    else:
        proc, client = launch_server(*flags, log_path=log, timeout=300)
        print(f"server.py {' '.join(flags)}")
    try:
        for name, overrides in ours_variants(a).items():
            # the packed variants: train.token_logprobs is bench/packing.py's while they train
            overrides = dict(overrides)
            pack = overrides.pop("pack", False)
            for layout, device in layouts:
                packed = packing.patched() if pack else contextlib.nullcontext()
                with reported("ours", layout, name), packed:
                    if gpus:
                        torch.cuda.set_device(device)
                    cfg = ours_config(a, model, data, device, name, overrides)
                    history = train.train(cfg, client)
                    emit_ours(a, cfg, layout, name, history)
                    # its checkpoint (fp32: 2 GB for the 0.5B shape) is not needed
                    shutil.rmtree(cfg.out)
                if gpus:
                    torch.cuda.empty_cache()
    finally:
        if proc:
            stop_server(proc)


def ours_config(a, model, data, device, name, overrides):
    import train

    fields = dict(
        model=model,
        dataset=data,
        reward="tasks:" + task_reward(a).__name__,
        out=os.path.join(a.work, "ours", re.sub(r"\W+", "-", f"{device}-{name}")),
        steps=a.steps,
        prompts_per_step=a.prompts_per_step,
        micro_batches=a.micro_batches,
        group_size=a.group_size,
        max_tokens=a.max_tokens,
        lr=a.lr,
        dtype="bfloat16" if device != "cpu" else "float32",
        device=device,
        bf16=device != "cpu",
        gradient_checkpointing=not a.no_checkpointing,
        # a server that died is not coming back here: fail the run soon
        reconnect_timeout=30.0,
    )
    return train.Config(**fields | overrides)


def emit_ours(a, cfg, layout, name, history):
    """RESULT for one run of ours: step seconds, and the medians of where the time went."""
    rows = history[a.warmup :]
    parts = {k: statistics.median(h[f"{k}_s"] for h in rows) for k in ("gen", "train", "sync")}
    parts["idle"] = statistics.median(h["idle_s"] for h in rows)
    transport = {"cpu": "gloo", "cuda:0": "CUDA IPC"}.get(cfg.device, "NCCL")
    emit(
        "RESULT",
        side="ours",
        layout=layout,
        name=name,
        step_s=[h["step_s"] for h in history],
        parts=parts,
        trained=[{k: h[k] for k in TRAINED} for h in history],
        work_s=[h["train_s"] for h in history],
        tokens=[h["tokens"] for h in history],
        setup=f"train.py schedule={cfg.schedule} max_staleness={cfg.max_staleness} "
        f"N={cfg.micro_batches}, trainer on {cfg.device}, weights over {transport}, "
        f"server.py on {'the CPU' if cfg.device == 'cpu' else 'GPU 0'}",
    )


# -- TRL's side ------------------------------------------------------------------------------------
def task_reward(a):
    """--task's reward (tasks.py), the function every side scores with."""
    import tasks

    return tasks.TASKS[a.task].reward


def trl_reward(a):
    """--task's reward for TRL, which passes the dataset's columns by name (answer and totals are
    what the sums tasks' rewards read); a conversational completion is a list of messages."""
    score = task_reward(a)

    def reward(completions, answer, totals, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rows = [{"answer": x, "totals": t} for x, t in zip(answer, totals)]
        return [score(text, row) for text, row in zip(texts, rows)]

    # TRL logs each reward under its function's name
    reward.__name__ = score.__name__
    return reward


def trl_dataset(data, conversational=False):
    """The prompts as a datasets.Dataset; with `conversational`, a raw prompt as one user
    message."""
    from datasets import Dataset

    with open(data) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        if conversational and isinstance(row["prompt"], str):
            row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    return Dataset.from_list(rows)


def step_timer(totals):
    """A TrainerCallback that records, per optimizer step, its seconds and `totals` (seconds spent
    in the calls time_calls wraps), then zeroes `totals`; each step is a progress line too."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_train_begin(self, args, state, control, **kwargs):
            progress(f"training: {args.max_steps} steps")
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.steps.append({"step": now - self.last, **totals})
            parts = " ".join(f"{k} {v:.2f} s" for k, v in totals.items())
            progress(f"step {state.global_step}/{args.max_steps}: {now - self.last:.2f} s {parts}")
            self.last = now
            totals.update(dict.fromkeys(totals, 0.0))

        def on_log(self, args, state, control, logs=None, **kwargs):
            # a step's log comes after its on_step_end
            if self.steps and any(k in (logs or {}) for k in TRAINED):
                self.steps[-1].update({k: logs[k] for k in TRAINED + LENGTH if k in logs})

    return StepTimer()


def time_calls(obj, method, totals, key):
    """Wrap obj.method so that its seconds add up in totals[key], a progress line as it starts and
    as it returns (a call that never returns is the last line)."""
    inner = getattr(obj, method)
    totals[key] = 0.0

    def timed(*args, **kwargs):
        progress(f"  {method} ...")
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
            progress(f"  {method}: {time.perf_counter() - start:.2f} s")

    setattr(obj, method, timed)


def grpo_config(a, out, **vllm):
    """GRPOConfig for the workload; `vllm`: the vLLM fields of the layout."""
    import torch
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out,
        max_steps=a.steps,
        learning_rate=a.lr,
        per_device_train_batch_size=seqs_per_micro_batch(a),
        gradient_accumulation_steps=a.micro_batches,
        num_generations=a.group_size,
        max_completion_length=a.max_tokens,
        temperature=1.0,
        # token-level: summed over tokens, divided once by the step's completion tokens
        loss_type="dapo",
        beta=0.0,
        vllm_importance_sampling_correction=a.trl_is_correction,
        bf16=torch.cuda.is_available(),
        gradient_checkpointing=not a.no_checkpointing,
        logging_steps=1,
        # no progress bar: step_timer's lines (and the logged metrics) show each step in the log
        disable_tqdm=True,
        report_to="none",
        save_strategy="no",
        seed=0,
        **vllm,
    )


def run_trl_grpo(a, model, data, layout, **vllm):
    """GRPOTrainer on the workload, its vLLM generate and weight-sync calls timed."""
    from trl import GRPOTrainer

    totals = {}
    cfg = grpo_config(a, os.path.join(a.work, layout), **vllm)
    # in server mode this joins the server's weight-sync group (POST /init_weight_transfer_engine)
    progress(f"GRPOTrainer(vllm_mode={cfg.vllm_mode if cfg.use_vllm else None}) ...")
    trainer = GRPOTrainer(
        model=model, reward_funcs=trl_reward(a), args=cfg, train_dataset=trl_dataset(data)
    )
    progress(f"GRPOTrainer ready, n_gpu={cfg.n_gpu}, model on {trainer.model.device}")
    if cfg.use_vllm:
        time_calls(trainer.vllm_generation, "generate", totals, "gen")
        time_calls(trainer.vllm_generation, "sync_weights", totals, "sync")
    timer = step_timer(totals)
    trainer.add_callback(timer)
    trainer.train()
    return timer.steps


def emit_trl(a, layout, name, steps, setup, parts=None):
    rows = steps[a.warmup :]
    if parts is None and rows and "gen" in rows[0]:
        parts = {k: statistics.median(s[k] for s in rows) for k in ("gen", "sync")}
        parts["rest"] = statistics.median(s["step"] - s["gen"] - s["sync"] for s in rows)
    samples = a.prompts_per_step * a.group_size
    emit(
        "RESULT",
        side="TRL",
        layout=layout,
        name=name,
        step_s=[s["step"] for s in steps],
        parts=parts or {},
        trained=[{k: s[k] for k in TRAINED if k in s} for s in steps],
        # outside generation and weight sync, where TRL times them (not the async trainer)
        work_s=[s["step"] - s["gen"] - s["sync"] for s in steps if "gen" in s],
        tokens=[s[LENGTH[0]] * samples for s in steps if LENGTH[0] in s],
        setup=setup,
    )


def trl_versions():
    import trl
    import vllm

    return f"trl {trl.__version__}, vllm {vllm.__version__}"


def run_trl_colocate(a, model, data):
    extra = {"vllm_max_model_length": a.max_model_len}
    steps = run_trl_grpo(
        a,
        model,
        data,
        "trl-colocate",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=a.gpu_memory_utilization,
        **extra,
    )
    setup = (
        f"GRPOTrainer, vllm_mode=colocate, one process on GPU 0 ({trl_versions()}); "
        f"IS correction {a.trl_is_correction}; CUDA graphs always (TRL has no eager switch)"
    )
    emit_trl(a, "1 GPU", "TRL colocate", steps, setup)


def run_trl_hf(a, model, data):
    """TRL without vLLM (transformers' generate): the --smoke check of TRL's side on a CPU."""
    steps = run_trl_grpo(a, model, data, "trl-hf", use_vllm=False)
    emit_trl(a, "CPU", "TRL, no vLLM", steps, "GRPOTrainer, use_vllm=False")


# -- `trl vllm-serve` for the server and async layouts ---------------------------------------------
@contextlib.contextmanager
def trl_vllm_serve(a, model):
    """`trl vllm-serve` (it execs vLLM's own server with TRL's flags) on GPU 0 alone, as TRL's docs
    run it; yields its URL once /health answers."""
    import requests

    from client import free_port
    from local import stop_server

    port = free_port()
    cmd = [sys.executable, "-m", "trl.scripts.vllm_serve", "--model", model, "--port", str(port)]
    cmd += ["--gpu_memory_utilization", str(a.gpu_memory_utilization), "--dtype", "bfloat16"]
    cmd += ["--max_model_len", str(a.max_model_len)] + ["--enforce_eager"] * a.enforce_eager
    # unknown to trl vllm-serve: passed on to vllm serve
    cmd += ["--max-num-seqs", str(a.prompts_per_step * a.group_size)]
    # the trainer hosts TRL's weight-sync group at vLLM's get_ip(), which reads VLLM_HOST_IP: both
    # ends are on this machine. NCCL_DEBUG=INFO: each end logs the transport it took (or its error).
    os.environ.update(VLLM_HOST_IP="127.0.0.1", NCCL_DEBUG="INFO")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    log_path = os.path.join(a.out, f"{a.layout}-vllm-serve.log")
    progress(f"CUDA_VISIBLE_DEVICES=0 {' '.join(cmd)}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"trl vllm-serve exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"trl vllm-serve did not answer in 300 s; see {log_path}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        progress(f"trl vllm-serve answers at {url}")
        yield url
    finally:
        stop_server(proc)


def run_trl_server(a, model, data):
    from client import free_port

    with trl_vllm_serve(a, model) as url:
        steps = run_trl_grpo(
            a,
            model,
            data,
            "trl-server",
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=url,
            vllm_group_port=free_port(),
        )
    setup = (
        f"GRPOTrainer, vllm_mode=server: trl vllm-serve on GPU 0, trainer on GPU 1, NCCL "
        f"({trl_versions()}); IS correction {a.trl_is_correction}"
    )
    emit_trl(a, "2 GPUs", "TRL server", steps, setup)


def sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=None, **_):
    """flash_attn_varlen_func's contract (causal) on PyTorch's SDPA, one segment at a time: q
    (total_q, H, D), k and v (total_k, H_kv, D). Causal is aligned to the bottom right, as in
    FlashAttention: a segment's queries are the last of its keys."""
    import torch
    import torch.nn.functional as F

    out, bounds_q, bounds_k = [], cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        # (1, H, L, D), the KV heads repeated for the query heads
        qi = q[q0:q1].transpose(0, 1)[None]
        ki, vi = (x[k0:k1].repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))
        ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]
        rows, cols = torch.arange(q1 - q0, device=q.device), torch.arange(k1 - k0, device=q.device)
        mask = cols[None, :] <= rows[:, None] + (k1 - k0) - (q1 - q0)
        attended = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale)
        out.append(attended[0].transpose(0, 1))
    return torch.cat(out)


def tree_attention_kernel():
    """The async trainer's attention: TRL's (FlashAttention-3 from the Hub through `kernels`) if
    that package is here, else sdpa_varlen in its place. Returns which."""
    import importlib.util
    import types

    from trl.experimental.async_grpo import packing

    if importlib.util.find_spec("kernels") is not None:
        return "FlashAttention-3 (kernels)"
    # packing.tree_attention looks the function up at every call
    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=sdpa_varlen)
    return "PyTorch SDPA per segment (stand-in: no `kernels` package, no Hub)"


def run_trl_async(a, model, data):
    import torch
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    attention = tree_attention_kernel()
    with trl_vllm_serve(a, model) as url:
        cfg = AsyncGRPOConfig(
            output_dir=os.path.join(a.work, "trl-async"),
            max_steps=a.steps,
            learning_rate=a.lr,
            per_device_train_batch_size=seqs_per_micro_batch(a),
            gradient_accumulation_steps=a.micro_batches,
            num_generations=a.group_size,
            max_completion_length=a.max_tokens,
            temperature=1.0,
            vllm_server_base_url=url,
            max_staleness=a.trl_async_max_staleness,
            # a fixed per_device_train_batch_size per micro-batch, as everywhere else
            token_budget=0,
            # a weight sync that takes over a minute fails with the server's error (TRL: 30 min)
            weight_sync_timeout=60,
            bf16=torch.cuda.is_available(),
            gradient_checkpointing=not a.no_checkpointing,
            logging_steps=1,
            disable_tqdm=True,
            report_to="none",
            save_strategy="no",
            seed=0,
        )
        progress("AsyncGRPOTrainer ...")
        trainer = AsyncGRPOTrainer(
            model=model,
            reward_funcs=trl_reward(a),
            args=cfg,
            train_dataset=trl_dataset(data, conversational=True),
        )
        progress(f"AsyncGRPOTrainer ready, n_gpu={cfg.n_gpu}, model on {trainer.model.device}")
        timer = step_timer({})
        trainer.add_callback(timer)
        trainer.train()
    setup = (
        f"AsyncGRPOTrainer: trl vllm-serve on GPU 0, trainer on GPU 1, NCCL ({trl_versions()}); "
        f"max_staleness={a.trl_async_max_staleness}; tree attention: {attention}"
    )
    emit_trl(a, "2 GPUs", "TRL async", timer.steps, setup, async_parts(a, trainer))


def async_parts(a, trainer):
    """Where the async trainer's steps went, from its own logged metrics (medians after warm-up)."""
    logs = [h for h in trainer.state.log_history if "perf/fwd_bwd_s" in h][a.warmup :]
    keys = {"fwd_bwd": "perf/fwd_bwd_s", "optimizer": "perf/optimizer_s"}
    keys["rollout_wait"] = "perf/rollout_wait_s"
    return {
        k: statistics.median(h[v] for h in logs) for k, v in keys.items() if logs and v in logs[0]
    }


RUNNERS = {
    "ours": run_ours,
    "trl-server": run_trl_server,
    "trl-colocate": run_trl_colocate,
    "trl-async": run_trl_async,
    "trl-hf": run_trl_hf,
}


def child(a):
    """One layout, in this process (started by main with --layout)."""
    import logging
    import resource

    import torch

    # run_layout's SIGABRT (PYTHONFAULTHANDLER=1: every Python process of the layout writes its
    # threads' stacks) leaves no core file: an engine's address space is tens of GB
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # TRL's own progress lines (the async trainer's weight-sync phases) into the log
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("trl").setLevel(logging.INFO)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    progress(f"{a.layout}: CUDA_VISIBLE_DEVICES={visible}, {torch.cuda.device_count()} GPU(s)")
    model, data = build_model(a), os.path.join(a.work, "prompts.jsonl")
    side = "ours" if a.layout == "ours" else "TRL"
    with reported(side, a.layout, "(the whole layout)"):
        RUNNERS[a.layout](a, model, data)


# -- the parent: build once, run each layout in a child within the budget, compare ----------------
def layout_limit(a, name, left, later):
    """Seconds `name` may take: its own (LAYOUTS; x4 on --smoke's CPU) or --layout-limit-s, and no
    more than leaves --reserve-s of the `left` budget to each of the `later` layouts."""
    own = a.layout_limit_s or LAYOUTS[name][1] * (4 if a.smoke else 1)
    return min(own, left - a.reserve_s * later)


def stop_layout(proc):
    """SIGABRT to every process of a layout's session: each Python one (PYTHONFAULTHANDLER=1)
    writes its threads' stacks into its log as it dies. Once all are gone, or after DUMP_GRACE_S,
    SIGKILL to whatever is left."""
    deadline = time.monotonic() + DUMP_GRACE_S
    # killpg raises ProcessLookupError once no process of the session is left
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGABRT)
        while time.monotonic() < deadline:
            proc.poll()
            os.killpg(proc.pid, 0)
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_layout(a, name, deadline, argv, later=0):
    """Run one layout's child with its GPUs and time limit (`later`: how many layouts run after
    it); return its RESULT and FAILED lines. Its whole output goes to --out/NAME.log; on a failure
    the tail is printed here."""
    gpus = LAYOUTS[name][0]
    limit = layout_limit(a, name, deadline - time.monotonic(), later)
    if limit < 60:
        print(f"\n[{name}] skipped: {limit:.0f} s of --budget-s for it", flush=True)
        return []
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    # --smoke runs on the CPU: no GPUs to pick
    gpus = None if a.smoke else gpus
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    log_path = os.path.join(a.out, f"{name}.log")
    print(f"\n[{name}] CUDA_VISIBLE_DEVICES={gpus or 'all'}, up to {limit:.0f} s", flush=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        # a session of its own: a timeout stops the servers it started too
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv, "--layout", name],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=max(limit - DUMP_GRACE_S, 1))
        except subprocess.TimeoutExpired:
            stop_layout(proc)
            print(
                f"[{name}] stopped at its time limit (exit code {proc.returncode}); "
                "each of its processes wrote its stacks into its log"
            )
    with open(log_path) as f:
        lines = f.read().splitlines()
    reports = [x for x in lines if is_report(x)]
    found = [json.loads(x.split(" ", 1)[1]) | {"kind": x.split()[0]} for x in reports]
    for r, line in zip(found, reports):
        print(f"[{name}] {r['kind']} {r['layout']} / {r['name']}: {r.get('error', 'ok')}")
        # the child's line as it wrote it: what bench/parity.py --trl-log reads from this output
        print(line)
    if proc.returncode or any(r["kind"] == "FAILED" for r in found):
        print(f"[{name}] exit code {proc.returncode}; the last lines of {log_path}:")
        print("\n".join("    " + x[:300] for x in lines[-40:]))
    print(f"[{name}] {time.monotonic() - start:.0f} s", flush=True)
    return found


def is_report(line):
    return line.startswith("RESULT {") or line.startswith("FAILED {")


def summarize(a, results):
    """The table of every run, the speed-ups of ours over each TRL layout, and the goals."""
    samples = a.prompts_per_step * a.group_size
    for r in results:
        r["s"] = statistics.median(r["step_s"][a.warmup :] or r["step_s"])
    print(
        f"\nmedian seconds per step after {a.warmup} warm-up steps; {a.prompts_per_step} prompts "
        f"x {a.group_size} x <= {a.max_tokens} tokens = {samples} samples per step"
    )
    print(
        f"{'side':<5} {'layout':<7} {'run':<14} {'s/step':>7} {'samples/s':>9}  where the time went"
    )
    for r in results:
        parts = " ".join(f"{k}={v:.2f}" for k, v in r["parts"].items())
        print(
            f"{r['side']:<5} {r['layout']:<7} {r['name']:<14} {r['s']:7.2f} "
            f"{samples / r['s']:9.1f}  {parts}"
        )
    refuse_untrained(a, results)
    training_speed(a, results)
    trl = [r for r in results if r["side"] == "TRL"]
    ours = [r for r in results if r["side"] == "ours"]
    for r in ours:
        ratios = " ".join(f"vs {t['name']} {t['s'] / r['s']:.2f}x" for t in trl)
        print(f"speed-up of ours {r['layout']} {r['name']}: {ratios or '(no TRL result)'}")
    goals = [("2 GPUs", "TRL server", 1.5), ("2 GPUs", "TRL async", 1.0)]
    for layout, name, goal in goals + [("1 GPU", "TRL colocate", 1.3)]:
        best = min((r["s"] for r in ours if r["layout"] == layout), default=None)
        theirs = next((t["s"] for t in trl if t["name"] == name), None)
        got = f"{theirs / best:.2f}x" if best and theirs else "not measured"
        print(f"goal: ours (best, {layout}) >= {goal}x {name}: {got}")
    print("setups:")
    for r in results:
        print(f"  {r['side']} {r['layout']} {r['name']}: {r['setup']}")


def training_speed(a, results):
    """Each run's seconds of training per step (ours: train_s; TRL: the step outside its vLLM
    generate and weight-sync calls) and per 1,000 completion tokens, medians after the warm-up:
    the two sides' completions differ in length, so their steps hold different work. Then the
    goal: our training per step (sync-batch, the GPU not shared with generation) at most TRL
    colocate's time outside generation."""
    print("training per step after the warm-up (median, min-max), and per 1k completion tokens:")
    for r in results:
        work, tokens = r.get("work_s", [])[a.warmup :], r.get("tokens", [])[a.warmup :]
        if len(work) != len(tokens) or not work:
            continue
        per_k = [1000 * w / t for w, t in zip(work, tokens)]
        r["work_per_k"] = statistics.median(per_k)
        print(
            f"  {r['side']} {r['layout']} {r['name']}: {spread(work)} s, {spread(per_k)} s "
            f"per 1k tokens ({statistics.median(tokens):.0f} tokens a step)"
        )
    ours = next((r for r in results if r["name"] == "sync-batch" and "work_per_k" in r), None)
    trl = next((r for r in results if r["name"] == "TRL colocate" and "work_per_k" in r), None)
    if ours and trl:
        print(
            f"goal: our training (sync-batch) <= TRL colocate's time outside generation, per 1k "
            f"tokens: {ours['work_per_k']:.3f} s against {trl['work_per_k']:.3f} s "
            f"({trl['work_per_k'] / ours['work_per_k']:.2f}x)"
        )


def refuse_untrained(a, results):
    """Exit non-zero, before any speed-up, unless every run shows that it trained: its share of
    zero-advantage groups and its gradient norm (train.py's metrics, TRL's logs) at every step after
    the warm-up, the share at most a half and no norm 0 (bench/runs.py)."""
    runs, unshown = {}, []
    for r in results:
        name = f"{r['side']} {r['layout']} {r['name']}"
        rows = r["trained"][a.warmup :]
        if not rows or any(set(row) != set(TRAINED) for row in rows):
            unshown.append(f"{name}: did not log {' and '.join(TRAINED)} at every step")
        else:
            runs[name] = rows
    if unshown:
        sys.exit(
            "no speed-up reported: a side does not show that it trained\n" + "\n".join(unshown)
        )
    refuse_hollow(runs)


def main():
    argv = sys.argv[1:]
    a = parse_args(argv)
    if a.layout:
        return child(a)
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    deadline = time.monotonic() + a.budget_s
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"GPUs: {names or 'none'}; python {sys.version.split()[0]}, torch {torch.__version__}")
    start = time.monotonic()
    model = build_model(a)
    data = build_data(a)
    print(f"model {model} ({a.model_size}), data {data}: built in {time.monotonic() - start:.0f} s")
    print(json.dumps(vars(a)), flush=True)
    layouts = [n.strip() for n in a.layouts.split(",") if n.strip()]
    if len(names) < 2 and not a.smoke:
        layouts = [n for n in layouts if n in ("ours", "trl-colocate")]
        print(f"fewer than 2 GPUs: only {layouts}, and ours on 1 GPU")
    found = []
    for i, name in enumerate(layouts):
        found += run_layout(a, name, deadline, argv, later=len(layouts) - i - 1)
    summarize(a, [r for r in found if r["kind"] == "RESULT"])
    failed = [f"{r['side']} {r['layout']} {r['name']}" for r in found if r["kind"] == "FAILED"]
    if failed:
        sys.exit(f"failed (see above): {', '.join(failed)}")


if __name__ == "__main__":
    main()
