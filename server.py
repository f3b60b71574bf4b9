"""An HTTP rollout server over the shared engine loop (engine.py).

    python server.py                                  # the built-in tiny model, on 127.0.0.1:8000
    python server.py --model Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16 --port 8000

Endpoints (JSON in, JSON out): generate and rollout answer 202 with a request id at once, and
/get_future collects the result (by id, by identical arguments, or as completed); the weight-sync
routes set up a transport and load versioned updates; /health and /metrics. The README's HTTP
table lists every field. Every mistake of the caller is a 4xx with {"error": message}.
"""

import argparse
import asyncio
import hmac
import itertools
import json
import math
import os
import shlex
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

import prometheus_client as prom
from aiohttp import web
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs

from client import DTYPES, TRANSPORTS, tiny_model, tokenizer_missing
from engine import Engine, RolloutEngine, check_encodable, engine_args

# sampling fields accepted by /generate, named and typed as in vLLM's SamplingParams
SAMPLING_FIELDS = {
    "n": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "max_tokens": int,
    "min_tokens": int,
    "seed": int,
    "logprobs": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "ignore_eos": bool,
    "stop": [str],
    "stop_token_ids": [int],
    "include_stop_str_in_output": bool,
    "skip_special_tokens": bool,
}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class State:
    """What the routes share, besides the engine. `opts` are the server's flags (parse_args)."""

    opts: argparse.Namespace
    # request id -> (asyncio task, its arguments' key), oldest first
    tasks: dict = field(default_factory=dict)
    # ids a /get_future call is waiting for: one caller at a time, or the second finds it fetched
    waiting: set = field(default_factory=set)
    # X-Session-ID -> {"calls": [...], "tokens": recorded or reserved, "started", "used": time}
    sessions: dict = field(default_factory=dict)
    transport: str | None = None  # the weight transport set up by /init_communicator, if any
    engine_died: bool = False  # the server then exits non-zero
    vocab_size: int = 0  # the rest is read from the engine at start
    dtype: str = ""
    workers: int = 1
    weight_spec: dict = field(default_factory=dict)
    gpus: list = field(default_factory=list)


ENGINE = web.AppKey("engine", Engine)
ROLLOUT = web.AppKey("rollout", RolloutEngine)
STATE = web.AppKey("state", State)
METRICS = web.AppKey("metrics", dict)


class ApiError(web.HTTPException):
    """Raised anywhere in a route: answers `status` with {"error": message} (see `errors`)."""

    def __init__(self, status, message):
        self.status_code, self.message = status, message
        super().__init__()


# -- validation: turn a JSON body into engine arguments, or answer 400 -----------------------------
async def read_json(request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"body is not UTF-8 JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object")
    return body


def get(body, name, kind, default=None, low=None, high=None, flag=""):
    """body[name] (or `default`), checked to be a `kind` (for [k]: a list of k) within [low, high],
    or a 400."""
    value = body.get(name, default)
    if isinstance(kind, list):
        if not isinstance(value, list) or not all(
            isinstance(v, kind[0]) and not isinstance(v, bool) for v in value
        ):
            raise ApiError(400, f"'{name}' must be a list of {kind[0].__name__}")
        return value
    # JSON's 1 is a fine float; true is not a number
    kinds = (int, float) if kind is float else kind
    if not isinstance(value, kinds) or (isinstance(value, bool) and kind is not bool):
        raise ApiError(400, f"'{name}' must be {kind.__name__}, got {type(value).__name__}")
    if kind is float and not math.isfinite(value):  # Python's json reads NaN and Infinity
        raise ApiError(400, f"'{name}' must be a finite number")
    if low is not None and not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low} and {high}{flag}")
    return value


def parse_prompts(body, state) -> list:
    prompts, vocab_size = body.get("prompts"), state.vocab_size
    if not isinstance(prompts, list) or not prompts:
        raise ApiError(400, "'prompts' must be a non-empty list of strings or of token-id lists")
    for p in prompts:
        if not (
            isinstance(p, str)
            and p
            or isinstance(p, list)
            and p
            and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in p
            )
        ):
            raise ApiError(
                400,
                f"each prompt must be a non-empty string or a list of token ids "
                f"in [0, {vocab_size}); got {str(p)[:80]}",
            )
    return prompts


def parse_sampling(body, state, extra=()) -> SamplingParams:
    """SamplingParams from the body's fields, within the server's caps, or a 400. Also checks
    "keep_result", which submit() reads."""
    known = {"prompts", "priority", "keep_result", *extra}
    if unknown := sorted(set(body) - set(SAMPLING_FIELDS) - known):
        raise ApiError(
            400, f"unknown fields {unknown}; sampling fields are {sorted(SAMPLING_FIELDS)}"
        )
    get(body, "keep_result", bool, False)
    fields = {k: v for k, v in body.items() if k in SAMPLING_FIELDS}
    for k, v in fields.items():
        if not (k == "stop" and isinstance(v, str)):  # vLLM takes one stop string or a list of them
            get(fields, k, SAMPLING_FIELDS[k])
    opts, n = state.opts, get(fields, "n", int, 1, 1, state.opts.max_n, " (--max-n)")
    get(fields, "max_tokens", int, 16, 1, opts.max_model_len, " (--max-model-len)")
    sequences = n * len(body.get("prompts") or [])
    if sequences > opts.max_request_seqs:
        raise ApiError(
            400,
            f"{sequences} sequences (prompts x n) in one request; "
            f"at most {opts.max_request_seqs} (--max-request-seqs)",
        )
    try:
        params = SamplingParams(**fields)
        # the last guard: what the engine's input thread could not decode never reaches it
        check_encodable(params)
    except Exception as e:  # vLLM's validation errors (their class changes between releases)
        raise ApiError(400, f"invalid sampling parameters: {e}") from None
    return params


