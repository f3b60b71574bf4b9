"""The same multi-turn evaluation two ways: our asynchronous engine against a lock-step evaluator.

    # 128 prompts x n=8, up to 3 turns, tools 1 s on average
    .venv/bin/python bench/eval_speed.py
    # an instant tool
    .venv/bin/python bench/eval_speed.py --tool-latency 0
    .venv/bin/python bench/eval_speed.py --prompts 32 --rounds 1

The workload: the calculator task's prompts (tasks.calculator_data), each ending in an open tool
call "<tool>lookup ", n samples each, episodes of up to --max-turns model turns of at most
--max-tokens tokens, temperature 1, on the built-in tiny model. A turn that ends with --call-end
calls the `lookup` tool, which answers after a latency drawn from an exponential distribution of
mean --tool-latency seconds (a search API or a code sandbox takes 10 ms to seconds), and the episode
goes on with its answer. The untrained model writes no real calls, but its turns end after lengths
that vary as an agent's do, which is what decides the speed. Both sides use the same RolloutEngine
tool code and the same engine settings (engine.engine_args; on CPU: eager, fp32, 256 MiB KV cache;
on a GPU: compiled, fp32, 0.4 of the GPU each), both in this process:
  async:     engine.RolloutEngine on engine.Engine (vLLM's AsyncLLM): each episode moves on as soon
             as its own turn or tool call finishes, and its next turn joins the running batch at
             once.
  lock-step: vLLM's synchronous LLM.generate: every turn of every live episode is one batch, which
             waits for its slowest sequence; then all of the turn's tool calls run concurrently,
             and the next turn waits for the slowest of them.
Both engines stay up; after a warm-up each, the timed rounds alternate between the sides. Each side
reports pass@1 (an exact final answer) and the mean turns and sampled tokens per episode, to show
the two produce the same kind of episodes. The last line is `async_vs_sync=<lock-step s / async s>`.
"""

import argparse
import asyncio
import os
import random
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm import LLM, SamplingParams  # noqa: E402

import tasks  # noqa: E402
from engine import Engine, EpisodeOptions, RolloutEngine, engine_args  # noqa: E402
from local import tiny_model  # noqa: E402

CALL_START, RESULT = "<tool>", "<result>{}</result>"


def latency_tool(mean_s, seed=0):
    """The `lookup` tool: answers after an exponentially distributed latency (asyncio.sleep: it
    waits like I/O, holding no thread)."""
    rng = random.Random(seed)

    async def lookup(argument):
        await asyncio.sleep(rng.expovariate(1 / mean_s) if mean_s > 0 else 0)
        return f"{len(argument)} results"

    return lookup


def lock_step(llm, tools, prompts, a):
    """Episodes as RolloutEngine makes them, one synchronous batch per turn:
    [prompt][n] (text, turns, tokens)."""
    tok = llm.get_tokenizer()
    episodes = [
        {
            "ids": tok.encode(p),
            "text": p,
            "turns": 0,
            "sampled": 0,
            "last": "",
            "budget": a.max_episode_tokens,
        }
        for p in prompts
        for _ in range(a.n)
    ]
    live = episodes
    for _ in range(a.max_turns):
        params = [
            SamplingParams(
                n=1,
                temperature=1.0,
                max_tokens=min(a.max_tokens, e["budget"]),
                stop=[a.call_end],
                include_stop_str_in_output=True,
                logprobs=0,
            )
            for e in live
        ]
        outputs = llm.generate(
            [{"prompt_token_ids": e["ids"]} for e in live], params, use_tqdm=False
        )
        calls = []
        for e, out in zip(live, outputs):
            c = out.outputs[0]
            e["ids"] = e["ids"] + list(c.token_ids)
            e["text"], e["last"], e["turns"], e["sampled"] = (
                e["text"] + c.text,
                c.text,
                e["turns"] + 1,
                e["sampled"] + len(c.token_ids),
            )
            e["budget"] -= len(c.token_ids)
            if c.text.endswith(a.call_end):
                name, _, argument = (
                    e["text"][: -len(a.call_end)].rpartition(CALL_START)[2].strip().partition(" ")
                )
                calls.append((e, tools.call_tool(name, argument)))

        async def all_calls(pending):
            return await asyncio.gather(*(call for _, call in pending))

        live = []
        for (e, _), result in zip(calls, asyncio.run(all_calls(calls)) if calls else []):
            output = RESULT.format(result)
            out_ids = tok.encode(output, add_special_tokens=False)
            e["ids"], e["text"], e["budget"] = (
                e["ids"] + out_ids,
                e["text"] + output,
                e["budget"] - len(out_ids),
            )
            if e["budget"] > 0:
                live.append(e)
        if not live:
            break
    return [
        [(e["last"], e["turns"], e["sampled"]) for e in episodes[i : i + a.n]]
        for i in range(0, len(episodes), a.n)
    ]


