"""train.py on the workload of TRL's GRPO example, every schedule, seconds per step.

    .venv/bin/python bench/trl_workload.py

The workload: 4 prompts x 8 samples x up to 32 tokens per step, gradient accumulation 4 (one
prompt per micro-batch), lr 1e-3, 20 steps, the untrained tiny model (temperature 1, so lengths
vary), server and trainer sharing both cores. Each schedule runs on a server of its own with
vLLM's defaults: sync-batch, overlap and overlap with --max-staleness 1 (overlap K=1). Each run
first pushes the same initial weights. Printed per schedule: the median seconds per step of steps
3-20; the last line is `best_step_s=<the fastest schedule's median>`.

First, for reference, the floor no schedule can beat: the same engine in this process
(engine.Engine, no HTTP, no trainer) generating one step's samples (4 prompts x n=8, up to 32
tokens), median of 17.
"""

import asyncio
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm import SamplingParams  # noqa: E402

import train  # noqa: E402
from client import launch_server, stop_server, tiny_model  # noqa: E402
from engine import Engine, engine_args  # noqa: E402

SCHEDULES = {
    "sync-batch": (0, ()),
    "overlap": (0, ()),
    "overlap K=1": (1, ()),
}


async def generation_floor(model, steps=20):
    """Median seconds the engine alone takes to generate one step's samples."""
    engine, prompts = Engine(engine_args(model)), [r["prompt"] for r in train.addition_data(4, 0)]
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        await asyncio.gather(
            *(engine.generate([p], SamplingParams(n=8, max_tokens=32)) for p in prompts)
        )
        seconds.append(time.perf_counter() - start)
    engine.llm.shutdown()
    return statistics.median(seconds[3:])


def main():
    model, out = tiny_model(), tempfile.mkdtemp(prefix="bench-trl-")
    floor_s = asyncio.run(generation_floor(model))
    print(
        f"engine alone      {floor_s:.3f} s per step's generation "
        f"(in-process, no HTTP, no training)",
        flush=True,
    )
    medians = {}
    for name, (staleness, flags) in SCHEDULES.items():
        schedule = name.split()[0]
        proc, client = launch_server(
            "--model", model, *flags, log_path=os.path.join(out, f"{schedule}.log")
        )
        try:
            cfg = train.Config(
                model=model,
                out=os.path.join(out, name.replace(" ", "-")),
                steps=20,
                prompts_per_step=4,
                micro_batches=4,
                group_size=8,
                max_tokens=32,
                lr=1e-3,
                schedule=schedule,
                max_staleness=staleness,
            )
            history = train.train(cfg, client)
        finally:
            stop_server(proc)
        medians[name] = statistics.median(h["step_s"] for h in history[2:])
        print(
            f"{name:<17} {medians[name]:.3f} s/step  "
            f"(server flags: {' '.join(flags) or 'defaults'})",
            flush=True,
        )
    print(f"best_step_s={min(medians.values()):.3f}")


if __name__ == "__main__":
    main()
