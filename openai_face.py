"""The OpenAI-compatible face of server.py: /v1/models, /v1/completions, /v1/chat/completions and
/v1/sessions/<id>, registered by server.make_app. Every answer carries its tokens
(prompt_token_ids; per choice token_ids) and weight_version, and the calls sent with an
X-Session-ID header are recorded, so that an agent written against the OpenAI client can be
trained on exactly what it sampled (docs/http.md).
"""

import contextlib
import itertools
import json
import time
import uuid

from aiohttp import web
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from client import Episode
from server import (
    ENGINE,
    SAMPLING_FIELDS,
    STATE,
    ApiError,
    check_room,
    check_serving,
    checked_field,
    generate_and_count,
    parse_prompts,
    parse_sampling,
    read_json,
)

# vLLM's OpenAI server takes its sampling fields too (top_k, min_p, ignore_eos, ...); `logprobs`
# means something else in OpenAI's shape
OPENAI_SAMPLING = set(SAMPLING_FIELDS) - {"logprobs"}
# the other fields: what to complete and how to answer, logprobs in OpenAI's shape, functions
OPENAI_OTHER = {"model", "messages", "prompt", "max_completion_tokens", "stream", "user"}
OPENAI_OTHER |= {"logprobs", "top_logprobs", "tools", "tool_choice"}


async def models(request):
    name = request.app[STATE].flags.served_model_name
    model = {"id": name, "object": "model", "owned_by": "async-grpo"}
    return web.json_response({"object": "list", "data": [model]})


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
    try:
        request = ChatCompletionRequest.model_validate(body)
    except Exception as e:
        raise ApiError(f"invalid chat request: {e}") from None
    return state.tool_parser(request.tools).adjust_request(request)


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
    try:
        for m in messages:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        text = engine.tokenizer.apply_chat_template(
            messages, tools=body.get("tools"), tokenize=False, add_generation_prompt=True
        )
    # no template, one that refuses these roles, or tool calls that are not OpenAI's
    except Exception as e:
        raise ApiError(f"the model's chat template cannot render these messages: {e}") from None
    return engine.tokenizer.encode(text, add_special_tokens=False)


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
        # one prompt: a string or token ids
        [prompt] = parse_prompts({"prompts": [body.get("prompt")]}, state)
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
    try:
        with held_call(state, nbytes):
            [completions] = await generate_and_count(request.app, [prompt], params)
    # the engine refused it (e.g. a prompt longer than --max-model-len)
    except Exception as e:
        status = 503 if engine.error else 400
        raise ApiError(f"the engine refused the request: {engine.error or e}", status) from None
    finally:
        # a session's calls are recorded in the order they finish; a failed call frees its room
        if recording:
            record(recording, prompt, completions, reserved)
    answer = openai_answer(request.app, chat, prompt, completions, logprobs, tools)
    return openai_events(answer, chat) if stream else web.json_response(answer)


@contextlib.contextmanager
def held_call(state, nbytes):
    """A /v1 call in progress, of `nbytes`: counted with the futures table (check_room)."""
    state.openai_calls += 1
    state.held_bytes += nbytes
    try:
        yield
    finally:
        state.openai_calls -= 1
        state.held_bytes -= nbytes


def openai_events(answer, chat):
    """`answer` as server-sent events. The engine hands over finished requests: one event per
    choice, all at once."""
    for choice in answer["choices"]:
        if chat:
            choice["delta"] = choice.pop("message")
        # OpenAI's delta format: each tool call with its place in the message's list
        for i, call in enumerate(choice.get("delta", {}).get("tool_calls", [])):
            call["index"] = i
    object_type = "chat.completion.chunk" if chat else "text_completion"
    events = "".join(
        f"data: {json.dumps({**answer, 'object': object_type, 'choices': [c]})}\n\n"
        for c in answer["choices"]
    )
    return web.Response(text=events + "data: [DONE]\n\n", content_type="text/event-stream")


def openai_answer(app, chat, prompt, completions, logprobs, tools):
    """OpenAI's answer, plus prompt_token_ids and, per choice, token_ids and weight_version; with
    `tools` (a tool_request), the tool calls that the --tool-call-parser finds in each choice."""
    choices = []
    for i, c in enumerate(completions):
        text = {"message": chat_message(app[STATE], c, tools)} if chat else {"text": c.text}
        choice = {
            "index": i,
            **text,
            "finish_reason": c.finish_reason,
            "token_ids": c.token_ids,
            "weight_version": c.version,
            "logprobs": openai_logprobs(app[ENGINE], c, chat) if logprobs else None,
        }
        # as vLLM's server answers a turn whose tool calls it parsed
        if "tool_calls" in text.get("message", {}):
            choice["finish_reason"] = "tool_calls"
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": app[STATE].flags.served_model_name,
        "choices": choices,
        "prompt_token_ids": prompt,
        "weight_version": completions[0].version,
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens,
        },
    }


