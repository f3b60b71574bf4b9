"""The same multi-turn evaluation two ways: our asynchronous engine against a lock-step evaluator.

    .venv/bin/python bench/eval_speed.py                     # 128 prompts x n=8, up to 3 turns, 2 rounds
    .venv/bin/python bench/eval_speed.py --prompts 32 --rounds 1

The workload: the calculator task's prompts (train.calculator_data), n samples each, episodes of up to
--max-turns model turns of at most --max-tokens tokens, temperature 1, on the built-in tiny model. A
turn that ends with --call-end is a tool call and the episode goes on with the tool's answer
(here mostly "error: unknown tool ...": the untrained model writes no real calls, but the turns
end after as many tokens as a real agent's would vary, which is what decides the speed). Both
sides run the same engine settings (engine.engine_args; on CPU: eager, fp32, 256 MiB KV cache;
on a GPU: compiled, fp32, 0.4 of the GPU each):
  async:     server.py + client.rollout: each episode moves on as soon as its own turn finishes,
             and its next turn joins the engine's running batch at once.
  lock-step: vLLM's synchronous LLM.generate in this process: every turn of every live episode is
             one batch, which waits for its slowest sequence before any tool is called.
Both engines stay up; after a warm-up each, the timed rounds alternate between the sides. Each side
reports pass@1 (an exact final answer) and the mean turns and sampled tokens per episode, to show
the two produce the same kind of episodes. The last line is `async_vs_sync=<lock-step s / async s>`.
"""
import argparse
import asyncio
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm import LLM, SamplingParams  # noqa: E402

import train  # noqa: E402
from client import launch_server, stop_server  # noqa: E402
from engine import RolloutEngine, engine_args, tiny_model  # noqa: E402

CALL_START, RESULT = "<tool>", "<result>{}</result>"


def lock_step(llm, prompts, a):
    """Episodes as RolloutEngine makes them, one synchronous batch per turn: [prompt][n] (text, turns, tokens)."""
    tok, tools = llm.get_tokenizer(), RolloutEngine(None)
    episodes = [{"ids": tok.encode(p), "text": p, "turns": 0, "sampled": 0, "last": "", "budget": a.max_episode_tokens}
                for p in prompts for _ in range(a.n)]
    live = episodes
    for _ in range(a.max_turns):
        params = [SamplingParams(n=1, temperature=1.0, max_tokens=min(a.max_tokens, e["budget"]), stop=[a.call_end],
                                 include_stop_str_in_output=True, logprobs=0) for e in live]
        outputs = llm.generate([{"prompt_token_ids": e["ids"]} for e in live], params, use_tqdm=False)
        going = []
        for e, out in zip(live, outputs):
            c = out.outputs[0]
            e["ids"] = e["ids"] + list(c.token_ids)
            e["text"], e["last"], e["turns"], e["sampled"] = e["text"] + c.text, c.text, e["turns"] + 1, e["sampled"] + len(c.token_ids)
            e["budget"] -= len(c.token_ids)
            if not c.text.endswith(a.call_end):
                continue
            name, _, argument = e["text"][:-len(a.call_end)].rpartition(CALL_START)[2].strip().partition(" ")
            output = RESULT.format(asyncio.run(tools.call_tool(name, argument)))
            out_ids = tok.encode(output, add_special_tokens=False)
            e["ids"], e["text"], e["budget"] = e["ids"] + out_ids, e["text"] + output, e["budget"] - len(out_ids)
            if e["budget"] > 0:
                going.append(e)
        live = going
        if not live:
            break
    return [[(e["last"], e["turns"], e["sampled"]) for e in episodes[i:i + a.n]] for i in range(0, len(episodes), a.n)]


def asynchronous(client, prompts, a):
    results = client.rollout(prompts, n=a.n, max_turns=a.max_turns, max_episode_tokens=a.max_episode_tokens,
                             temperature=1.0, max_tokens=a.max_tokens, call_end=a.call_end)
    return [[(e.turns[-1]["text"], len(e.turns), sum(e.loss_mask)) for e in per] for per in results]


def summary(rows, results):
    flat = [x for per in results for x in per]
    passed = sum(train.reward(text, row["answer"]) == 1 for row, per in zip(rows, results) for text, _, _ in per)
    return (f"pass@1 {passed / len(flat):.3f}, {statistics.mean(t for _, t, _ in flat):.2f} turns and "
            f"{statistics.mean(s for _, _, s in flat):.1f} sampled tokens per episode")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per turn")
    p.add_argument("--max-episode-tokens", type=int, default=256)
    p.add_argument("--call-end", default="e", help="the text that ends a turn as a tool call")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per side, alternating")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="GPU only: each engine's share of the GPU")
    a = p.parse_args()
    rows = train.calculator_data(a.prompts, seed=0)
    prompts = [r["prompt"] for r in rows]
    model = tiny_model()
    args = engine_args(model, gpu_memory_utilization=a.gpu_memory_utilization)
    print(f"{a.prompts} prompts x n={a.n}, up to {a.max_turns} turns of <= {a.max_tokens} tokens, call_end {a.call_end!r}; "
          f"both engines: {args.dtype}, enforce_eager={args.enforce_eager}, kv cache "
          f"{f'{args.kv_cache_memory_bytes >> 20} MiB' if args.kv_cache_memory_bytes else f'{a.gpu_memory_utilization} of the GPU'}",
          flush=True)
    proc, client = launch_server("--model", model, "--gpu-memory-utilization", str(a.gpu_memory_utilization), log_path=os.path.join(ROOT, "runs", "eval_speed_server.log"))
    try:
        llm = LLM(model=model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes, gpu_memory_utilization=a.gpu_memory_utilization, seed=0)
        sides = {"async": lambda: asynchronous(client, prompts, a), "lock-step": lambda: lock_step(llm, prompts, a)}
        for run in sides.values():  # warm-up
            run()
        times, results = {name: [] for name in sides}, {}
        for _ in range(a.rounds):
            for name, run in sides.items():
                t0 = time.perf_counter()
                results[name] = run()
                times[name].append(time.perf_counter() - t0)
        for name in sides:
            print(f"{name:9s} {statistics.median(times[name]):.2f} s (median of {a.rounds}); {summary(rows, results[name])}")
    finally:
        stop_server(proc)
    print(f"async_vs_sync={statistics.median(times['lock-step']) / statistics.median(times['async']):.2f}")


if __name__ == "__main__":
    main()
