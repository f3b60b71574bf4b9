"""train.py on the workload of TRL's GRPO example, every schedule, seconds per step.

    .venv/bin/python bench/trl_workload.py

The workload: 4 prompts x 8 samples x up to 32 tokens per step, gradient accumulation 4 (one
prompt per micro-batch), lr 1e-3, 20 steps, the untrained tiny model (temperature 1, so lengths
vary), server and trainer sharing both cores. Each schedule runs on the server settings it needs:
one unthrottled server (vLLM's defaults) for sync-batch, overlap and overlap with
--max-staleness 1 (overlap K=1), and one started with
--max-num-seqs 8 (one micro-batch of sequences at a time) for overlap-priority. Each run first
pushes the same initial weights. Printed per schedule: the median seconds per step of steps 3-20;
the last line is `best_step_s=<the fastest schedule's median>`.
"""
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from client import launch_server, stop_server  # noqa: E402
from engine import tiny_model  # noqa: E402

SCHEDULES = {"sync-batch": (0, ()), "overlap": (0, ()), "overlap K=1": (1, ()),
             "overlap-priority": (0, ("--max-num-seqs", "8"))}


def main():
    model, out = tiny_model(), tempfile.mkdtemp(prefix="bench-trl-")
    medians = {}
    for name, (staleness, flags) in SCHEDULES.items():
        schedule = name.split()[0]
        proc, client = launch_server("--model", model, *flags, log_path=os.path.join(out, f"{schedule}.log"))
        try:
            cfg = train.Config(model=model, out=os.path.join(out, name.replace(" ", "-")), steps=20, prompts_per_step=4,
                               micro_batches=4, group_size=8, max_tokens=32, lr=1e-3, schedule=schedule, max_staleness=staleness)
            history = train.train(cfg, client)
        finally:
            stop_server(proc)
        medians[name] = statistics.median(h["step_s"] for h in history[2:])
        print(f"{name:<17} {medians[name]:.3f} s/step  (server flags: {' '.join(flags) or 'defaults'})", flush=True)
    print(f"best_step_s={min(medians.values()):.3f}")


if __name__ == "__main__":
    main()