def chat_message(state, completion, tools) -> dict:
    """A chat choice's message: the model's text, or, where the --tool-call-parser (vLLM's own)
    finds tool calls in it, those as `tool_calls` and the text outside them as `content`."""
    message = {"role": "assistant", "content": completion.text}
    if tools is not None:
        found = state.tool_parser(tools.tools).extract_tool_calls(completion.text, tools)
        if found.tools_called:
            message["content"] = found.content
            message["tool_calls"] = [call.model_dump() for call in found.tool_calls]
    return message


def openai_logprobs(engine, completion, chat) -> dict:
    """A choice's `logprobs` in OpenAI's shape: chat's per-token list, or completions' columns."""
    tokens = [engine.tokenizer.decode([t]) for t in completion.token_ids]
    alternatives = completion.top_logprobs or [[] for _ in tokens]
    if chat:
        content = zip(tokens, completion.logprobs, alternatives)
        return {"content": [{"token": t, "logprob": lp, "top_logprobs": a} for t, lp, a in content]}
    return {
        "tokens": tokens,
        "token_logprobs": completion.logprobs,
        "text_offset": list(itertools.accumulate(map(len, tokens), initial=0))[:-1],
        "top_logprobs": [{a["token"]: a["logprob"] for a in alt} for alt in alternatives],
    }


def open_session(state, session_id, reserve):
    """The X-Session-ID session (made if new) with room reserved for `reserve` more tokens, or a
    429: at most --max-pending sessions, --max-session-tokens in one, --max-total-session-tokens in
    all. Nothing is awaited between the checks and the reservation, so concurrent calls cannot
    pass a bound together."""
    flags = state.flags
    now = time.monotonic()
    expire_sessions(state)
    session = state.sessions.get(session_id, {"calls": [], "tokens": 0, "started": now})
    total = sum(s["tokens"] for s in state.sessions.values())
    if (
        (session_id not in state.sessions and len(state.sessions) >= flags.max_pending)
        or session["tokens"] + reserve > flags.max_session_tokens
        or total + reserve > flags.max_total_session_tokens
    ):
        raise ApiError(
            f"{len(state.sessions)} sessions (--max-pending) hold {total} tokens "
            f"(--max-total-session-tokens), {session_id!r} {session['tokens']} "
            f"(--max-session-tokens); this call may add {reserve}: delete some sessions",
            429,
        )
    session["tokens"] += reserve
    session["used"] = now
    state.sessions[session_id] = session
    return session


def expire_sessions(state):
    """Drop the sessions unused for --session-ttl s, or begun --max-session-age s ago."""
    flags = state.flags
    for session_id, s in list(state.sessions.items()):
        expires = min(s["used"] + flags.session_ttl, s["started"] + flags.max_session_age)
        if expires < time.monotonic():
            del state.sessions[session_id]


def record(session, prompt, completions, reserved):
    """Append a call's choices to its session, in place of the `reserved` tokens."""
    session["calls"] += [
        {
            "prompt_token_ids": prompt,
            "completion_token_ids": c.token_ids,
            "logprobs": c.logprobs,
            "weight_version": c.version,
            "versions": c.versions,
            "text": c.text,
            "finish_reason": c.finish_reason,
        }
        for c in completions
    ]
    session["tokens"] += sum(len(prompt) + len(c.token_ids) for c in completions) - reserved
    session["used"] = time.monotonic()


def merge(calls) -> tuple[dict | None, str | None]:
    """One episode from a session's calls, as JSON in the shape of a /rollout one, if each call's
    prompt continues the previous call's prompt and completion token for token (else None and
    why): the tokens between are prompt (a tool's output, the chat template's), the completions are
    sampled."""
    if not calls:
        return None, "no call of this session has finished yet"
    turns = [
        {"text": c["text"], "version": c["weight_version"], "finish_reason": c["finish_reason"]}
        for c in calls
    ]
    episode = Episode([], [], [], turns, [], turns[-1]["finish_reason"], versions=[])
    for i, call in enumerate(calls):
        prompt = call["prompt_token_ids"]
        if prompt[: len(episode.token_ids)] != episode.token_ids:
            return None, (
                f"call {i}'s prompt does not continue the tokens before it "
                "(re-tokenised text, or a call with n > 1): train on 'calls' instead"
            )
        episode.append(prompt[len(episode.token_ids) :], logprobs=None)
        # each call's version spans, counted from its completion's first token
        start = len(episode.token_ids)
        episode.versions += [[v, start + first] for v, first in call["versions"]]
        episode.append(call["completion_token_ids"], call["logprobs"])
    return vars(episode), None


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


ROUTES = [
    web.get("/v1/models", models),
    web.post("/v1/completions", openai_completion),
    web.post("/v1/chat/completions", openai_completion),
    web.get("/v1/sessions/{session_id}", session),
    web.delete("/v1/sessions/{session_id}", session),
]