def args_key(body) -> str:
    """The identity of a call by its arguments: the same body finds the same request."""
    return json.dumps(
        {k: v for k, v in body.items() if k not in ("request_id", "timeout")}, sort_keys=True
    )


# -- the futures table: request id -> (task, its arguments' key), oldest first ---------------------
def check_room(app, count=1):
    """429 unless `count` more requests fit under --max-pending. Work is checked before it is
    submitted, all of a call's requests at once: a call is taken whole or not at all. (A weight
    update, once announced, is never refused for room.)"""
    if len(app[STATE].tasks) + count > app[STATE].opts.max_pending:
        raise ApiError(429, f"{len(app[STATE].tasks)} results wait unfetched (--max-pending)")


def submit(app, body, work) -> str:
    """Start `work` (a coroutine or task) under a new id, remembering its arguments. Once it is
    done, its result waits --result-ttl seconds to be fetched, then it is dropped; with
    "keep_result" in the body, until it is fetched or aborted (a trainer's queued step)."""
    state = app[STATE]
    request_id, task = uuid.uuid4().hex, asyncio.ensure_future(work)
    state.tasks[request_id] = (task, args_key(body))
    if not body.get("keep_result"):
        task.add_done_callback(
            lambda _: asyncio.get_running_loop().call_later(
                state.opts.result_ttl, expire, app, request_id
            )
        )
    return request_id


def claim(app, body) -> str | None:
    """The oldest request with the identical arguments that no other caller is waiting for, so
    that identical requests are fetched once each."""
    state, key = app[STATE], args_key(body)
    return next(
        (i for i, (_, k) in state.tasks.items() if k == key and i not in state.waiting), None
    )


def forget(app, request_id) -> asyncio.Task:
    """Drop a request (fetched, aborted or expired); returns its task."""
    return app[STATE].tasks.pop(request_id)[0]


def expire(app, request_id):
    if request_id in app[STATE].tasks:
        forget(app, request_id)
        app[METRICS]["expired"].inc()


# -- routes ----------------------------------------------------------------------------------------
async def health(request):
    """200 while the engine can serve; 503 with the reason once it cannot."""
    engine, state = request.app[ENGINE], request.app[STATE]
    return web.json_response(
        {
            "status": "failed" if engine.error else "ok" if engine.gate.is_set() else "updating",
            "error": engine.error,
            "model": engine.args.model,
            "version": engine.version,
            "in_flight": engine.in_flight,
            "pending_results": len(state.tasks),
            "group_port": state.opts.group_port,
            "workers": state.workers,
            "gpus": state.gpus,
            "dtype": state.dtype,
            "transport": state.transport,
            "max_num_seqs": engine.max_num_seqs,
            "max_model_len": state.opts.max_model_len,
            "engine_dead": engine.llm.errored,
            "tools": request.app[ROLLOUT].tool_names,
        },
        status=503 if engine.error else 200,
    )


def check_serving(app):
    if app[ENGINE].error:
        raise ApiError(503, f"engine unusable: {app[ENGINE].error}")


async def when_ready(app, min_version, work):
    """Run `work` (a coroutine function) once weights `min_version` are loaded; the result carries
    when it was queued, started and finished (the server's time.time()), to measure the overlap."""
    queued = time.time()
    await app[ENGINE].wait_for_version(min_version, app[STATE].opts.result_ttl)
    started = time.time()
    result = await work()
    return {**result, "timing": {"queued": queued, "started": started, "finished": time.time()}}


async def counted_generate(app, prompts, params, priority=0):
    """engine.generate, counted in /metrics."""
    results = await app[ENGINE].generate(prompts, params, priority)
    app[METRICS]["requests"].inc()
    app[METRICS]["tokens"].inc(sum(len(c.token_ids) for r in results for c in r))
    return results


async def run_generate(app, prompts, params, priority):
    results = await counted_generate(app, prompts, params, priority)
    # vars: asdict deep-copies, 20x slower
    return {"completions": [[vars(c) for c in r] for r in results]}


async def generate(request):
    check_serving(request.app)
    app, body = request.app, await read_json(request)
    prompts, params = (
        parse_prompts(body, app[STATE]),
        parse_sampling(body, app[STATE], extra=("min_version", "split_prompts")),
    )
    priority, min_version, split = (
        get(body, "priority", int, 0),
        get(body, "min_version", int, 0),
        get(body, "split_prompts", bool, False),
    )
    # split: one request per prompt, in one call, each collected as soon as its own prompt is done
    groups = [[p] for p in prompts] if split else [prompts]
    check_room(app, len(groups))
    ids = [
        submit(
            app,
            {**body, "prompts": ps} if split else body,
            when_ready(app, min_version, lambda ps=ps: run_generate(app, ps, params, priority)),
        )
        for ps in groups
    ]
    return web.json_response({"request_ids": ids} if split else {"request_id": ids[0]}, status=202)


