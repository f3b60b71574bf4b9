"""Completion tokens per second through the HTTP server + client versus the in-process engine.

    .venv/bin/python bench/server_throughput.py                    # 64 prompts x n=8 x 32 tokens, 5 rounds
    .venv/bin/python bench/server_throughput.py --prompts 16 --rounds 3

Both sides run the same workload on the built-in tiny model (ignore_eos, temperature 1.0), one
after the other (never together: a 2-core machine), one warm-up round each, then the median of
`--rounds` timed rounds. The last line is `server_vs_engine=<server tok/s / engine tok/s>`.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm import SamplingParams  # noqa: E402

from client import launch_server, stop_server  # noqa: E402
from engine import SyncEngine, engine_args, tiny_model  # noqa: E402


def tokens_per_second(generate, rounds):
    """Median completion tokens/s of `rounds` calls of `generate()`, after one warm-up call."""
    generate()
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        results = generate()
        seconds = time.perf_counter() - start
        rates.append(sum(len(c.token_ids) for completions in results for c in completions) / seconds)
    return statistics.median(rates)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64, help="prompts per call")
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (ignore_eos: always this many)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per side (the median is reported)")
    a = p.parse_args()
    prompts = [f"prompt {i}: " for i in range(a.prompts)]
    print(f"workload: {a.prompts} prompts x n={a.n} x {a.max_tokens} tokens, {a.rounds} rounds", flush=True)

    # the server in a subprocess, called through the client (all prompts in one call)
    log = os.path.join(tempfile.mkdtemp(prefix="bench-server-"), "server.log")
    proc, client = launch_server(log_path=log)
    try:
        server = tokens_per_second(
            lambda: client.generate(prompts, n=a.n, max_tokens=a.max_tokens, temperature=1.0, ignore_eos=True), a.rounds)
    finally:
        stop_server(proc)
    print(f"server + client:    {server:8.0f} tok/s", flush=True)

    # the same engine in this process, once the server is gone
    engine = SyncEngine(engine_args(tiny_model()))
    try:
        params = SamplingParams(n=a.n, max_tokens=a.max_tokens, temperature=1.0, ignore_eos=True)
        local = tokens_per_second(lambda: engine.generate(prompts, params), a.rounds)
    finally:
        engine.shutdown()
    print(f"in-process engine:  {local:8.0f} tok/s", flush=True)
    print(f"server_vs_engine={server / local:.3f}")


if __name__ == "__main__":
    main()
