"""An HTTP rollout server over the shared engine loop (engine.py).

    python server.py                                  # the built-in tiny model, on 127.0.0.1:8000
    python server.py --model Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16 --port 8000

Endpoints (JSON in, JSON out): generate and rollout answer 202 with a request id at once, and
/get_future collects the result (by id, by identical arguments, or as completed); the weight-sync
routes set up a transport and load versioned updates (/update_adapter: a LoRA adapter, with
--enable-lora); /health and /metrics; /reset_prefix_cache (TRL's); the OpenAI-compatible /v1
routes (their answers and sessions: openai_face.py). docs/http.md lists every field. Every
mistake of the caller is a 4xx with {"error": message}.
"""

import argparse
import asyncio
import base64
import functools
import hashlib
import hmac
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import time
import uuid
from contextlib import AsyncExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from huggingface_hub import snapshot_download
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager

from client import DTYPES, TRANSPORTS, fingerprint, from_base64, load_function, model_error
from engine import Engine, EpisodeOptions, RolloutEngine, check_encodable, engine_args, openai_tool
from local import tiny_model
from openai_face import expire_sessions, merge, open_session, openai_answer, openai_events, record

# sampling fields accepted by /generate, named and typed as in vLLM's SamplingParams, by type
SAMPLING_FIELDS = dict.fromkeys(["n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs"], int)
SAMPLING_FIELDS |= dict.fromkeys(["temperature", "top_p", "min_p", "repetition_penalty"], float)
SAMPLING_FIELDS |= dict.fromkeys(["presence_penalty", "frequency_penalty"], float)
SAMPLING_FIELDS |= dict.fromkeys(["ignore_eos", "include_stop_str_in_output"], bool)
SAMPLING_FIELDS |= {"skip_special_tokens": bool, "stop": [str], "stop_token_ids": [int]}
# the fields of /generate and /rollout besides the sampling ones: read by add_request() and the
# routes (/rollout's: EpisodeOptions')
REQUEST_FIELDS = ("prompts", "priority", "min_version", "max_version", "keep_result")
ROLLOUT_FIELDS = tuple(EpisodeOptions.__dataclass_fields__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# vLLM's OpenAI server takes its sampling fields too (top_k, min_p, ignore_eos, ...); `logprobs`
# means something else in OpenAI's shape
OPENAI_SAMPLING = set(SAMPLING_FIELDS) - {"logprobs"}
# the other fields: what to complete and how to answer, logprobs in OpenAI's shape, functions
OPENAI_OTHER = {"model", "messages", "prompt", "max_completion_tokens", "stream", "user"}
OPENAI_OTHER |= {"logprobs", "top_logprobs", "tools", "tool_choice"}

# /metrics: prometheus_client's default registry, served by its own aiohttp handler (the gauges
# are read from the engine when scraped: make_app)
REQUESTS = Counter("asyncgrpo_requests", "Finished generate/rollout calls")
COMPLETION_TOKENS = Counter("asyncgrpo_completion_tokens", "Completion tokens generated")
IN_FLIGHT = Gauge("asyncgrpo_in_flight", "Prompts being generated")
PENDING_RESULTS = Gauge("asyncgrpo_pending_results", "Requests submitted and not yet fetched")
EXPIRED_RESULTS = Counter("asyncgrpo_expired_results", "Results dropped unfetched (--result-ttl)")
WEIGHT_VERSION = Gauge("asyncgrpo_weight_version", "Current weight version")
SYNC_SECONDS = Histogram("asyncgrpo_weight_sync_seconds", "Seconds per weight update")


@dataclass
class State:
    """What the routes share, besides the engine. `flags` are the server's flags (parse_args)."""

    flags: argparse.Namespace
    # request id -> (asyncio task, its arguments' key, its body's bytes), oldest first
    tasks: dict = field(default_factory=dict)
    # the bytes of the bodies held (by `tasks` and the /v1 calls in progress), and those calls
    held_bytes: int = 0
    openai_calls: int = 0
    # when a /get_future call last began or ended (time.monotonic()): kept results expire after
    # --result-ttl s without one
    last_fetch: float = field(default_factory=time.monotonic)
    # ids a /get_future call is waiting for: one caller at a time, or the second finds it fetched
    waiting: set = field(default_factory=set)
    # X-Session-ID -> {"calls": [...], "tokens": recorded or reserved, "started", "used": time}
    sessions: dict = field(default_factory=dict)
    # the weight transport set up by /init_communicator, if any
    transport: str | None = None
    # the version the last update made and its buckets (same_layout)
    layout: tuple = (None, [])
    # client.fingerprint of the base weights served: the checkpoint's, then each full update's
    fingerprint: str | None = None
    # the server then exits non-zero
    engine_died: bool = False
    # --tool-call-parser's vLLM ToolParser class, given the tokenizer: parser(tools)
    tool_parser: functools.partial | None = None
    # the rest is read from the engine at start
    vocab_size: int = 0
    dtype: str = ""
    workers: int = 1
    weight_spec: dict = field(default_factory=dict)
    gpus: list = field(default_factory=list)


ENGINE = web.AppKey("engine", Engine)
ROLLOUT = web.AppKey("rollout", RolloutEngine)
STATE = web.AppKey("state", State)
# the --mcp servers' tools: ({name: function}, {name: OpenAI schema}, [MCPServer])
MCP = web.AppKey("mcp", tuple)


class ApiError(web.HTTPException):
    """Raised anywhere in a route: answers `status` with {"error": message} (see `errors`)."""

    def __init__(self, message, status=400):
        # aiohttp's HTTPException reads its status from the class; ours is per instance
        self.status_code = status
        super().__init__(text=message)


# -- validation: turn a JSON body into engine arguments, or answer 400 -----------------------------
@contextmanager
def refused_as(message):
    """Whatever the block raises (vLLM's, transformers' or a decoder's error) as a 400
    "message: error"."""
    try:
        yield
    except Exception as e:
        raise ApiError(f"{message}: {e}") from None


async def read_json(request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"body is not UTF-8 JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("body must be a JSON object")
    return body


def checked_field(body, name, value_type, default=None, low=None, high=None, flag=""):
    """body[name] (or `default`), checked to be a `value_type` (for [t]: a list of t) within
    [low, high], or a 400. JSON's true is no number, and its 1 is a fine float."""
    value = body.get(name, default)
    if isinstance(value_type, list):
        if not isinstance(value, list) or not all(json_isinstance(v, value_type[0]) for v in value):
            raise ApiError(f"'{name}' must be a list of {value_type[0].__name__}")
        return value
    if not json_isinstance(value, value_type):
        raise ApiError(f"'{name}' must be {value_type.__name__}, got {type(value).__name__}")
    # Python's json reads NaN and Infinity
    if value_type is float and not math.isfinite(value):
        raise ApiError(f"'{name}' must be a finite number")
    if low is not None and not low <= value <= high:
        raise ApiError(f"'{name}' must be between {low} and {high}{flag}")
    return value


def json_isinstance(value, value_type) -> bool:
    """isinstance as JSON means it: a bool is no number, an int is a float."""
    if isinstance(value, bool):
        return value_type is bool
    return isinstance(value, (int, float) if value_type is float else value_type)


def parse_prompts(body, state) -> list:
    """body["prompts"]: a non-empty list of non-empty strings or token-id lists, or a 400."""
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise ApiError("'prompts' must be a non-empty list of strings or of token-id lists")
    for prompt in prompts:
        token_ids = isinstance(prompt, list) and all(
            json_isinstance(t, int) and 0 <= t < state.vocab_size for t in prompt
        )
        if not prompt or not (isinstance(prompt, str) or token_ids):
            raise ApiError(
                f"each prompt must be a non-empty string or a list of token ids "
                f"in [0, {state.vocab_size}); got {str(prompt)[:80]}"
            )
    return prompts


def chat_prompt(engine, body) -> list[int]:
    """The token ids of the body's `messages` and `tools` under the model's chat template, or a
    400. A tool call's `arguments`, a JSON string in OpenAI's shape, is rendered as the object it
    holds, as vLLM's server renders it."""
    messages = checked_field(body, "messages", [dict])
    if not messages or not all(
        isinstance(m.get("role"), str) and (isinstance(m.get("content"), str) or "tool_calls" in m)
        for m in messages
    ):
        raise ApiError("'messages' must be a non-empty list of {role, content (a string)}")
    # no template, one that refuses these roles, or tool calls that are not OpenAI's
    with refused_as("the model's chat template cannot render these messages"):
        # a copy, JSON's as it came: the caller's body stays as sent (args_key finds it by that)
        messages = json.loads(json.dumps(messages))
        for m in messages:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        text = engine.tokenizer.apply_chat_template(
            messages, tools=body.get("tools"), tokenize=False, add_generation_prompt=True
        )
    return engine.tokenizer.encode(text, add_special_tokens=False)


def parse_sampling(body, state, extra=()) -> SamplingParams:
    """SamplingParams from the body's fields, within the server's caps, or a 400. `extra` names
    the other fields the body may have."""
    unknown = sorted(set(body) - set(SAMPLING_FIELDS) - {"prompts", *extra})
    if unknown:
        raise ApiError(f"unknown fields {unknown}; sampling fields are {sorted(SAMPLING_FIELDS)}")
    fields = {k: v for k, v in body.items() if k in SAMPLING_FIELDS}
    for name, value in fields.items():
        # vLLM takes one stop string or a list of them
        if not (name == "stop" and isinstance(value, str)):
            checked_field(fields, name, SAMPLING_FIELDS[name])
    flags = state.flags
    n = checked_field(fields, "n", int, 1, 1, flags.max_n, " (--max-n)")
    checked_field(fields, "max_tokens", int, 16, 1, flags.max_model_len, " (--max-model-len)")
    # vLLM's max_logprobs, which it checks only once the request runs
    checked_field(fields, "logprobs", int, 0, 0, 20)
    sequences = n * len(body.get("prompts") or [])
    if sequences > flags.max_request_seqs:
        raise ApiError(
            f"{sequences} sequences (prompts x n) in one request; "
            f"at most {flags.max_request_seqs} (--max-request-seqs)"
        )
    # vLLM seeds choice i with seed + i, which must fit the engine core's uint64
    if isinstance(fields.get("seed"), int) and fields["seed"] + n > 2**64:
        raise ApiError("'seed' + n must be at most 2**64 (vLLM seeds choice i with seed + i)")
    # vLLM's validation errors (their class changes between releases)
    with refused_as("invalid sampling parameters"):
        params = SamplingParams(**fields)
        # the last guard: what the engine's input thread could not decode never reaches it
        check_encodable(params)
    return params


def parse_request(app, body, extra) -> tuple[list, SamplingParams]:
    """The prompts and SamplingParams of a /generate or /rollout body (whose other fields are
    REQUEST_FIELDS and `extra`), or a 4xx; also checks the fields that add_request() reads."""
    check_serving(app)
    # a copy: the body stays as sent, so that the identical body finds the request (args_key)
    prompts = list(body["prompts"]) if isinstance(body.get("prompts"), list) else None
    # a conversation, [{role, content}, ...], rendered by the model's chat template (Client.chat)
    for i, prompt in enumerate(prompts or []):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompts[i] = chat_prompt(app[ENGINE], {"messages": prompt})
    prompts = parse_prompts({"prompts": prompts}, app[STATE])
    params = parse_sampling(body, app[STATE], extra=(*REQUEST_FIELDS, *extra))
    checked_field(body, "priority", int, 0)
    # a request waits for its min_version: at most the next push's, or it might never run
    version = app[ENGINE].version
    checked_field(body, "min_version", int, 0, 0, version + 1, f" (the weights are at {version})")
    # and never starts on weights past its max_version: at least the ones loaded
    checked_field(body, "max_version", int, version, version, 2**63, f" (now at {version})")
    checked_field(body, "keep_result", bool, False)
    return prompts, params


def tool_request(state, body) -> ChatCompletionRequest | None:
    """A chat body with `tools` as vLLM's ChatCompletionRequest, adjusted by the --tool-call-parser
    as vLLM's server adjusts it (e.g. special tokens kept in the text); or a 400. The parser reads
    the model's tool calls against it. None without tools or with tool_choice "none"."""
    if "tools" not in body or body.get("tool_choice") == "none":
        return None
    if not state.tool_parser or body.get("tool_choice", "auto") != "auto":
        raise ApiError(
            "'tools' need a server started with --tool-call-parser, and 'tool_choice' "
            "'auto' (the default) or 'none': no tool call is forced"
        )
    with refused_as("invalid chat request"):
        request = ChatCompletionRequest.model_validate(body)
    return state.tool_parser(request.tools).adjust_request(request)


def openai_request(engine, state, body, chat) -> tuple:
    """The prompt's token ids, the SamplingParams, whether to answer with logprobs and the
    tool_request (or None), of a /v1/completions (`chat` False) or /v1/chat/completions body; or a
    4xx."""
    unknown = sorted(set(body) - OPENAI_SAMPLING - OPENAI_OTHER)
    if unknown:
        raise ApiError(f"unsupported fields {unknown}")
    request = tool_request(state, body) if chat else None
    if body.get("model") != state.flags.served_model_name:
        raise ApiError(f"model {body.get('model')!r} does not exist (see /v1/models)", 404)
    if chat:
        prompt = chat_prompt(engine, body)
        logprobs = checked_field(body, "logprobs", bool, False)
        top = checked_field(body, "top_logprobs", int, 0, 0, 20)
        # as long as the model allows
        max_tokens = max(1, state.flags.max_model_len - len(prompt))
    else:
        prompt = body.get("prompt")
        # one prompt: a string or token ids, alone or as OpenAI's batch of one (lm-eval sends that)
        batch = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list))
        [prompt] = parse_prompts({"prompts": prompt if batch else [prompt]}, state)
        prompt = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        # completions: logprobs is the number of alternatives
        top = checked_field(body, "logprobs", int, 0, 0, 20)
        logprobs = top > 0
        max_tokens = 16
    fields = {k: v for k, v in body.items() if k in OPENAI_SAMPLING}
    fields["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens", max_tokens))
    if request:
        fields["skip_special_tokens"] = request.skip_special_tokens
    params = parse_sampling({**fields, "logprobs": top, "prompts": [prompt]}, state)
    return prompt, params, logprobs, request