async def run_rollout(app, prompts, params, *options):
    episodes = await app[ROLLOUT].rollout(prompts, params, *options)
    app[METRICS]["requests"].inc()
    app[METRICS]["tokens"].inc(sum(sum(e.loss_mask) for per_prompt in episodes for e in per_prompt))
    return {"episodes": [[vars(e) for e in per_prompt] for per_prompt in episodes]}


async def rollout(request):
    check_serving(request.app)
    app, body = request.app, await read_json(request)
    prompts, state = parse_prompts(body, app[STATE]), app[STATE]
    params = parse_sampling(
        body,
        state,
        extra=("tools", "max_turns", "max_episode_tokens", "call_start", "call_end", "min_version"),
    )
    min_version, max_turns = (
        get(body, "min_version", int, 0),
        get(body, "max_turns", int, 4, 1, 100),
    )
    budget = get(body, "max_episode_tokens", int, 256, 1, state.opts.max_model_len)
    if (tools := body.get("tools")) is not None and not set(get(body, "tools", [str])) <= set(
        app[ROLLOUT].tool_names
    ):
        raise ApiError(
            400, f"'tools' must be a list of registered tool names: {app[ROLLOUT].tool_names}"
        )
    # None: the defaults
    tags = [
        get(body, n, str) if body.get(n) is not None else None for n in ("call_start", "call_end")
    ]
    if "" in tags:
        raise ApiError(400, "'call_start' and 'call_end' must be non-empty strings")
    check_room(app)
    work = when_ready(
        app, min_version, lambda: run_rollout(app, prompts, params, max_turns, budget, tools, *tags)
    )
    return web.json_response({"request_id": submit(app, body, work)}, status=202)


def requested_ids(app, body) -> list:
    """The ids a /get_future body asks for that the server holds: `request_ids`, `request_id`, or
    the oldest request with the identical arguments."""
    if "request_ids" in body:
        ids = get(body, "request_ids", [str])
        if len(set(ids)) < len(ids):
            raise ApiError(400, "'request_ids' lists a request twice")
    else:
        ids = [get(body, "request_id", str) if "request_id" in body else claim(app, body)]
    ids = [i for i in ids if i in app[STATE].tasks]
    if not ids:
        raise ApiError(404, "no such request: unknown, fetched, aborted or expired")
    if not app[STATE].waiting.isdisjoint(ids):
        raise ApiError(409, "another /get_future call is already waiting for this request")
    return ids


