"""OpenAI's shapes for server.py's /v1 routes: the answer (every one carries its tokens,
prompt_token_ids and per choice token_ids, and weight_version) and the sessions, which record the
calls sent with an X-Session-ID header and merge them into one episode, so that an agent written
against the OpenAI client can be trained on exactly what it sampled (docs/http.md).
"""

import itertools
import json
import time
import uuid

from aiohttp import web

from client import Episode


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
        raise web.HTTPTooManyRequests(
            text=f"{len(state.sessions)} sessions (--max-pending) hold {total} tokens "
            f"(--max-total-session-tokens), {session_id!r} {session['tokens']} "
            f"(--max-session-tokens); this call may add {reserve}: delete some sessions"
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


def openai_answer(state, engine, chat, prompt, completions, logprobs, tools):
    """OpenAI's answer, plus prompt_token_ids and, per choice, token_ids and weight_version; with
    `tools` (a tool_request), the tool calls that the --tool-call-parser finds in each choice."""
    choices = []
    for i, c in enumerate(completions):
        text = {"message": chat_message(state, c, tools)} if chat else {"text": c.text}
        choice = {
            "index": i,
            **text,
            "finish_reason": c.finish_reason,
            "token_ids": c.token_ids,
            "weight_version": c.version,
            "logprobs": openai_logprobs(engine, c, chat) if logprobs else None,
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
        "model": state.flags.served_model_name,
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
    episode = Episode(turns=turns, finish_reason=turns[-1]["finish_reason"], versions=[])
    for i, call in enumerate(calls):
        prompt = call["prompt_token_ids"]
        if prompt[: len(episode.token_ids)] != episode.token_ids:
            return None, (
                f"call {i}'s prompt does not continue the tokens before it "
                "(re-tokenised text, or a call with n > 1): train on 'calls' instead"
            )
        episode.append(prompt[len(episode.token_ids) :], logprobs=None)
        episode.append(call["completion_token_ids"], call["logprobs"], call["versions"])
    return vars(episode), None