def args_key(body) -> str:
    """The identity of a call by its arguments: the same body finds the same request. A digest,
    not the arguments: the table holds 64 characters per request, not a copy of its body."""
    arguments = {k: v for k, v in body.items() if k not in ("request_id", "timeout")}
    return hashlib.sha256(json.dumps(arguments, sort_keys=True).encode()).hexdigest()


# -- the futures table: request id -> (task, its arguments' key, its bytes), oldest first ----------
async def check_room(request, count=1) -> int:
    """429 unless `count` more requests fit under --max-pending (with the /v1 calls in progress)
    and the request's body under --max-pending-mb (of all the bodies held); the bytes each of the
    `count` holds. Work is checked before it is submitted, all of a call's requests at once: a call
    is taken whole or not at all. (A weight update, once announced, is never refused for room.)"""
    state = request.app[STATE]
    held = len(state.tasks) + state.openai_calls
    if held + count > state.flags.max_pending:
        raise ApiError(f"{held} requests wait unfetched or run (--max-pending)", 429)
    nbytes = len(await request.read())
    if state.held_bytes + nbytes > state.flags.max_pending_mb << 20:
        raise ApiError(
            f"{state.held_bytes >> 20} MiB of request bodies are held; this one's {nbytes} bytes "
            "do not fit (--max-pending-mb): fetch or abort results first",
            429,
        )
    return nbytes // count