async def get_future(request):
    """The result of `request_id`, or of the oldest request with the identical arguments, or
    {"results": [...]} of all of `request_ids` that are done once one is (the trainer takes groups
    in the order they finish); waiting at most `timeout` s."""
    body, state = await read_json(request), request.app[STATE]
    timeout = get(body, "timeout", float, 60, 0, 3600, " seconds")
    ids = requested_ids(request.app, body)
    tasks = {i: state.tasks[i][0] for i in ids}
    # nothing awaited between the check in requested_ids and this
    state.waiting.update(ids)
    try:
        done, _ = await asyncio.wait(
            tasks.values(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        state.waiting.difference_update(ids)
    if not done:
        raise ApiError(
            408,
            f"request {ids[0] if len(ids) == 1 else ids} not finished after {timeout} s; ask again",
        )
    finished = [i for i, task in tasks.items() if task in done]
    for i in finished:  # a failure is answered alone; the others stay to be fetched
        if tasks[i].cancelled() or tasks[i].exception():
            # aborted (perhaps by /abort while we waited), or the engine refused it (e.g. a prompt
            # longer than --max-model-len)
            state.tasks.pop(i, None)
            if tasks[i].cancelled():
                raise ApiError(404, f"request {i} was aborted")
            # a dead engine: its cause, rather than vLLM's "see stack trace (above)"
            error = request.app[ENGINE].error
            raise ApiError(
                503 if error else 422, f"request {i} failed: {error or tasks[i].exception()}"
            )
    results = [{"request_id": i, **forget(request.app, i).result()} for i in finished]
    # by request_ids: every one of them that is done, in one answer (fewer round trips)
    return web.json_response({"results": results} if "request_ids" in body else results[0])


async def abort(request):
    """Cancel a request (its prompts stop generating) and free it."""
    request_id = get(await read_json(request), "request_id", str)
    if request_id not in request.app[STATE].tasks:
        raise ApiError(404, f"no such request {request_id}")
    forget(request.app, request_id).cancel()
    return web.json_response({"aborted": request_id})


async def init_communicator(request):
    """The trainer chooses the transport; the workers follow. ipc: {transport, gpu (its UUID)};
    nccl/gloo: {transport, host, world_size}, the workers join the group the trainer hosts."""
    body = await read_json(request)
    engine, state = request.app[ENGINE], request.app[STATE]
    transport, weight_sync_timeout, workers = (
        body.get("transport", "gloo"),
        state.opts.weight_sync_timeout,
        state.workers,
    )
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise ApiError(400, f"'transport' must be one of {list(TRANSPORTS)}")
    if transport != "gloo" and not any(state.gpus):
        raise ApiError(
            400, f"transport {transport} needs a server on GPUs; this one runs on the CPU: use gloo"
        )
    if transport == "ipc":
        if get(body, "gpu", str) not in state.gpus or workers != 1:
            raise ApiError(
                400,
                f"ipc needs the trainer on the GPU of a one-GPU server; "
                f"the server's are {state.gpus}, the trainer's is {body['gpu']}: use nccl",
            )
        host, world_size = None, None
    else:
        host, world_size = get(body, "host", str), get(body, "world_size", int)
        if world_size != 1 + workers:
            raise ApiError(
                400, f"world_size must be 1 (trainer) + {workers} (server workers) = {1 + workers}"
            )
    try:
        await engine.rpc(
            "init_communicator",
            transport,
            host,
            state.opts.group_port,
            world_size,
            weight_sync_timeout,
            timeout=weight_sync_timeout + 10,
        )
    except Exception as e:
        raise ApiError(
            504,
            f"could not set up {transport} weight sync "
            f"(group at {host}:{state.opts.group_port}): {e!r}",
        ) from None
    state.transport = transport
    return web.json_response({"dtype": state.dtype, "params": state.weight_spec})


IPC_HANDLE = {
    "offset": int,
    "device": int,
    "handle": str,
    "storage_bytes": int,
    "storage_offset": int,
    "ref": str,
    "ref_offset": int,
    "event": (str, type(None)),
    "event_sync": bool,
    "gpu": str,
}


def check_buckets(buckets, spec, dtype, transport):
    """Reject an update announcement before anything is received or loaded."""
    if not isinstance(buckets, list) or not buckets:
        raise ApiError(400, "'buckets' must be a non-empty list of {size, params}")
    seen = set()
    for b in buckets:
        if (
            not isinstance(b, dict)
            or not isinstance(b.get("size"), int)
            or not isinstance(b.get("params"), list)
        ):
            raise ApiError(
                400, "each bucket must be {size: int, params: [{name, dtype, shape, offset}]}"
            )
        end = 0  # tensors lie in the bucket in order, without overlapping
        for p in b["params"]:
            if (
                not isinstance(p, dict)
                or set(p) != {"name", "dtype", "shape", "offset"}
                or not isinstance(p["name"], str)
            ):
                raise ApiError(400, "each param must be {name: str, dtype, shape, offset}")
            name = p["name"]
            if name not in spec or name in seen:
                raise ApiError(
                    400, f"{'unknown' if name not in spec else 'repeated'} parameter '{name}'"
                )
            seen.add(name)
            if p["shape"] != spec[name] or p["dtype"] != dtype:
                raise ApiError(
                    400,
                    f"'{name}' has shape {p['shape']} and dtype {p['dtype']}; "
                    f"the server's are {spec[name]} and {dtype}",
                )
            nbytes = DTYPES[dtype].itemsize * math.prod(p["shape"])
            if (
                not isinstance(p["offset"], int)
                or p["offset"] < end
                or p["offset"] % 16
                or p["offset"] + nbytes > b["size"]
            ):
                raise ApiError(
                    400,
                    f"'{name}' at offset {p['offset']} overlaps or does not fit "
                    f"its bucket of {b['size']} bytes",
                )
            end = p["offset"] + nbytes
        handle = b.get("handle")
        if (
            (handle is not None) != (transport == "ipc")
            or handle is not None
            and (
                not isinstance(handle, dict)
                or set(handle) != set(IPC_HANDLE)
                or not all(isinstance(handle[k], kind) for k, kind in IPC_HANDLE.items())
            )
        ):
            raise ApiError(
                400,
                f"with ipc each bucket carries a 'handle' {{{', '.join(IPC_HANDLE)}}} "
                "as client.share_cuda makes it; with nccl and gloo none",
            )
    # vLLM reloads whole (fused) layers: a partial update would load garbage
    if missing := sorted(set(spec) - seen):
        raise ApiError(
            400, f"an update must carry every parameter; missing {len(missing)}: {missing[:5]}"
        )


async def update_weights(request):
    """One weight update in one call (body: buckets, and a `mode`: "drain", the default, or
    "in-flight", see Engine.update_weights), answered as two JSON lines: {"receiving": true} once
    the workers receive (only then does the trainer send: a long drain cannot time its sends out),
    then {"version", "receive_s", "load_s"} once loaded, or {"error", "status"}. An update is no
    entry of the futures table: once its workers receive, nothing cancels it (no /abort, no full
    table, no dropped connection), and it ends as Engine.load says: the version bumped; the old
    weights and version kept (status 502: the transfer failed; set up weight sync again); or the
    server exiting non-zero (500: a failed load may have mixed the weights). Before the first line:
    400 for a wrong announcement, 409 without weight sync, 503 for a drain longer than
    --drain-timeout (nothing was sent: try again)."""
    body = await read_json(request)
    engine, state = request.app[ENGINE], request.app[STATE]
    check_buckets(body.get("buckets"), state.weight_spec, state.dtype, state.transport)
    mode = body.get("mode", "drain")
    if mode not in ("drain", "in-flight"):
        raise ApiError(400, "'mode' must be 'drain' or 'in-flight' (see Engine.update_weights)")
    # the version the new weights get, if higher than the next one: a trainer keeps several
    # servers on one numbering, one of them restarted (its count began again at 0)
    version = get(body, "version", int, 0, 0, 2**53)
    if not state.transport:
        raise ApiError(409, "no weight sync set up: call /init_communicator first")
    ready = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(run_update(request.app, body["buckets"], mode, ready, version))
    await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
    # failed before the workers were told to receive: nothing was sent or changed
    if not ready.done():
        raise ApiError(
            503, f"weight update refused, version {engine.version} kept: {task.exception()}"
        )
    answer = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await answer.prepare(request)
    await answer.write(b'{"receiving": true}\n')
    # asyncio.wait never cancels the task, even when this call is cancelled
    await asyncio.wait([task])
    error = task.exception()
    result = (
        {"error": str(error), "status": 500 if engine.error else 502} if error else task.result()
    )
    await answer.write(json.dumps(result).encode() + b"\n")
    return answer


async def run_update(app, buckets, mode, ready, version):
    engine, state, opts, start = app[ENGINE], app[STATE], app[STATE].opts, time.perf_counter()
    try:
        version, timings = await engine.update_weights(
            buckets, ready, mode, opts.weight_sync_timeout, opts.drain_timeout, version
        )
    except Exception as e:
        if engine.error:
            raise RuntimeError(f"weight update failed; the server exits: {engine.error}") from None
        if not ready.done():
            raise
        state.transport = None  # the workers left the group
        raise RuntimeError(
            f"weight update failed, version {engine.version} kept: {e!r}; "
            "call /init_communicator again"
        ) from None
    app[METRICS]["sync_seconds"].observe(time.perf_counter() - start)
    app[METRICS]["version"].set(version)
    return {"version": version, **timings}


async def close_communicator(request):
    await request.app[ENGINE].rpc("close_communicator")
    request.app[STATE].transport = None
    return web.json_response({"status": "closed"})


async def metrics(request):
    return web.Response(
        body=prom.generate_latest(request.app[METRICS]["registry"]),
        headers={"Content-Type": prom.CONTENT_TYPE_LATEST},
    )


# -- the OpenAI-compatible face: /v1/models, /v1/completions, /v1/chat/completions,
# /v1/sessions/<id>. --- Every answer carries its tokens (prompt_token_ids; per choice token_ids)
# and weight_version, and calls sent with an X-Session-ID header are recorded, so that an agent
# written against the OpenAI client can be trained on exactly what it sampled.
OPENAI_SAMPLING = {
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
}
OPENAI_OTHER = {
    "model",
    "messages",
    "prompt",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "stream",
    "user",
}


async def models(request):
    return web.json_response(
        {
            "object": "list",
            "data": [
                {"id": request.app[ENGINE].args.model, "object": "model", "owned_by": "async-grpo"}
            ],
        }
    )


def chat_prompt(engine, body) -> list[int]:
    """The token ids of the body's `messages` under the model's chat template, or a 400."""
    messages = get(body, "messages", [dict])
    if not messages or not all(
        isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ApiError(
            400, "'messages' must be a non-empty list of {role, content} with string content"
        )
    try:
        text = engine.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # no template, or one that refuses these roles
        raise ApiError(
            400, f"the model's chat template cannot render these messages: {e}"
        ) from None
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def openai_completion(request):
    """/v1/completions and /v1/chat/completions: OpenAI's request and response shapes."""
    check_serving(request.app)
    body, state, engine = await read_json(request), request.app[STATE], request.app[ENGINE]
    chat = request.path.endswith("chat/completions")
    if unknown := sorted(set(body) - OPENAI_SAMPLING - OPENAI_OTHER):
        raise ApiError(400, f"unsupported fields {unknown}")
    if body.get("model") != engine.args.model:
        raise ApiError(
            404,
            f"model {body.get('model')!r} does not exist; "
            f"this server serves {engine.args.model!r} (see /v1/models)",
        )
    if chat:
        prompt = chat_prompt(engine, body)
    else:
        # one prompt: a string or token ids
        [prompt] = parse_prompts({"prompts": [body.get("prompt")]}, state)
        prompt = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    fields = {k: v for k, v in body.items() if k in OPENAI_SAMPLING}
    # chat: as long as the model allows
    default_max_tokens = max(1, state.opts.max_model_len - len(prompt)) if chat else 16
    max_tokens = fields.get("max_tokens", default_max_tokens)
    fields["max_tokens"] = body.get("max_completion_tokens", max_tokens)
    # OpenAI's clients may send null for "not set"
    given = {k: v for k, v in body.items() if v is not None}
    # chat: a flag; completions: the k
    logprobs = get(given, "logprobs", bool if chat else int, False if chat else 0)
    top = get(given if chat else {"top_logprobs": logprobs}, "top_logprobs", int, 0, 0, 20)
    params = parse_sampling({**fields, "logprobs": top, "prompts": [prompt]}, state)
    stream = get(body, "stream", bool, False)
    session_id, completions = request.headers.get("X-Session-ID"), []
    # room for every choice, each recorded with its prompt
    reserved = params.n * (len(prompt) + params.max_tokens)
    recording = open_session(request.app, session_id, reserved) if session_id else None
    try:
        [completions] = await counted_generate(request.app, [prompt], params)
    except Exception as e:  # the engine refused it (e.g. a prompt longer than --max-model-len)
        error = engine.error
        raise ApiError(
            503 if error else 400, f"the engine refused the request: {error or e}"
        ) from None
    finally:
        # a session's calls are recorded in the order they finish; a failed call frees its room
        if recording:
            record(recording, prompt, completions, reserved)
    answer = openai_answer(engine, chat, prompt, completions, bool(logprobs), top)
    return openai_events(answer, chat) if stream else web.json_response(answer)


def openai_events(answer, chat):
    """`answer` as server-sent events. The engine hands over finished requests: one event per
    choice, all at once."""
    for choice in answer["choices"]:
        if chat:
            choice["delta"] = choice.pop("message")
    kind = "chat.completion.chunk" if chat else "text_completion"
    events = "".join(
        f"data: {json.dumps({**answer, 'object': kind, 'choices': [c]})}\n\n"
        for c in answer["choices"]
    )
    return web.Response(
        text=events + "data: [DONE]\n\n",
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


def openai_answer(engine, chat, prompt, completions, logprobs, top):
    decode = lambda ids: [engine.tokenizer.decode([t]) for t in ids]  # noqa: E731
    choices = []
    for i, c in enumerate(completions):
        tokens, alternatives = decode(c.token_ids), c.top_logprobs or [[] for _ in c.token_ids]
        choice = {
            "index": i,
            "finish_reason": c.finish_reason,
            "token_ids": c.token_ids,
            "weight_version": c.version,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
            choice["logprobs"] = (
                {
                    "content": [
                        {"token": t, "logprob": lp, "top_logprobs": alt}
                        for t, lp, alt in zip(tokens, c.logprobs, alternatives)
                    ]
                }
                if logprobs
                else None
            )
        else:
            choice["text"] = c.text
            choice["logprobs"] = (
                {
                    "tokens": tokens,
                    "token_logprobs": c.logprobs,
                    "text_offset": list(itertools.accumulate(map(len, tokens), initial=0))[:-1],
                    "top_logprobs": [
                        {a["token"]: a["logprob"] for a in alt} for alt in alternatives
                    ],
                }
                if logprobs
                else None
            )
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": engine.args.model,
        "choices": choices,
        "prompt_token_ids": prompt,
        "weight_version": completions[0].version,
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens,
        },
    }


def open_session(app, session_id, reserve):
    """The X-Session-ID session (made if new) with room reserved for `reserve` more tokens, or a
    429: at most --max-pending sessions, --max-session-tokens in one, --max-total-session-tokens in
    all. Nothing is awaited between the checks and the reservation, so concurrent calls cannot
    pass a bound together."""
    state, opts, now = app[STATE], app[STATE].opts, time.monotonic()
    expire_sessions(state)
    session = state.sessions.get(session_id, {"calls": [], "tokens": 0, "started": now})
    total = sum(s["tokens"] for s in state.sessions.values())
    if (
        (session_id not in state.sessions and len(state.sessions) >= opts.max_pending)
        or session["tokens"] + reserve > opts.max_session_tokens
        or total + reserve > opts.max_total_session_tokens
    ):
        raise ApiError(
            429,
            f"{len(state.sessions)} sessions are open (--max-pending) holding {total} tokens "
            f"(--max-total-session-tokens); session {session_id!r} holds {session['tokens']} "
            f"(--max-session-tokens), and this call may add {reserve}: delete some",
        )
    session["tokens"] += reserve
    session["used"] = now
    state.sessions[session_id] = session
    return session


def expire_sessions(state):
    """Drop the sessions unused for --result-ttl s, or begun --max-session-age s ago."""
    now, opts = time.monotonic(), state.opts
    for session_id, s in list(state.sessions.items()):
        if min(s["used"] + opts.result_ttl, s["started"] + opts.max_session_age) < now:
            del state.sessions[session_id]


def record(session, prompt, completions, reserved):
    """Append a call's choices to its session, in place of the `reserved` tokens."""
    session["calls"] += [
        {
            "prompt_token_ids": prompt,
            "completion_token_ids": c.token_ids,
            "logprobs": c.logprobs,
            "weight_version": c.version,
            "text": c.text,
            "finish_reason": c.finish_reason,
        }
        for c in completions
    ]
    session["tokens"] += sum(len(prompt) + len(c.token_ids) for c in completions) - reserved
    session["used"] = time.monotonic()


def merge(calls):
    """One episode from a session's calls, if each call's prompt continues the previous call's
    prompt and completion token for token (else None and why): the tokens between are prompt (a
    tool's output, the chat template's), the completions are sampled; the shape of a /rollout
    episode."""
    if not calls:
        return None, "no call of this session has finished yet"
    ids, mask, logprobs, turns = [], [], [], []
    for i, call in enumerate(calls):
        prompt, sampled = call["prompt_token_ids"], call["completion_token_ids"]
        if prompt[: len(ids)] != ids:
            return None, (
                f"call {i}'s prompt does not continue the tokens before it "
                "(re-tokenised text, or a call with n > 1): train on 'calls' instead"
            )
        new = prompt[len(ids) :]
        ids = ids + new + sampled
        mask = mask + [0] * len(new) + [1] * len(sampled)
        logprobs = logprobs + [None] * len(new) + call["logprobs"]
        turns.append(
            {
                "text": call["text"],
                "version": call["weight_version"],
                "finish_reason": call["finish_reason"],
            }
        )
    return {
        "token_ids": ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "turns": turns,
        "tool_calls": [],
        "finish_reason": turns[-1]["finish_reason"],
    }, None


async def session(request):
    sessions, session_id = request.app[STATE].sessions, request.match_info["session_id"]
    expire_sessions(request.app[STATE])
    if session_id not in sessions:
        raise ApiError(404, f"no session {session_id!r} (never used, deleted or expired)")
    if request.method == "DELETE":
        sessions.pop(session_id)
        return web.json_response({"deleted": session_id})
    episode, reason = merge(calls := sessions[session_id]["calls"])
    return web.json_response({"calls": calls, "episode": episode, "reason": reason})


# -- the app ---------------------------------------------------------------------------------------
@web.middleware
async def errors(request, handler):
    """Every error, ours and aiohttp's (413 too large, 405, 404 route), as JSON {"error": message};
    on the /v1 routes in OpenAI's shape, {"error": {"message", "type", "param", "code"}}."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        message = (
            e.message
            if isinstance(e, ApiError)
            else e.reason
            if not e.text or e.text.startswith(str(e.status))
            else e.text
        )
        if request.path.startswith("/v1/"):
            message = {
                "message": message,
                "type": "invalid_request_error" if e.status < 500 else "server_error",
                "param": None,
                "code": e.status,
            }
        # a dead engine core does not come back in this process: not a busy or restarting server
        dead = e.status == 503 and request.app[ENGINE].llm.errored
        return web.json_response({"error": message, "engine_dead": dead}, status=e.status)


@web.middleware
async def check_key(request, handler):
    """With --api-key, every route but /health and /metrics needs `Authorization: Bearer <key>`."""
    key = request.app[STATE].opts.api_key
    # bytes: compare_digest refuses a str with non-ASCII characters (a 500, not a 401)
    sent = request.headers.get("Authorization", "").encode(errors="surrogateescape")
    if (
        key
        and request.path not in ("/health", "/metrics")
        and not hmac.compare_digest(sent, f"Bearer {key}".encode())
    ):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
    return await handler(request)


def make_metrics():
    registry = prom.CollectorRegistry()
    return {
        "registry": registry,
        "requests": prom.Counter(
            "asyncgrpo_requests", "Finished generate/rollout calls", registry=registry
        ),
        "tokens": prom.Counter(
            "asyncgrpo_completion_tokens", "Completion tokens generated", registry=registry
        ),
        "in_flight": prom.Gauge(
            "asyncgrpo_in_flight", "Prompts being generated", registry=registry
        ),
        "pending": prom.Gauge(
            "asyncgrpo_pending_results", "Requests submitted and not yet fetched", registry=registry
        ),
        "expired": prom.Counter(
            "asyncgrpo_expired_results",
            "Results dropped unfetched after --result-ttl",
            registry=registry,
        ),
        "version": prom.Gauge(
            "asyncgrpo_weight_version", "Current weight version", registry=registry
        ),
        "sync_seconds": prom.Histogram(
            "asyncgrpo_weight_sync_seconds", "Seconds per weight update", registry=registry
        ),
    }


async def watch_engine(app):
    """Stop the server when the engine cannot serve any more (vLLM's engine core is gone for good,
    or a weight update failed while loading), so that it exits non-zero and a supervisor restarts
    it. AsyncLLM only exposes this as a flag, hence the check every second."""
    while not app[ENGINE].error:
        await asyncio.sleep(1)
    print(f"engine failed: {app[ENGINE].error}; stopping the server", file=sys.stderr, flush=True)
    app[STATE].engine_died = True
    os.kill(os.getpid(), signal.SIGTERM)  # aiohttp's run_app shuts down gracefully on SIGTERM


def make_app(args, opts) -> web.Application:
    """The server for AsyncEngineArgs `args` and flags `opts` (parse_args): the engine starts with
    the app and stops with it."""
    app = web.Application(client_max_size=opts.max_body_mb << 20, middlewares=[errors, check_key])
    app[STATE] = state = State(opts)
    app[METRICS] = make_metrics()

    async def engine_ctx(app):
        app[ENGINE] = engine = Engine(args)
        try:
            await engine.warm_up()  # /health answers only once the engine has generated
        except Exception as e:
            engine.llm.shutdown()
            sys.exit(f"error: the warm-up generation failed: {engine.error or repr(e)}")
        # the longest prompt + completion: --max-model-len, or what the engine derived
        opts.max_model_len = engine.llm.model_config.max_model_len
        # read when /metrics is scraped
        app[METRICS]["in_flight"].set_function(lambda: engine.in_flight)
        app[METRICS]["pending"].set_function(lambda: len(state.tasks))
        state.vocab_size = engine.llm.model_config.get_vocab_size()
        state.dtype = str(engine.llm.model_config.dtype).removeprefix("torch.")
        state.workers = args.tensor_parallel_size * args.data_parallel_size
        state.weight_spec = (await engine.rpc("weight_spec"))[0]
        state.gpus = await engine.rpc("gpu_uuid")  # the workers' GPU UUIDs (None on CPU)
        app[ROLLOUT] = RolloutEngine(engine, tool_timeout=opts.tool_timeout)
        for command in opts.mcp_server:
            await app[ROLLOUT].add_mcp_server(*shlex.split(command))
        watcher = asyncio.ensure_future(watch_engine(app))
        yield
        watcher.cancel()
        for task, _ in state.tasks.values():
            task.cancel()
        await app[ROLLOUT].close()
        engine.llm.shutdown()

    app.cleanup_ctx.append(engine_ctx)
    app.add_routes(ROUTES)
    return app


ROUTES = [
    web.get("/health", health),
    web.post("/generate", generate),
    web.post("/rollout", rollout),
    web.post("/get_future", get_future),
    web.post("/abort", abort),
    web.post("/init_communicator", init_communicator),
    web.post("/update_weights", update_weights),
    web.post("/close_communicator", close_communicator),
    web.get("/metrics", metrics),
    web.get("/v1/models", models),
    web.post("/v1/completions", openai_completion),
    web.post("/v1/chat/completions", openai_completion),
    web.get("/v1/sessions/{session_id}", session),
    web.delete("/v1/sessions/{session_id}", session),
]


def add_engine_flags(g):
    """The engine's flags, named as in `vllm serve`."""
    g.add_argument(
        "--model",
        default=None,
        help="HF model folder or hub id (default: the built-in tiny model, built on first use)",
    )
    g.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="weight dtype; trainer updates must match it",
    )
    # the model's own length, capped to what the KV cache holds (vLLM's log says so; /health and
    # every 400 for a too long request give the length in use)
    g.add_argument(
        "--max-model-len", type=int, help="longest prompt + completion (default: the model's own)"
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for vLLM (GPU only)",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (default on CPU: 256 MiB)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences decoded at once (vLLM's default if unset)",
    )
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per model replica")
    g.add_argument("--data-parallel-size", type=int, default=1, help="model replicas")
    g.add_argument("--seed", type=int, default=0, help="engine seed")
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        help="skip compilation (default: on CPU only)",
    )


def add_http_flags(g):
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (another than loopback needs --api-key)",
    )
    g.add_argument("--port", type=int, default=8000, help="HTTP port")
    g.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="required by all but /health, /metrics ($VLLM_API_KEY)",
    )


