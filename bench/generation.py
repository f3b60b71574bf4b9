"""The server's engine generating a user-sized step: completion tokens/s against the bound that the
memory bandwidth sets, for the default settings and for each of vLLM's levers tried.

    # one H200: 64 prompts x 8 samples x 512 tokens of the 0.5B shape, every lever
    python3 bench/generation.py --device cuda
    python3 bench/generation.py --device cuda --levers "default,no async scheduling"
    # CPU: the tiny model, a smoke run
    .venv/bin/python bench/generation.py --prompts 4 --n 2 --max-tokens 16 --rounds 2

Each lever is one engine, as the server builds it (engine.engine_args) with the lever's
AsyncEngineArgs fields on top ("seeded requests", "vLLM's detokenizer", "no logprobs": the default
engine, those SamplingParams fields in every request; without logprobs through vLLM's AsyncLLM
itself, a measure of what the trainer's logprobs cost), started alone and stopped before the next;
levers in a row that differ only in their requests' fields share one engine. Its step: --prompts
prompts of --task, rendered as train.py sends them, each sampled --n times at temperature 1 with the
sampled tokens' logprobs (what a trainer asks), `ignore_eos` so that every completion is
--max-tokens long. One step warms up; --rounds steps are timed. The weights are train.py's built-in
model of --model-size, untrained: the speed does not depend on them.

The bound: each decode step reads every weight once and the KV cache of every sequence running,
at --bandwidth bytes/s (4.2e12: what the H200 measured; on a CPU, give its own), with sequences
admitted in waves of the engine's max_num_seqs. Prefill is in the measured time and not in the
bound: the fraction printed is what the engine reaches of the bound, at least.

Printed per lever: the settings vLLM resolved and the requests' fields, then `<lever>: <tok/s>
(min-max) tok/s, <f> of the bound`, then `<lever>: CPU us per completion token:` each process's
CPU time over the timed rounds (this one, vLLM's engine core, its workers; a process busy for the
whole step bounds it, where the bound above does not); last, each lever's speed over the
default's where it ran: `<lever>_vs_default=`.
"""

import argparse
import asyncio
import glob
import math
import os
import statistics
import sys
import time
import uuid
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import psutil  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from server_throughput import SyncEngine  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

import train  # noqa: E402
from engine import engine_args  # noqa: E402
from tasks import TASKS  # noqa: E402

# the levers: AsyncEngineArgs fields over the server's defaults (vLLM's own where it sets none)
LEVERS = {
    "default": {},
    # n samples of one prompt share its KV blocks (vLLM 0.26 caches prefixes by default)
    "no prefix caching": {"enable_prefix_caching": False},
    "prefix caching": {"enable_prefix_caching": True},
    # the engine's own default, which the server used before it took vllm serve's (H200: 1,024)
    "max-num-seqs 128": {"max_num_seqs": 128},
    "max-num-seqs 256": {"max_num_seqs": 256},
    "max-num-seqs 1024": {"max_num_seqs": 1024},
    # a CUDA graph for every batch size up to 512, in steps of 16 past 8
    "cudagraphs to 512": {"cudagraph_capture_sizes": [1, 2, 4, 8, *range(16, 513, 16)]},
    # a held-out evaluation's 2,048 samples (bench/parity.py's server admits 1,024 at a time)
    "max-num-seqs 1024 + cudagraphs to 1024": {
        "max_num_seqs": 1024,
        "cudagraph_capture_sizes": [1, 2, 4, 8, *range(16, 1025, 16)],
    },
    # the scheduler plans step t+1 while step t runs (vLLM 0.26's default where it can)
    "no async scheduling": {"async_scheduling": False},
    # not an engine field: every request seeded, as train.py's --seed-requests (bench/parity.py)
    # and its held-out evaluations send them; vLLM draws a seeded sequence's noise with its own
    # generator, one sequence after another, each decode step
    "seeded requests": {"seed": 0},
    # as a held-out evaluation on bench/parity.py's server: 1,024 seeded sequences at once
    "max-num-seqs 1024 + seeded requests": {"max_num_seqs": 1024, "seed": 0},
    # not an engine field either: a stop string (that never matches) has vLLM decode every
    # sequence's text, and each sampled token's for its logprob, at every decode step, as the
    # engine did before it decoded the text once at the end (engine.final_output_params)
    "vLLM's detokenizer": {"stop": ["\x00never\x00"]},
    # no logprob of the sampled tokens (which a trainer needs: this measures what they cost
    # vLLM's processes, through AsyncLLM directly, as engine.Engine always asks for them)
    "no logprobs": {"logprobs": None},
    "no logprobs + no detokenize": {"logprobs": None, "detokenize": False},
}
# SamplingParams fields among the levers' (the rest are AsyncEngineArgs fields)
REQUEST_FIELDS = ("seed", "detokenize", "logprobs", "stop")
# what a CPU engine can take: no CUDA graphs, no async scheduling
CPU_LEVERS = ("default", "no prefix caching", "max-num-seqs 256")