def summary(rows, results):
    flat = [x for per in results for x in per]
    passed = sum(
        tasks.reward(text, row["answer"]) == 1
        for row, per in zip(rows, results)
        for text, _, _ in per
    )
    return (
        f"pass@1 {passed / len(flat):.3f}, {statistics.mean(t for _, t, _ in flat):.2f} turns and "
        f"{statistics.mean(s for _, _, s in flat):.1f} sampled tokens per episode"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per turn")
    p.add_argument("--max-episode-tokens", type=int, default=256)
    p.add_argument("--call-end", default="e", help="the text that ends a turn as a tool call")
    p.add_argument(
        "--tool-latency",
        type=float,
        default=1.0,
        help="mean seconds a tool call takes (exponential)",
    )
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per side, alternating")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.4,
        help="GPU only: each engine's share of the GPU",
    )
    a = p.parse_args()
    rows = tasks.calculator_data(a.prompts, seed=0)
    prompts = [r["prompt"] + CALL_START + "lookup " for r in rows]
    model = tiny_model()
    args = engine_args(model, gpu_memory_utilization=a.gpu_memory_utilization)
    if args.kv_cache_memory_bytes:
        kv_cache = f"{args.kv_cache_memory_bytes >> 20} MiB"
    else:
        kv_cache = f"{a.gpu_memory_utilization} of the GPU"
    print(
        f"{a.prompts} prompts x n={a.n}, up to {a.max_turns} turns of <= {a.max_tokens} tokens, "
        f"call_end {a.call_end!r}, tool latency {a.tool_latency} s (mean, exponential); "
        f"both engines: {args.dtype}, enforce_eager={args.enforce_eager}, kv cache {kv_cache}",
        flush=True,
    )
    # the async side's engine lives on its own loop, in a thread
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(600)  # noqa: E731
    engine = Engine(args)
    options = EpisodeOptions(
        max_turns=a.max_turns,
        max_episode_tokens=a.max_episode_tokens,
        call_end=a.call_end,
        result_format=RESULT,
    )
    rollouts = RolloutEngine(engine, tools={"lookup": latency_tool(a.tool_latency)})
    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=a.gpu_memory_utilization,
        seed=0,
    )
    sync_tools = RolloutEngine(None, tools={"lookup": latency_tool(a.tool_latency, seed=1)})

    def asynchronous():
        params = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens)
        results = run(rollouts.rollout(prompts, params, options))
        return [
            [(e.turns[-1]["text"], len(e.turns), sum(e.loss_mask)) for e in per] for per in results
        ]

    sides = {"async": asynchronous, "lock-step": lambda: lock_step(llm, sync_tools, prompts, a)}
    for side in sides.values():  # warm-up
        side()
    times, results = {name: [] for name in sides}, {}
    for _ in range(a.rounds):
        for name, side in sides.items():
            t0 = time.perf_counter()
            results[name] = side()
            times[name].append(time.perf_counter() - t0)
    for name in sides:
        print(
            f"{name:9s} {statistics.median(times[name]):.2f} s (median of {a.rounds}); "
            f"{summary(rows, results[name])}"
        )
    speedup = statistics.median(times["lock-step"]) / statistics.median(times["async"])
    print(f"async_vs_sync={speedup:.2f}")

    # on the engine's own loop, so that its output handler stops before the engine core
    async def shutdown():
        engine.llm.shutdown()

    run(shutdown())


if __name__ == "__main__":
    main()