def add_limit_flags(g):
    """Bounds on what callers may ask for and leave behind; beyond them a 400 or 429."""
    g.add_argument(
        "--max-n",
        type=int,
        default=256,
        help="largest n (completions per prompt) a request may ask for",
    )
    g.add_argument(
        "--max-request-seqs",
        type=int,
        default=16384,
        help="most sequences (prompts x n) in one request",
    )
    g.add_argument(
        "--max-pending",
        type=int,
        default=10000,
        help="most requests submitted and not yet fetched; beyond it 429",
    )
    g.add_argument(
        "--result-ttl",
        type=float,
        default=600.0,
        help="seconds a finished result waits to be fetched before it is dropped",
    )
    g.add_argument("--max-body-mb", type=int, default=16, help="largest request body, in MiB")
    # sessions: the OpenAI routes record the calls sent with an X-Session-ID header (each call's
    # prompt and completions: its tokens); beyond these bounds a call is a 429. A session ends
    # when deleted, --result-ttl s after its last call, or --max-session-age s after its first.
    g.add_argument(
        "--max-session-tokens", type=int, default=10**6, help="most tokens in one session"
    )
    g.add_argument(
        "--max-total-session-tokens", type=int, default=10**7, help="most tokens in all sessions"
    )
    g.add_argument(
        "--max-session-age", type=float, default=3600.0, help="seconds a session may last"
    )