def resolved(engine):
    """The settings that decide decode speed, as vLLM resolved them: {name: value}."""
    config = engine.llm.vllm_config
    sizes = config.compilation_config.cudagraph_capture_sizes or []
    return {
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "prefix_caching": config.cache_config.enable_prefix_caching,
        "async_scheduling": getattr(config.scheduler_config, "async_scheduling", None),
        "cudagraphs": "none" if config.model_config.enforce_eager else f"up to {max(sizes)}",
    }


def bytes_read(model, dtype_bytes):
    """(the weights' bytes, the KV cache's bytes per token) of the model folder `model`."""
    params = 0
    for path in glob.glob(os.path.join(model, "*.safetensors")):
        with safe_open(path, "pt") as f:
            names = f.keys()
            params += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    hf = AutoConfig.from_pretrained(model)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * dtype_bytes
    return params * dtype_bytes, kv


def bound(prompt_lens, n, max_tokens, max_num_seqs, weights, kv, bandwidth):
    """Completion tokens/s if every decode step took the time to read the weights and the KV
    cache of the sequences running, each wave of max_num_seqs sequences decoding to the end."""
    seqs = [length for length in prompt_lens for _ in range(n)]
    seconds = 0.0
    for start in range(0, len(seqs), max_num_seqs):
        wave = seqs[start : start + max_num_seqs]
        # step t reads the weights, and each sequence's prompt and its t tokens so far
        steps = max_tokens * weights + kv * max_tokens * sum(wave)
        steps += kv * len(wave) * max_tokens * (max_tokens - 1) / 2
        seconds += steps / bandwidth
    return len(seqs) * max_tokens / seconds


def run_lever(name, engine, prompts, a, request):
    """One lever on `engine`: the settings vLLM resolved, the tokens/s of each timed round, and
    each of its processes' CPU seconds per completion token over those rounds; `request`:
    SamplingParams fields of every request."""
    request = {"seed": None, "logprobs": 0, "detokenize": True} | request
    params = SamplingParams(
        n=a.n, max_tokens=a.max_tokens, temperature=1.0, ignore_eos=True, **request
    )
    # with the sampled tokens' logprobs, as a trainer asks: the server's path
    generate = engine.generate if request["logprobs"] is not None else bare(engine)
    settings = resolved(engine.engine) | request
    print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
    generate(prompts, params)  # warm-up
    this = psutil.Process()
    processes = [this, *this.children(recursive=True)]
    cpu = [sum(p.cpu_times()[:2]) for p in processes]
    rates, tokens = [], 0
    for _ in range(a.rounds):
        start = time.perf_counter()
        results = generate(prompts, params)
        count = sum(len(c.token_ids) for group in results for c in group)
        rates.append(count / (time.perf_counter() - start))
        tokens += count
    used = [sum(p.cpu_times()[:2]) - then for p, then in zip(processes, cpu)]
    # this one runs AsyncLLM's output handling; its children: vLLM's engine core, workers
    per_token = {}
    for i, (p, s) in enumerate(zip(processes, used)):
        label = "this process" if i == 0 else p.name()
        per_token[label] = per_token.get(label, 0.0) + s / tokens
    return settings, rates, per_token