def add_request(app, body, work, *args, nbytes=0) -> str:
    """Start `work(app, *args)` under a new id once weights body["min_version"] are loaded,
    holding its `nbytes` (check_room); its result expires as docs/internals.md#the-futures-table
    says."""
    state = app[STATE]
    request_id = uuid.uuid4().hex
    versions = body.get("min_version", 0), body.get("max_version", math.inf)
    task = asyncio.ensure_future(run_at_version(app, *versions, work, *args))
    state.tasks[request_id] = (task, args_key(body), nbytes)
    state.held_bytes += nbytes
    ttl = state.flags.result_ttl
    kept = bool(body.get("keep_result"))
    task.add_done_callback(lambda t: t.get_loop().call_later(ttl, expire, app, request_id, kept))
    return request_id


def drop_request(app, request_id) -> asyncio.Task:
    """Drop a request (fetched, aborted or expired); returns its task."""
    task, _, nbytes = app[STATE].tasks.pop(request_id)
    app[STATE].held_bytes -= nbytes
    return task


def expire(app, request_id, kept):
    """Drop a result not fetched --result-ttl s after it finished; a `kept` one once no /get_future
    came for --kept-result-ttl s (none waits, none began or ended: its trainer died)."""
    state = app[STATE]
    ttl = state.flags.kept_result_ttl if kept else state.flags.result_ttl
    idle = time.monotonic() - state.last_fetch
    if kept and (state.waiting or idle < ttl):
        delay = ttl if state.waiting else ttl - idle
        asyncio.get_running_loop().call_later(delay, expire, app, request_id, kept)
    elif request_id in state.tasks:
        drop_request(app, request_id)
        EXPIRED_RESULTS.inc()


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
            "group_port": state.flags.group_port,
            "workers": state.workers,
            "gpus": state.gpus,
            "dtype": state.dtype,
            "transport": state.transport,
            "fingerprint": state.fingerprint,
            "max_model_len": state.flags.max_model_len,
            # sequences decoded at once: --max-num-seqs, else what `vllm serve` sets on this device
            "max_num_seqs": engine.llm.vllm_config.scheduler_config.max_num_seqs,
            "engine_dead": engine.llm.errored,
            "tools": request.app[ROLLOUT].tool_names,
            "mcp": {m.name: "up" if m.session else "down" for m in request.app[MCP][2]},
        },
        status=503 if engine.error else 200,
    )


def check_serving(app):
    if app[ENGINE].error:
        raise ApiError(f"engine unusable: {app[ENGINE].error}", 503)


async def run_at_version(app, min_version, max_version, work, *args):
    """Run `work(app, *args)` (a coroutine function's) once weights `min_version` are loaded, and
    fail, never run, if those are past `max_version`; the result carries when it was queued,
    started and finished (the server's time.time()), to measure the overlap."""
    queued = time.time()
    await app[ENGINE].wait_for_version(min_version, app[STATE].flags.min_version_timeout)
    # an update under way: its weights are the ones this would start on
    await app[ENGINE].gate.wait()
    if app[ENGINE].version > max_version:
        raise RuntimeError(f"weights {app[ENGINE].version} are past max_version {max_version}")
    started = time.time()
    result = await work(app, *args)
    return {**result, "timing": {"queued": queued, "started": started, "finished": time.time()}}


async def generate_and_count(app, prompts, params, priority=0):
    """Engine.generate, counted in /metrics."""
    results = await app[ENGINE].generate(prompts, params, priority)
    REQUESTS.inc()
    for per_prompt in results:
        COMPLETION_TOKENS.inc(sum(len(c.token_ids) for c in per_prompt))
    return results


async def run_completions(app, prompts, params, priority):
    """The work of a /generate request: the completions of its prompts."""
    results = await generate_and_count(app, prompts, params, priority)
    # vars: asdict deep-copies, 20x slower
    return {"completions": [[vars(c) for c in r] for r in results]}


async def generate_route(request):
    """/generate: one request for all the prompts, or with split_prompts one per prompt."""
    app = request.app
    body = await read_json(request)
    prompts, params = parse_request(app, body, extra=("split_prompts",))
    # split: one request per prompt, in one call, each collected as soon as its own prompt is done
    split = checked_field(body, "split_prompts", bool, False)
    # (the body a request is found by, its prompts)
    bodies = [({**body, "prompts": [p]}, [p]) for p in prompts] if split else [(body, prompts)]
    nbytes = await check_room(request, len(bodies))
    ids = [
        add_request(app, one, run_completions, work, params, body.get("priority", 0), nbytes=nbytes)
        for one, work in bodies
    ]
    return web.json_response({"request_ids": ids} if split else {"request_id": ids[0]}, status=202)


async def run_rollout(app, prompts, params, options):
    episodes = await app[ROLLOUT].rollout(prompts, params, options)
    REQUESTS.inc()
    for per_prompt in episodes:
        COMPLETION_TOKENS.inc(sum(sum(e.loss_mask) for e in per_prompt))
    return {"episodes": [[vars(e) for e in per_prompt] for per_prompt in episodes]}


async def rollout_route(request):
    """/rollout: multi-turn tool episodes (RolloutEngine.rollout), with EpisodeOptions built here
    once: an option unset or null takes RolloutEngine.options' value."""
    app = request.app
    body = await read_json(request)
    prompts, params = parse_request(app, body, extra=ROLLOUT_FIELDS)
    rollouts = app[ROLLOUT]
    given = {k: v for k, v in body.items() if k in ROLLOUT_FIELDS and v is not None}
    # tools None: every registered tool (and a call of an unknown one says so, not "not available")
    fields = vars(rollouts.options) | given
    checked_field(fields, "max_turns", int, low=1, high=100)
    checked_field(fields, "max_episode_tokens", int, low=1, high=app[STATE].flags.max_model_len)
    if not set(checked_field(given, "tools", [str], [])) <= set(rollouts.tool_names):
        raise ApiError(f"'tools' must be a list of registered tool names: {rollouts.tool_names}")
    for name in ("call_start", "call_end", "result_format"):
        checked_field(fields, name, str)
    options = EpisodeOptions(**fields)
    if not options.call_start or not options.call_end or "{}" not in options.result_format:
        raise ApiError("'call_start', 'call_end' must be non-empty, 'result_format' hold {}")
    nbytes = await check_room(request)
    request_id = add_request(app, body, run_rollout, prompts, params, options, nbytes=nbytes)
    return web.json_response({"request_id": request_id}, status=202)


async def tools(request):
    """Every tool /rollout may call (Python and MCP) as OpenAI tool schemas, for /v1's `tools`."""
    return web.json_response({"tools": list(request.app[ROLLOUT].schemas.values())})


def requested_tasks(app, body) -> dict:
    """{id: task} of the requests a /get_future body asks for that the server holds: `request_ids`,
    `request_id`, or the oldest request with the identical arguments that no other caller is
    waiting for (so that identical requests are fetched once each)."""
    state = app[STATE]
    # beside an id, only a timeout: a misspelt one would wait the default unnoticed
    unknown = sorted(set(body) - {"request_id", "request_ids", "timeout"})
    if unknown and ("request_ids" in body or "request_id" in body):
        raise ApiError(f"unknown fields {unknown} beside a request id: only 'timeout' is")
    if "request_ids" in body:
        ids = checked_field(body, "request_ids", [str])
        if len(set(ids)) < len(ids):
            raise ApiError("'request_ids' lists a request twice")
    elif "request_id" in body:
        ids = [checked_field(body, "request_id", str)]
    elif "prompts" in body:
        key = args_key(body)
        # the oldest with these arguments that no other caller is waiting for (None: none, dropped
        # below as a request the server does not hold)
        same = (i for i, (_, k, _) in state.tasks.items() if k == key and i not in state.waiting)
        ids = [next(same, None)]
    else:
        raise ApiError("send 'request_id', 'request_ids', or the arguments of the request")
    tasks = {i: state.tasks[i][0] for i in ids if i in state.tasks}
    if not tasks:
        raise ApiError("no such request: unknown, fetched, aborted or expired", 404)
    if not state.waiting.isdisjoint(tasks):
        raise ApiError("another /get_future call is already waiting for this request", 409)
    return tasks