def add_sync_flags(g):
    g.add_argument(
        "--group-port",
        type=int,
        default=51216,
        help="port of the trainer's weight-sync group (NCCL/gloo)",
    )
    g.add_argument(
        "--weight-sync-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the trainer while joining the group or receiving a bucket; "
        "on timeout the update fails and the old weights and version stay",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds an update waits for requests in flight to "
        "finish; then it is refused (503) before anything is sent",
    )


def add_tool_flags(g):
    g.add_argument(
        "--mcp-server",
        action="append",
        default=[],
        metavar="COMMAND",
        help="an MCP server to start over stdio, whose tools /rollout may call "
        "(repeatable; 'calc' is built in), e.g. 'python tests/mcp_server.py'",
    )
    g.add_argument(
        "--tool-timeout",
        type=float,
        default=10.0,
        help="seconds a tool call may take before it answers with an error",
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="async-grpo rollout server: vLLM behind an async HTTP API."
    )
    add_engine_flags(p.add_argument_group("engine (named as in vllm serve)"))
    add_http_flags(p.add_argument_group("HTTP"))
    add_limit_flags(p.add_argument_group("limits"))
    add_sync_flags(p.add_argument_group("weight sync"))
    add_tool_flags(p.add_argument_group("tools"))
    a = p.parse_args(argv)
    if tokenizer_missing(a.model):
        p.error(tokenizer_missing(a.model))
    if a.host not in LOOPBACK and not a.api_key:
        p.error(
            f"--host {a.host} exposes the server beyond this machine: "
            "set --api-key (or VLLM_API_KEY) so that nobody else can generate or push weights"
        )
    return a


def main(argv=None):
    a = parse_args(argv)
    # named alike
    engine_flags = {k: v for k, v in vars(a).items() if k in AsyncEngineArgs.__dataclass_fields__}
    app = make_app(engine_args(**engine_flags | {"model": a.model or tiny_model()}), a)
    web.run_app(app, host=a.host, port=a.port, print=lambda msg: print(msg, flush=True))
    if app[STATE].engine_died:
        sys.exit("the engine died; see the log above")


if __name__ == "__main__":
    main()