def bare(engine):
    """generate(prompts, params) on `engine`'s vLLM AsyncLLM itself: [[CompletionOutput]]."""
    llm = engine.engine.llm
    final = RequestOutputKind.FINAL_ONLY

    async def one(prompt, params):
        stream = llm.generate({"prompt_token_ids": prompt}, params, request_id=uuid.uuid4().hex)
        return [out async for out in stream][-1].outputs

    async def all_of(prompts, params):
        params = params.clone()
        params.output_kind = final
        return await asyncio.gather(*(one(p, params) for p in prompts))

    return lambda prompts, params: engine._run(all_of(prompts, params), timeout=600.0)


def parse_args():
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if gpu else "cpu", help="cuda or cpu")
    p.add_argument("--model-size", help="train.py's built-in shape; default: 0.5b GPU, tiny CPU")
    p.add_argument("--task", default="chat-sums", help="whose prompts (tasks.TASKS)")
    p.add_argument("--prompts", type=int, default=64, help="prompts a step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per completion (all)")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per lever (median)")
    default = ",".join(LEVERS) if gpu else ",".join(CPU_LEVERS)
    p.add_argument("--levers", default=default, help=f"of {', '.join(LEVERS)}")
    p.add_argument("--bandwidth", type=float, default=4.2e12, help="memory bytes/s")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6, help="GPU share")
    a = p.parse_args()
    a.model_size = a.model_size or ("0.5b" if a.device.startswith("cuda") else "tiny")
    a.levers = [name.strip() for name in a.levers.split(",") if name.strip()]
    unknown = [name for name in a.levers if name not in LEVERS]
    if unknown or a.task not in TASKS:
        p.error(f"unknown: {', '.join(unknown) or a.task}; levers: {', '.join(LEVERS)}")
    return a


def main():
    a = parse_args()
    cfg = train.Config(task=a.task, model_size=a.model_size, device=a.device)
    model, _ = train.builtin_folders(cfg)
    rows = TASKS[a.task].data(a.prompts, 0)
    tok = train.load_tokenizer(model)
    rendered = [
        train.rendered_prompt(row, replace(cfg, model=model), tokenize=True) for row in rows
    ]
    # token ids: a plain prompt comes back as its text
    prompts = [
        tok.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in rendered
    ]
    gpu = a.device.startswith("cuda")
    dtype = "bfloat16" if gpu else "float32"
    weights, kv = bytes_read(model, 2 if gpu else 4)
    print(
        f"workload: {a.prompts} prompts of {a.task} ({statistics.mean(map(len, prompts)):.0f} "
        f"tokens on average) x {a.n} x {a.max_tokens} tokens, the {a.model_size} shape in {dtype}"
        f" ({weights / 2**20:.1f} MiB of weights, {kv} bytes of KV a token), {a.rounds} rounds",
        flush=True,
    )
    lengths = list(map(len, prompts))
    speeds, engine, built = {}, None, None
    try:
        for name in a.levers:
            flags = {"dtype": dtype, **LEVERS[name]}
            request = {k: flags.pop(k) for k in REQUEST_FIELDS if k in flags}
            if gpu:
                flags["gpu_memory_utilization"] = a.gpu_memory_utilization
            # one engine for levers in a row that differ only in their requests' fields; forked
            # engine core and worker where that is safe (engine.Engine: one thread on a CPU)
            if flags != built:
                if engine:
                    engine.shutdown()
                engine, built = SyncEngine(engine_args(model, **flags), fork=True), flags
            settings, rates, per_token = run_lever(name, engine, prompts, a, request)
            seqs = settings["max_num_seqs"]
            limit = bound(lengths, a.n, a.max_tokens, seqs, weights, kv, a.bandwidth)
            speeds[name] = statistics.median(rates)
            print(
                f"{name}: {speeds[name]:.0f} ({min(rates):.0f}-{max(rates):.0f}) tok/s, "
                f"{speeds[name] / limit:.3g} of the bound ({limit:.0f} tok/s)",
                flush=True,
            )
            # a process busy for the whole step is what bounds it
            host = ", ".join(f"{p} {s * 1e6:.1f}" for p, s in per_token.items())
            print(f"{name}: CPU us per completion token: {host}", flush=True)
    finally:
        if engine:
            engine.shutdown()
    for name, speed in speeds.items():
        if "default" in speeds and name != "default":
            print(f"{name.replace(' ', '_')}_vs_default={speed / speeds['default']:.3f}")


if __name__ == "__main__":
    main()