async def get_future(request):
    """The result of a request (by id or identical arguments), or of each of `request_ids` done
    once one is, within `timeout` s; a failure answers alone (404, 422, 503: docs/http.md)."""
    body = await read_json(request)
    state = request.app[STATE]
    timeout = checked_field(body, "timeout", float, 60, 0, 3600, " seconds")
    tasks = requested_tasks(request.app, body)
    # nothing awaited between the check in requested_tasks and this
    state.waiting.update(tasks)
    state.last_fetch = time.monotonic()
    try:
        done, _ = await asyncio.wait(
            tasks.values(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        state.waiting.difference_update(tasks)
        state.last_fetch = time.monotonic()
    if not done:
        raise ApiError(f"request {', '.join(tasks)} not finished after {timeout} s; ask again", 408)
    finished = {i: task for i, task in tasks.items() if task in done}
    for i, task in finished.items():
        if task.cancelled() or task.exception():
            if i in state.tasks:
                drop_request(request.app, i)
            # a dead engine: its cause, rather than vLLM's "see stack trace (above)"
            error = request.app[ENGINE].error
            if task.cancelled() and not error:
                raise ApiError(f"request {i} was aborted", 404)
            status = 503 if error else 422
            raise ApiError(f"request {i} failed: {error or task.exception()}", status)
    results = [{"request_id": i, **drop_request(request.app, i).result()} for i in finished]
    # by request_ids: every one of them that is done, in one answer (fewer round trips)
    return web.json_response({"results": results} if "request_ids" in body else results[0])


async def abort(request):
    """Cancel a request (its prompts stop generating) and free it."""
    request_id = checked_field(await read_json(request), "request_id", str)
    if request_id not in request.app[STATE].tasks:
        raise ApiError(f"no such request {request_id}", 404)
    drop_request(request.app, request_id).cancel()
    return web.json_response({"aborted": request_id})


# -- the OpenAI-compatible /v1 routes (their answers and sessions: openai_face.py) -----------------
async def models(request):
    name = request.app[STATE].flags.served_model_name
    model = {"id": name, "object": "model", "owned_by": "async-grpo"}
    return web.json_response({"object": "list", "data": [model]})


async def openai_completion(request):
    """/v1/completions and /v1/chat/completions: OpenAI's request and response shapes. A null
    field is one not set, as OpenAI's clients may send it."""
    check_serving(request.app)
    state, engine = request.app[STATE], request.app[ENGINE]
    body = {k: v for k, v in (await read_json(request)).items() if v is not None}
    chat = request.path.endswith("chat/completions")
    prompt, params, logprobs, tools = openai_request(engine, state, body, chat)
    stream = checked_field(body, "stream", bool, False)
    session_id = request.headers.get("X-Session-ID")
    completions = []
    nbytes = await check_room(request)
    # room for every choice, each recorded with its prompt
    reserved = params.n * (len(prompt) + params.max_tokens)
    recording = open_session(state, session_id, reserved) if session_id else None
    # a call in progress, of `nbytes`: counted with the futures table (check_room) till it ends
    state.openai_calls += 1
    state.held_bytes += nbytes
    try:
        [completions] = await generate_and_count(request.app, [prompt], params)
    # the engine refused it (e.g. a prompt longer than --max-model-len)
    except Exception as e:
        status = 503 if engine.error else 400
        raise ApiError(f"the engine refused the request: {engine.error or e}", status) from None
    finally:
        state.openai_calls -= 1
        state.held_bytes -= nbytes
        # a session's calls are recorded in the order they finish; a failed call frees its room
        if recording:
            record(recording, prompt, completions, reserved)
    answer = openai_answer(state, engine, chat, prompt, completions, logprobs, tools)
    return openai_events(answer, chat) if stream else web.json_response(answer)


async def session(request):
    state = request.app[STATE]
    session_id = request.match_info["session_id"]
    expire_sessions(state)
    if session_id not in state.sessions:
        raise ApiError(f"no session {session_id!r} (never used, deleted or expired)", 404)
    if request.method == "DELETE":
        state.sessions.pop(session_id)
        return web.json_response({"deleted": session_id})
    calls = state.sessions[session_id]["calls"]
    episode, reason = merge(calls)
    return web.json_response({"calls": calls, "episode": episode, "reason": reason})


async def init_communicator(request):
    """The trainer chooses the transport; the workers follow. ipc: {transport, gpu (its UUID)};
    nccl/gloo: {transport, host, world_size}, the workers join the group the trainer hosts."""
    body = await read_json(request)
    state = request.app[STATE]
    transport = body.get("transport", "gloo")
    if transport not in TRANSPORTS:
        raise ApiError(f"'transport' must be one of {list(TRANSPORTS)}")
    if transport != "gloo" and not any(state.gpus):
        raise ApiError(f"transport {transport} needs a server on GPUs, not the CPU: use gloo")
    if transport == "ipc" and (body.get("gpu") not in state.gpus or state.workers != 1):
        raise ApiError(
            f"ipc needs the trainer on the GPU of a one-GPU server; "
            f"the server's are {state.gpus}, the trainer's is {body.get('gpu')}: use nccl"
        )
    # the group's host and size: nccl and gloo only, ipc needs no group (the size sent is checked,
    # ours is passed on: JSON's 2.0 equals 2 but is no size)
    host = body.get("host")
    world_size = 1 + state.workers
    if transport != "ipc" and (not isinstance(host, str) or body.get("world_size") != world_size):
        raise ApiError(
            f"{transport} needs 'host' (a string) and world_size = 1 (trainer) + {state.workers} "
            f"(server workers) = {world_size}"
        )
    port = state.flags.group_port
    timeout = state.flags.weight_sync_timeout
    try:
        await request.app[ENGINE].rpc(
            "init_communicator", transport, host, port, world_size, timeout, timeout=timeout + 10
        )
    # the workers left any group they were in: no update until an init succeeds
    except Exception as e:
        state.transport = None
        raise ApiError(
            f"no {transport} weight sync (group at {host}:{port}) within {timeout} s: {e!r}", 504
        ) from None
    state.transport = transport
    return web.json_response({"dtype": state.dtype, "params": state.weight_spec})


# the fields of a CUDA IPC handle, as client.share_cuda writes them (plain JSON: the server never
# unpickles what arrives over HTTP)
IPC_HANDLE = dict.fromkeys(["offset", "device", "storage_offset", "ref_offset"], int)
IPC_HANDLE |= {"storage_bytes": int, "handle": str, "ref": str, "gpu": str}
IPC_HANDLE |= {"event": (str, type(None)), "event_sync": bool}


def check_buckets(body, state) -> list:
    """The body's `buckets`, or a 400 before anything is received or loaded: every parameter of
    the server's once, each bucket well formed (check_bucket); with `same_layout`, the last
    update's (same_layout)."""
    buckets = checked_field(body, "buckets", [dict])
    if not buckets:
        raise ApiError("'buckets' must be a non-empty list of {size, params}")
    if "same_layout" in body:
        return same_layout(buckets, body["same_layout"], state)
    seen = set()
    for bucket in buckets:
        check_bucket(bucket, state, seen)
    # vLLM reloads whole fused layers: a partial update would load garbage
    missing = sorted(set(state.weight_spec) - seen)
    if missing:
        raise ApiError(f"an update needs every parameter; missing {len(missing)}: {missing[:5]}")
    return buckets


def same_layout(buckets, version, state) -> list:
    """The buckets of an update that sends the params of the one that made `version` again (a
    trainer pushing its model again), if that was the last: each of its size as then, with its
    handle (check_handle), their params filled in from then. Else a 400."""
    last_version, last = state.layout
    sizes = [b.get("size") for b in buckets]
    if type(version) is not int or version != last_version or sizes != [b["size"] for b in last]:
        raise ApiError(
            f"'same_layout' must be the version the last update made ({last_version}) and the "
            "buckets their number and sizes then: else send their params"
        )
    # a bucket that names params of its own may be laid out by them, not by the ones checked then
    if any("params" in b for b in buckets):
        raise ApiError("with 'same_layout' the buckets name no params (those checked then)")
    for bucket, then in zip(buckets, last):
        check_handle(bucket.get("handle"), state.transport, then["size"])
        bucket["params"] = then["params"]
    return buckets


def check_bucket(bucket, state, seen):
    """A bucket's parameters, each of the server's and not `seen` before, by its name, shape and
    dtype, at 16-byte aligned offsets that neither overlap nor leave the bucket; with ipc, the
    bucket's handle (check_handle); or a 400."""
    size = checked_field(bucket, "size", int)
    end = 0
    for param in checked_field(bucket, "params", [dict]):
        name = checked_field(param, "name", str)
        if name not in state.weight_spec:
            raise ApiError(f"unknown parameter '{name}'")
        if name in seen:
            raise ApiError(f"repeated parameter '{name}'")
        seen.add(name)
        if param.get("shape") != state.weight_spec[name] or param.get("dtype") != state.dtype:
            raise ApiError(
                f"'{name}' has shape {param.get('shape')} and dtype {param.get('dtype')}; "
                f"the server's are {state.weight_spec[name]} and {state.dtype}"
            )
        offset = checked_field(param, "offset", int)
        nbytes = DTYPES[state.dtype].itemsize * math.prod(state.weight_spec[name])
        if offset < end or offset % 16 or offset + nbytes > size:
            raise ApiError(
                f"'{name}' at offset {offset} is not 16-byte aligned, overlaps or does not fit its "
                f"bucket of {size} bytes"
            )
        end = offset + nbytes
    # the server allocates `size` bytes to receive into: no more than its params take
    checked_field(bucket, "size", int, 0, end, end + 15, " (its params' bytes, 16-byte aligned)")
    check_handle(bucket.get("handle"), state.transport, size)


def check_handle(handle, transport, size):
    """With ipc a bucket carries the handle of the trainer's buffer of `size` bytes (IPC_HANDLE);
    with nccl and gloo none."""
    well_formed = handle is None
    if transport == "ipc":
        named = isinstance(handle, dict) and set(handle) == set(IPC_HANDLE)
        well_formed = named and all(isinstance(handle[k], t) for k, t in IPC_HANDLE.items())
    if not well_formed:
        raise ApiError(
            f"with ipc each bucket carries a 'handle' {{{', '.join(IPC_HANDLE)}}} "
            "as client.share_cuda makes it; with nccl and gloo none"
        )
    if transport == "ipc" and not ipc_handle_fits(handle, size):
        raise ApiError("the handle's 'ref' is not torch's, or its offsets leave its buffers")


def ipc_handle_fits(handle, size) -> bool:
    """Whether a handle names a ref counter as torch names them, "/torch_<pid>_<n>_<n>", at an
    offset inside its file (torch's CUDA_IPC_REF_COUNTER_FILE_SIZE int64s: a worker increments
    the one there), and a buffer of `size` bytes inside its storage. Without --api-key, anyone on
    this machine may send one."""
    try:
        ref = base64.b64decode(handle["ref"], validate=True)
    except ValueError:
        return False
    return (
        re.fullmatch(rb"/torch_\d+_\d+_\d+", ref) is not None
        and 0 <= handle["ref_offset"] < 10000
        and 0 <= handle["offset"] <= handle["storage_bytes"] - size
        and handle["storage_offset"] >= 0
    )


async def update_weights(request):
    """One weight update in one call, answered as two JSON lines: {"receiving": true} once the
    workers receive (only then does the trainer send), then the outcome (Engine.load). Nothing
    cancels it once the workers receive; its statuses: docs/http.md's /update_weights."""
    body = await read_json(request)
    engine, state = request.app[ENGINE], request.app[STATE]
    buckets = check_buckets(body, state)
    mode, version = update_mode(body)
    # a LoRA request in flight would go on with its old adapter on the new base, under its label
    if mode == "in-flight" and state.flags.enable_lora:
        raise ApiError("with --enable-lora a full update drains: push with mode 'drain'")
    if not state.transport:
        raise ApiError("no weight sync set up: call /init_communicator first", 409)
    # resolved by the engine once the workers are told to receive
    ready = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(run_update(request.app, buckets, mode, ready, version))
    await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
    # failed before the workers were told to receive: nothing was sent or changed
    if not ready.done():
        raise ApiError(f"update refused, version {engine.version} kept: {task.exception()}", 503)
    answer = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await answer.prepare(request)
    await answer.write(b'{"receiving": true}\n')
    # asyncio.wait never cancels the task, even when this call is cancelled
    await asyncio.wait([task])
    await answer.write(json.dumps(task.result()).encode() + b"\n")
    return answer


def update_mode(body) -> tuple[str, int]:
    """An update's `mode` and `version`, or a 400."""
    mode = body.get("mode", "drain")
    if mode not in ("drain", "in-flight"):
        raise ApiError("'mode' must be 'drain' or 'in-flight' (see Engine.gate_closed)")
    # the version the new weights get, if higher than the next one: a trainer keeps several
    # servers on one numbering, one of them restarted (its count began again at 0)
    return mode, checked_field(body, "version", int, 0, 0, 2**53)


async def run_update(app, buckets, mode, ready, version) -> dict:
    """An update's phases, `ready` resolved when the trainer may send; the outcome as the answer's
    last line. It raises only while the update can still be refused: before `ready` is resolved."""
    engine = app[ENGINE]
    timeout = app[STATE].flags.weight_sync_timeout
    start = time.perf_counter()
    try:
        async with engine.gate_closed(mode, app[STATE].flags.drain_timeout, timeout) as drain_s:
            # the workers are told to receive next: the trainer may send
            ready.set_result(None)
            version, timings = await engine.load(buckets, timeout, version)
    except Exception as e:
        if not ready.done():
            raise
        if engine.error:
            error = f"weight update failed; the server exits: {engine.error}"
            return {"error": error, "status": 500}
        # the workers left the group
        app[STATE].transport = None
        error = f"weight update failed, version {engine.version} kept: {e!r}"
        return {"error": f"{error}; call /init_communicator again", "status": 502}
    SYNC_SECONDS.observe(time.perf_counter() - start)
    app[STATE].fingerprint = timings["fingerprint"]
    # what the next update may refer to (same_layout)
    app[STATE].layout = (version, buckets)
    return {"version": version, "drain_s": drain_s, **timings}


async def update_adapter(request):
    """A LoRA adapter as the next version (--enable-lora): {"version"} once it serves; 400 for an
    adapter the model cannot take, 503 for a drain over --drain-timeout, nothing changed then."""
    body = await read_json(request)
    state = request.app[STATE]
    config = checked_field(body, "adapter_config", dict)
    mode, version = update_mode(body)
    refused = f"adapter refused, version {request.app[ENGINE].version} kept"
    start = time.perf_counter()
    # binascii's, safetensors' or check_adapter's
    with refused_as(refused):
        # the adapter's safetensors file: a path in /dev/shm on this host, or its bytes in the body
        if "adapter_file" in body:
            data = Path(shared_file(checked_field(body, "adapter_file", str))).read_bytes()
        else:
            data = from_base64(checked_field(body, "adapter_model", str))
        # decoded to be checked; the engine writes these bytes as they came
        check_adapter(config, load_safetensors(data), state)
        # trained on other base weights (Client.update_adapter sends their fingerprint), it would
        # be served on these and trained on their samples
        base = body.get("base_fingerprint", state.fingerprint)
        if state.fingerprint and base != state.fingerprint:
            raise ValueError(f"trained on base weights {base}, not the {state.fingerprint} served")
    read_s = time.perf_counter() - start
    # the drain's and the load's
    limits = state.flags.drain_timeout, state.flags.weight_sync_timeout
    try:
        version = await request.app[ENGINE].update_adapter(config, data, mode, *limits, version)
    except (TimeoutError, ValueError) as e:
        raise ApiError(f"{refused}: {e}", 503 if isinstance(e, TimeoutError) else 400) from None
    load_s = time.perf_counter() - start - read_s
    return web.json_response({"version": version, "read_s": read_s, "load_s": load_s})


# the files Client.update_adapter writes (mkstemp's names), in /dev/shm itself
CLIENT_FILE = re.compile(r"/dev/shm/adapter-\w+\.safetensors")


def shared_file(path):
    """`path` if it is a file of Client.update_adapter's: named as it names them, in /dev/shm
    itself (never in the server's own adapter folders), owned by the server's user; else a
    ValueError. The one place a client may hand the server a file."""
    real = os.path.realpath(path)
    # a name of the client's that names no file: os.stat's FileNotFoundError
    if not (CLIENT_FILE.fullmatch(real) and os.stat(real).st_uid == os.getuid()):
        raise ValueError(f"'adapter_file' is no /dev/shm file Client.update_adapter made: {path!r}")
    return real


def check_adapter(config, adapter, state):
    """A ValueError unless the `adapter`'s tensors {name: tensor} are finite, float16, bfloat16 or
    float32, each lora_A of shape (r, in) and each lora_B (out, r), as their layer's weight is
    (out, in), and its scale lora_alpha / r finite and at most 1000 (PEFT's default is 1): vLLM
    loads these without a word (a NaN poisons later requests), and checks the rest itself
    (Engine.update_adapter). An `r` or `lora_alpha` that is no number fails the division."""
    rank = config.get("r")
    if not abs(config.get("lora_alpha", 8) / rank) <= 1000:
        raise ValueError("the scale lora_alpha / r must be finite and at most 1000")
    for name, t in adapter.items():
        layer, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
        out, inputs = state.weight_spec.get(f"{layer}.weight", (None, None))
        # another kind (lora_embedding_A, ...): vLLM refuses what it does not take
        expected = {"A.weight": [rank, inputs], "B.weight": [out, rank]}.get(kind, list(t.shape))
        if list(t.shape) != expected:
            raise ValueError(f"'{name}' has shape {list(t.shape)}; the model takes {expected}")
        if t.dtype not in DTYPES.values() or not t.isfinite().all():
            raise ValueError(f"'{name}' must be finite float16, bfloat16 or float32: {t.dtype}")


async def reset_prefix_cache(request):
    """Empty vLLM's prefix cache, as TRL's server does; {"reset": false} while requests hold some
    of it. (Each weight version caches its prefixes apart anyway: Engine._one.)"""
    reset = await asyncio.wait_for(request.app[ENGINE].llm.reset_prefix_cache(), 60)
    return web.json_response({"reset": reset})


async def close_communicator(request):
    await request.app[ENGINE].rpc("close_communicator")
    request.app[STATE].transport = None
    return web.json_response({"status": "closed"})


# -- the app ---------------------------------------------------------------------------------------
@web.middleware
async def errors(request, handler):
    """Every error, ours and aiohttp's (413 too large, 405, 404 route), as JSON {"error": message},
    the message being the exception's text (aiohttp's own: e.g. "405: Method Not Allowed"); on the
    /v1 routes in OpenAI's shape, {"error": {"message", "type", "param", "code"}}."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        message = e.text
        if request.path.startswith("/v1/"):
            error_type = "invalid_request_error" if e.status < 500 else "server_error"
            message = {"message": message, "type": error_type, "param": None, "code": e.status}
        # a dead engine core does not come back in this process: not a busy or restarting server
        dead = e.status == 503 and request.app[ENGINE].llm.errored
        return web.json_response({"error": message, "engine_dead": dead}, status=e.status)


@web.middleware
async def check_key(request, handler):
    """With --api-key, every route but /health and /metrics needs `Authorization: Bearer <key>`."""
    key = request.app[STATE].flags.api_key
    # bytes: compare_digest refuses a str with non-ASCII characters (a 500, not a 401)
    sent = request.headers.get("Authorization", "").encode(errors="surrogateescape")
    public = request.path in ("/health", "/metrics")
    if key and not public and not hmac.compare_digest(sent, f"Bearer {key}".encode()):
        raise ApiError("missing or wrong API key: send 'Authorization: Bearer <key>'", 401)
    return await handler(request)


async def watch_engine(app):
    """Stop the server when the engine cannot serve any more (vLLM's engine core is gone for good,
    or a weight update failed while loading), so that it exits non-zero and a supervisor restarts
    it. AsyncLLM only exposes this as a flag, hence the check every second."""
    while not app[ENGINE].error:
        await asyncio.sleep(1)
    print(f"engine failed: {app[ENGINE].error}; stopping the server", file=sys.stderr, flush=True)
    app[STATE].engine_died = True
    # aiohttp's run_app shuts down gracefully on SIGTERM (stop_requests: their waiters get a 503)
    os.kill(os.getpid(), signal.SIGTERM)


async def stop_requests(app):
    """On shutdown (SIGTERM), before aiohttp waits for the handlers still running: end every
    request, so that the /get_future calls waiting for them answer now (404 as aborted, or 503 with
    the cause if the engine died), not once aiohttp's graceful shutdown gives up (60 s)."""
    for task, _, _ in app[STATE].tasks.values():
        task.cancel()


def read_family_calls(rollouts, tool_parser):
    """/rollout reads tool calls in the model family's format, as /v1 does: where the
    --tool-call-parser marks a call with tags of its own (hermes: <tool_call>...</tool_call>),
    they become /rollout's default `call_start` and `call_end`, and the parser reads the call."""
    # one request and one parser for every call: reading a whole call keeps no state between calls
    request = ChatCompletionRequest(messages=[], tools=list(rollouts.schemas.values()))
    parser = tool_parser(request.tools)
    start = getattr(parser, "tool_call_start_token", None)
    end = getattr(parser, "tool_call_end_token", None)
    if not (isinstance(start, str) and isinstance(end, str) and start and end):
        return

    def read_call(text):
        found = parser.extract_tool_calls(text, request)
        if not found.tools_called:
            return None
        return found.tool_calls[0].function.name, found.tool_calls[0].function.arguments

    rollouts.options.call_start, rollouts.options.call_end = start, end
    rollouts.read_call = read_call


# -- MCP servers as tools (--mcp) -----------------------------------------------------------------
@dataclass(eq=False)
class MCPServer:
    """One --mcp server (a command line started with the variables `env`, or a URL), its session
    while it is up, and the task that holds it (`holder`, started by mcp_ctx). One that ends (its
    process exits) is logged at once, shown "down" in /health, and started again after 1, 2, 4 ...
    60 s."""

    name: str
    target: str
    env: dict | None = None
    session: object = None
    # set when the connection ends, or to stop
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: bool = False

    async def stop(self):
        self.stopping = True
        self.closed.set()
        await asyncio.wait([self.holder], timeout=10)

    async def hold(self, listed: asyncio.Future):
        """Connect, list the tools into `listed` (the first time; an error there ends it), hold
        the connection until it ends, and connect again, until stopped. One task enters and leaves
        the mcp package's (anyio's) contexts, as they must be left by the task that entered them."""
        backoff = 1
        while not self.stopping:
            try:
                async with AsyncExitStack() as stack:
                    async with asyncio.timeout(60):
                        session = await mcp_session(stack, self.target, self.env, self.closed)
                        tools = (await session.list_tools()).tools
                    self.session, backoff = session, 1
                    if not listed.done():
                        listed.set_result(tools)
                    await self.closed.wait()
                    # down from now, not once the connection is wound down
                    self.session = None
            # its own log (stderr, here) says why it ended
            except Exception as e:
                # the cause itself, not the task groups of anyio's around it
                while isinstance(e, BaseExceptionGroup):
                    e = e.exceptions[0]
                if not listed.done():
                    return listed.set_exception(e)
            if self.stopping:
                return
            print(f"the MCP server {self.name} is down: restart in {backoff} s", file=sys.stderr)
            self.closed = asyncio.Event()
            with suppress(TimeoutError):
                await asyncio.wait_for(self.closed.wait(), backoff)
            backoff = min(2 * backoff, 60)

    async def call(self, tool, arguments: dict) -> str:
        """MCP tool `tool` called with the call's JSON object: its result's text."""
        if self.session is None:
            return f"error: the MCP server {self.name} is down; it is being started again"
        result = await self.session.call_tool(tool, arguments)
        text = "\n".join(c.text for c in result.content if c.type == "text")
        return f"error: {text}" if result.is_error else text


async def mcp_session(stack, target, env, closed: asyncio.Event):
    """An initialised MCP session (mcp's ClientSession) with `target`: a URL (streamable HTTP), or
    a command line started (stdio, with `env`) and stopped when `stack` closes. `closed` is set
    when the server's side of the connection ends."""
    # imported here: a server without --mcp needs no mcp package (the GPU machines have none)
    import anyio
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client

    if target.startswith(("http://", "https://")):
        receive, send = await stack.enter_async_context(streamable_http_client(target))
    else:
        # Linux's parent-death signal (util-linux's setpriv): it dies with this server, SIGKILL too
        setpriv = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
        command, *args = setpriv + shlex.split(target)
        server = StdioServerParameters(command=command, args=args, env=env)
        receive, send = await stack.enter_async_context(stdio_client(server))
    # the session reads the server's messages through a stream of ours, whose end (the server's
    # stdout closed: it exited) sets `closed`
    forward_to, watched = anyio.create_memory_object_stream(0)
    # cancelled as the stack closes
    stack.callback(asyncio.ensure_future(forward(receive, forward_to, closed)).cancel)
    session = await stack.enter_async_context(ClientSession(watched, send))
    await session.initialize()
    return session


async def forward(source, sink, closed: asyncio.Event):
    """Send every message of `source` on to `sink`; set `closed` when `source` ends."""
    async with sink:
        async for message in source:
            await sink.send(message)
        closed.set()


async def mcp_ctx(app):
    """The --mcp servers, started before the engine and stopped after it, each held by a task of
    its own (MCPServer.hold): app[MCP] = ({tool name: async function of the call's JSON object},
    {tool name: OpenAI schema}, the MCPServers). A server that does not start, or a tool named as
    one of --tool's, calc or another server's (it would replace that tool), stops the start."""
    flags = app[STATE].flags
    env = {name: os.environ.get(name, "") for name in flags.mcp_env or []}
    servers = [MCPServer(name, target, env) for name, target in flags.mcp or []]
    tools, schemas, taken = {}, {}, {"calc", *dict(flags.tool or [])}
    for server in servers:
        listed = asyncio.get_running_loop().create_future()
        server.holder = asyncio.ensure_future(server.hold(listed))
        try:
            for tool in await listed:
                if tool.name in tools or tool.name in taken:
                    raise ValueError(f"its tool '{tool.name}' has the name of another tool")
                tools[tool.name] = functools.partial(server.call, tool.name)
                schemas[tool.name] = openai_tool(tool.name, tool.description, tool.input_schema)
        except Exception as e:
            sys.exit(f"error: --mcp {server.name}={server.target}: {e!r}")
    app[MCP] = (tools, schemas, servers)
    yield
    for server in servers:
        await server.stop()


def checkpoint_fingerprint(model, spec, dtype) -> str | None:
    """client.fingerprint of the checkpoint the server starts on, from the rows of its safetensors
    files that it hashes (a hub model's from the local cache); None where it has no such files."""
    if not os.path.isdir(model):
        model = snapshot_download(model, allow_patterns="*.safetensors")
    named = []
    for path in Path(model).glob("*.safetensors"):
        # safetensors' slices: only the rows that fingerprint reads are read
        with safe_open(path, "pt") as f:
            named += [(name, f.get_slice(name)) for name in set(f.keys()) & set(spec)]
    return fingerprint(named, DTYPES[dtype]) if named else None


def make_app(args, flags) -> web.Application:
    """The server for AsyncEngineArgs `args` and the server's `flags` (parse_args): the engine
    starts with the app and stops with it."""
    app = web.Application(client_max_size=flags.max_body_mb << 20, middlewares=[errors, check_key])
    app[STATE] = state = State(flags)

    async def engine_ctx(app):
        app[ENGINE] = engine = Engine(args, fork=True)
        try:
            # /health answers only once the engine has generated
            await engine.warm_up()
        except Exception as e:
            engine.llm.shutdown()
            sys.exit(f"error: the warm-up generation failed: {engine.error or repr(e)}")
        # the longest prompt + completion: --max-model-len, or what the engine derived
        flags.max_model_len = engine.llm.model_config.max_model_len
        # read when /metrics is scraped
        IN_FLIGHT.set_function(lambda: engine.in_flight)
        PENDING_RESULTS.set_function(lambda: len(state.tasks))
        WEIGHT_VERSION.set_function(lambda: engine.version)
        state.vocab_size = engine.llm.model_config.get_vocab_size()
        state.dtype = str(engine.llm.model_config.dtype).removeprefix("torch.")
        state.workers = args.tensor_parallel_size * args.data_parallel_size
        state.weight_spec = (await engine.rpc("weight_spec"))[0]
        state.fingerprint = checkpoint_fingerprint(args.model, state.weight_spec, state.dtype)
        # the workers' GPU UUIDs (None on CPU)
        state.gpus = await engine.rpc("gpu_uuid")
        mcp_tools, mcp_schemas, _ = app[MCP]
        tools = dict(flags.tool or []) | mcp_tools
        app[ROLLOUT] = RolloutEngine(engine, tools, mcp_schemas, tool_timeout=flags.tool_timeout)
        if flags.tool_call_parser:
            parser = ToolParserManager.get_tool_parser(flags.tool_call_parser)
            state.tool_parser = functools.partial(parser, engine.tokenizer)
            read_family_calls(app[ROLLOUT], state.tool_parser)
        watcher = asyncio.ensure_future(watch_engine(app))
        yield
        watcher.cancel()
        engine.llm.shutdown()

    app.on_shutdown.append(stop_requests)
    app.cleanup_ctx.extend([mcp_ctx, engine_ctx])
    app.add_routes(ROUTES)
    return app


ROUTES = [
    web.get("/health", health),
    web.post("/generate", generate_route),
    web.post("/rollout", rollout_route),
    web.get("/tools", tools),
    web.post("/get_future", get_future),
    web.post("/abort", abort),
    web.post("/init_communicator", init_communicator),
    web.post("/update_weights", update_weights),
    web.post("/close_communicator", close_communicator),
    web.post("/update_adapter", update_adapter),
    web.post("/reset_prefix_cache", reset_prefix_cache),
    web.get("/metrics", make_aiohttp_handler()),
    web.get("/v1/models", models),
    web.post("/v1/completions", openai_completion),
    web.post("/v1/chat/completions", openai_completion),
    web.get("/v1/sessions/{session_id}", session),
    web.delete("/v1/sessions/{session_id}", session),
]


def add_engine_flags(g):
    """The engine's flags, named as in `vllm serve`."""
    # the built-in tiny model is built on first use
    g.add_argument("--model", help="HF model folder or hub id (default: the built-in tiny model)")
    # the trainer's updates must come in this dtype
    g.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weight dtype")
    # default: the model's own length, capped to what the KV cache holds (vLLM's log says so;
    # /health and every 400 for a too long request give the length in use)
    g.add_argument("--max-model-len", type=int, help="longest prompt + completion")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU memory share")
    # default: vLLM's on GPU, 256 MiB on CPU
    g.add_argument("--kv-cache-memory-bytes", type=int, help="KV cache size in bytes")
    # default: vllm serve's on the device (Engine.__init__)
    g.add_argument("--max-num-seqs", type=int, help="most sequences decoded at once")
    # default: vllm serve's on the device, as --max-num-seqs (H100, H200: 8,192)
    g.add_argument("--max-num-batched-tokens", type=int, help="most tokens a step schedules")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per model replica")
    g.add_argument("--data-parallel-size", type=int, default=1, help="model replicas")
    g.add_argument("--seed", type=int, default=0, help="engine seed")
    # default: on CPU only
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, help="no compiling")
    # LoRA adapters pushed to /update_adapter: --max-loras >= the trainer's staleness + 2 keeps
    # loaded every adapter a request in flight may use, and the one loading
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (vLLM's)")
    g.add_argument("--max-loras", type=int, default=4, help="adapters loaded at once")


def add_http_flags(g):
    # not loopback: needs --api-key
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="HTTP port")
    g.add_argument("--served-model-name", help="the model's name in /v1 (None: --model's)")
    # default: $VLLM_API_KEY; every route but /health and /metrics needs it
    g.add_argument("--api-key", help="the key callers must send")


def add_limit_flags(g):
    """Bounds on what callers may ask for and leave behind; beyond them a 400 or 429."""
    g.add_argument("--max-n", type=int, default=256, help="largest n (completions per prompt)")
    g.add_argument("--max-request-seqs", type=int, default=16384, help="most prompts x n at once")
    g.add_argument("--max-pending", type=int, default=10000, help="most results not yet fetched")
    # the bodies of the requests waiting, running or unfetched, /v1 calls included
    g.add_argument("--max-pending-mb", type=int, default=1024, help="most MiB of bodies held")
    g.add_argument("--result-ttl", type=float, default=600.0, help="seconds a result is kept")
    # a trainer's queued steps wait unfetched while it trains: theirs is a bound for a dead trainer
    g.add_argument("--kept-result-ttl", type=float, default=3600.0, help="seconds unpolled")
    # a request with a min_version that no push brings fails after it (a 422 from /get_future)
    g.add_argument("--min-version-timeout", type=float, default=600.0, help="seconds it may wait")
    g.add_argument("--max-body-mb", type=int, default=16, help="largest request body, in MiB")
    # sessions: the OpenAI routes record the calls sent with an X-Session-ID header (each call's
    # prompt and completions: its tokens); beyond these bounds a call is a 429. A session ends
    # when deleted, --session-ttl s after its last call, or --max-session-age s after its first.
    g.add_argument("--max-session-tokens", type=int, default=10**6, help="most tokens per session")
    g.add_argument("--max-total-session-tokens", type=int, default=10**7, help="in all sessions")
    g.add_argument("--max-session-age", type=float, default=3600.0, help="most seconds per session")
    g.add_argument("--session-ttl", type=float, default=600.0, help="seconds a session stays idle")


def add_sync_flags(g):
    g.add_argument("--group-port", type=int, default=51216, help="the weight-sync group's port")
    # for the trainer, while joining the group or receiving a bucket; on timeout the update fails
    # and the old weights and version stay
    g.add_argument("--weight-sync-timeout", type=float, default=60.0, help="seconds per bucket")
    # for the requests in flight to finish; then the update is refused (503) before anything is sent
    g.add_argument("--drain-timeout", type=float, default=60.0, help="seconds an update drains")


def tool_flag(spec) -> tuple:
    """--tool NAME=module:function: (NAME, the function)."""
    name, _, function = spec.partition("=")
    try:
        return name, load_function(function, f"--tool {name}=")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def mcp_flag(spec) -> tuple:
    """--mcp NAME=COMMAND or NAME=URL: (NAME, the command or URL)."""
    name, _, target = spec.partition("=")
    if not name or not target.strip():
        raise argparse.ArgumentTypeError(f"--mcp {spec}: NAME=COMMAND ARGS... or NAME=http://...")
    return name, target


def add_tool_flags(g):
    # a Python function of one string, that /rollout may call as NAME (repeatable; 'calc' is
    # built in)
    g.add_argument(
        "--tool", type=tool_flag, action="append", metavar="NAME=MODULE:FN", help="a /rollout tool"
    )
    # /v1/chat/completions with `tools`: the model's tool calls come back as `tool_calls`. As in
    # vllm serve, where it goes with --enable-auto-tool-choice (implied here). /rollout reads
    # calls in the family's format too, between the parser's own tags
    g.add_argument("--tool-call-parser", choices=ToolParserManager.list_registered(), help="vLLM's")
    # an MCP server's tools, called with JSON arguments (repeatable): a command line, started and
    # stopped with this server (stdio), or the URL of one that runs (streamable HTTP)
    g.add_argument(
        "--mcp", type=mcp_flag, action="append", metavar="NAME=COMMAND|URL", help="MCP tools"
    )
    # a stdio MCP server gets none of this server's environment but PATH, HOME and a few (the mcp
    # package's choice): these variables too (repeatable)
    g.add_argument("--mcp-env", action="append", metavar="NAME", help="passed to stdio MCP servers")
    # a tool that takes longer answers with an error
    g.add_argument("--tool-timeout", type=float, default=10.0, help="seconds a tool call may take")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="async-grpo's rollout server: vLLM over HTTP",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_flags(p.add_argument_group("engine (named as in vllm serve)"))
    add_http_flags(p.add_argument_group("HTTP"))
    add_limit_flags(p.add_argument_group("limits"))
    add_sync_flags(p.add_argument_group("weight sync"))
    add_tool_flags(p.add_argument_group("tools"))
    flags = p.parse_args(argv)
    flags.served_model_name = flags.served_model_name or flags.model or "tiny-qwen2"
    # read here, not as the flag's default: --help would print it
    flags.api_key = flags.api_key or os.environ.get("VLLM_API_KEY")
    if model_error(flags.model):
        p.error(model_error(flags.model))
    if flags.host not in LOOPBACK and not flags.api_key:
        p.error(
            f"--host {flags.host} exposes the server beyond this machine: "
            "set --api-key (or VLLM_API_KEY) so that nobody else can generate or push weights"
        )
    return flags


def main(argv=None):
    flags = parse_args(argv)
    # the engine's flags are named as AsyncEngineArgs' fields
    fields = AsyncEngineArgs.__dataclass_fields__
    engine_flags = {k: v for k, v in vars(flags).items() if k in fields}
    app = make_app(engine_args(**engine_flags | {"model": flags.model or tiny_model()}), flags)
    web.run_app(app, host=flags.host, port=flags.port, print=lambda msg: print(msg, flush=True))
    if app[STATE].engine_died:
        sys.exit("the engine died; see the log above")


if __name__ == "__main__":
    main()
