"""Completion tokens per second through the HTTP server + client versus the in-process engine.

    # 64 prompts x n=8 x 32 tokens, 7 rounds
    .venv/bin/python bench/server_throughput.py
    .venv/bin/python bench/server_throughput.py --prompts 16 --rounds 3
    # on one GPU: both engines share it
    python3 bench/server_throughput.py --prompts 128 --max-tokens 64

Both sides run the same workload on the built-in tiny model (ignore_eos, temperature 1.0). Both
engines stay up, but only one works at a time: after a warm-up each, the timed rounds alternate
between the sides, so drifts in the machine's load hit both alike. The median of `--rounds` rounds
per side is reported; the last line is `server_vs_engine=<server tok/s / engine tok/s>`.
"""

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402

from engine import Engine, engine_args  # noqa: E402
from local import launch_server, stop_server, tiny_model  # noqa: E402


class SyncEngine:
    """Drive an Engine from plain Python: it lives on its own loop in a background thread."""

    def __init__(self, args: AsyncEngineArgs, fork=False):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        # its output handler starts on the loop with the first request; `fork`: engine.Engine's
        self.engine = Engine(args, fork=fork)

    def _run(self, coro, timeout):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate(self, prompts, params: SamplingParams, priority=0, timeout=600.0):
        return self._run(self.engine.generate(prompts, params, priority), timeout)

    def shutdown(self):
        async def stop():
            self.engine.llm.shutdown()

        self._run(stop(), timeout=120)  # shut the engine down on its own loop, then stop the loop
        self.loop.call_soon_threadsafe(self.loop.stop)


def rate(generate):
    """Completion tokens per second of one call of `generate()`."""
    start = time.perf_counter()
    results = generate()
    return sum(len(c.token_ids) for completions in results for c in completions) / (
        time.perf_counter() - start
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64, help="prompts per call")
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="tokens per completion (ignore_eos: always this many)",
    )
    p.add_argument(
        "--rounds", type=int, default=7, help="timed rounds per side (the median is reported)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.4,
        help="GPU only: each engine's share of the GPU",
    )
    a = p.parse_args()
    prompts = [f"prompt {i}: " for i in range(a.prompts)]
    print(
        f"workload: {a.prompts} prompts x n={a.n} x {a.max_tokens} tokens, {a.rounds} rounds",
        flush=True,
    )

    log = os.path.join(tempfile.mkdtemp(prefix="bench-server-"), "server.log")
    # the server in a subprocess, called through the client; the same engine in this one
    memory = a.gpu_memory_utilization
    proc, client = launch_server("--gpu-memory-utilization", str(memory), log_path=log)
    engine = SyncEngine(engine_args(tiny_model(), gpu_memory_utilization=memory))
    params = SamplingParams(n=a.n, max_tokens=a.max_tokens, temperature=1.0, ignore_eos=True)
    sides = {
        "server + client": lambda: client.generate(
            prompts, n=a.n, max_tokens=a.max_tokens, temperature=1.0, ignore_eos=True
        ),
        "in-process engine": lambda: engine.generate(prompts, params),
    }
    rates = {name: [] for name in sides}
    try:
        for generate in sides.values():
            generate()  # warm-up
        # alternate the sides, one at a time, so both see the same machine
        for _ in range(a.rounds):
            for name, generate in sides.items():
                rates[name].append(rate(generate))
    finally:
        engine.shutdown()
        stop_server(proc)
    server, local = (statistics.median(r) for r in rates.values())
    print(f"server + client:    {server:8.0f} tok/s")
    print(f"in-process engine:  {local:8.0f} tok/s")
    print(f"server_vs_engine={server / local:.3f}")


if __name__ == "__main__":
    main()
