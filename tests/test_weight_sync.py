"""Versioned weight sync into the running server, over real gloo transfers (and on a GPU machine
CUDA IPC and NCCL: the tests marked gpu).

Run: .venv/bin/python -m pytest tests/test_weight_sync.py
"""

import base64
import math
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch
import urllib3.connection
from transformers import AutoModelForCausalLM, AutoTokenizer

import server as server_module
import train
from client import Client, IpcBuffer, ServerError, fill_bucket, pack
from conftest import GPU_FLAGS, needs_cuda, needs_two_gpus
from local import launch_server, stop_server

PROMPTS = ["hello world", "the cat sat", "1+2="]


@pytest.fixture(scope="module")
def hf(model_path):
    return AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32
    ), AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(
    params=["gloo", pytest.param("ipc", marks=pytest.mark.gpu)]
    if torch.cuda.is_available()
    else ["gloo"]
)
def trainer(server, request):
    """The server with a trainer (this process) set up for weight sync over each transport it can
    use."""
    server.init_communicator(transport=request.param)
    yield server
    server.close_communicator()


def perturbed(model, seed, scale=0.05):
    copy = AutoModelForCausalLM.from_config(model.config)
    copy.load_state_dict(model.state_dict())
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn_like(p) * scale)
    return copy


def hf_greedy(model, tokenizer, prompts, max_tokens=24):
    out = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
            )
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def server_greedy(client, prompts=PROMPTS, max_tokens=24):
    results = client.generate(prompts, temperature=0.0, max_tokens=max_tokens)
    return [r[0].token_ids for r in results], {r[0].version for r in results}


@pytest.mark.gpu
def test_pushed_weights_give_transformers_greedy_tokens_and_versions(trainer, hf):
    model, tokenizer = hf
    v0 = trainer.health()["version"]
    original, _ = server_greedy(trainer)
    assert original == hf_greedy(model, tokenizer, PROMPTS)

    new = perturbed(model, seed=1)
    assert trainer.update_model_params(new) == v0 + 1
    tokens, versions = server_greedy(trainer)
    assert versions == {v0 + 1} and trainer.health()["version"] == v0 + 1
    # would fail with a stale packed (tied) lm_head
    assert tokens == hf_greedy(new, tokenizer, PROMPTS)
    assert tokens != original

    # a state dict, several buckets
    assert trainer.update_model_params(model.state_dict(), bucket_mb=1) == v0 + 2
    assert server_greedy(trainer) == (original, {v0 + 2})
    # the update says how each tensor loaded: on a GPU, from the second update on, most straight
    # into vLLM's parameters (engine.DirectLoads); on the CPU all through vLLM's loader
    loaded = trainer.last_update
    sent = len(dict(model.named_parameters()))
    assert loaded["tensors_direct"] + loaded["tensors_load_weights"] == sent
    assert (loaded["tensors_direct"] > 0) == torch.cuda.is_available()


def wait_for_status(client, status, timeout=30):
    deadline = time.monotonic() + timeout
    while client.health()["status"] != status:
        assert time.monotonic() < deadline, f"server never reached status {status}"
        time.sleep(0.01)


@pytest.mark.gpu
def test_request_in_flight_keeps_old_version_and_request_during_update_gets_new(trainer, hf):
    v0 = trainer.health()["version"]
    early = trainer.generate(["in flight"], n=4, max_tokens=1000, ignore_eos=True, is_async=True)
    update = {}
    pusher = threading.Thread(
        target=lambda: update.setdefault("version", trainer.update_model_params(hf[0]))
    )
    pusher.start()
    wait_for_status(trainer, "updating")  # the gate is closed: the update is draining `early`
    late = Client(trainer.base_url).generate(["during update"], n=4, max_tokens=8, is_async=True)
    pusher.join(120)
    assert update["version"] == v0 + 1
    # drain: no completion mixes two versions
    assert [c.versions for c in early.result()[0]] == [[[v0, 0]]] * 4
    assert [c.versions for c in late.result()[0]] == [[[v0 + 1, 0]]] * 4


def hf_continue(model, ids, n):
    """transformers' greedy continuation of token ids `ids` by `n` tokens, end-of-text included
    (as the server's with ignore_eos)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.mark.gpu
def test_a_request_spanning_an_in_flight_update_goes_on_with_the_new_weights(trainer, hf):
    model, tokenizer = hf
    new, v0 = perturbed(model, seed=7), trainer.health()["version"]
    prompt = tokenizer("spanning").input_ids
    trainer.generate([prompt], max_tokens=64, ignore_eos=True)  # a fresh engine's decoding is slow
    spanning = trainer.generate(
        [prompt], temperature=0.0, max_tokens=1900, ignore_eos=True, is_async=True
    )
    wait_for_in_flight(trainer)
    try:
        assert trainer.update_model_params(new, mode="in-flight") == v0 + 1
        [[c]] = spanning.result()
    finally:
        trainer.update_model_params(model)
    [[old, zero], [now, paused]] = c.versions
    assert (old, zero, now) == (v0, 0, v0 + 1) and 16 < paused < len(c.token_ids) - 32
    # greedy up to the pause point on the old weights, and from it on the new ones
    before = prompt + c.token_ids[: paused - 16]
    assert c.token_ids[paused - 16 : paused] == hf_continue(model, before, 16)
    assert c.token_ids[paused : paused + 32] == hf_continue(new, prompt + c.token_ids[:paused], 32)


def wait_for_in_flight(client, seconds=1.0):
    """Return `seconds` after a request started generating (at ~2 ms per token here)."""
    deadline = time.monotonic() + 30
    while not client.health()["in_flight"]:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    time.sleep(seconds)


def post(client, path, body):
    return requests.post(client.base_url + path, json=body, timeout=60)


@pytest.mark.parametrize(
    "param,word",
    [
        (
            {"name": "no.such.weight", "dtype": "float32", "shape": [4], "offset": 0},
            "unknown parameter",
        ),
        ({"name": "model.norm.weight", "dtype": "float32", "shape": [3, 3], "offset": 0}, "shape"),
        ({"name": "model.norm.weight", "dtype": "bfloat16", "shape": [128], "offset": 0}, "dtype"),
        ({"name": "model.norm.weight", "dtype": "float32", "shape": [128], "offset": 8}, "offset"),
        (
            {"name": "model.norm.weight", "dtype": "float32", "shape": [128], "offset": 1024},
            "does not fit",
        ),
    ],
)
def test_bad_update_is_rejected_and_changes_nothing(trainer, param, word):
    before = server_greedy(trainer), trainer.health()["version"]
    r = post(trainer, "/update_weights", {"buckets": [{"size": 512, "params": [param]}]})
    assert r.status_code == 400 and word in r.json()["error"]
    assert (server_greedy(trainer), trainer.health()["version"]) == before


def test_a_bucket_larger_than_its_params_is_a_400_before_the_server_allocates_it(trainer):
    """A bucket's size is what the server allocates to receive into: a petabyte is refused, not
    tried (which failed only after the workers had begun to receive)."""
    params, end = [], 0
    for name, shape in trainer.spec.items():
        params.append({"name": name, "dtype": "float32", "shape": shape, "offset": end})
        end += (4 * math.prod(shape) + 15) // 16 * 16
    version = trainer.health()["version"]
    r = post(trainer, "/update_weights", {"buckets": [{"size": 10**15, "params": params}]})
    assert r.status_code == 400 and "'size' must be between" in r.json()["error"]
    assert trainer.health()["version"] == version


@pytest.mark.parametrize(
    "params,word",
    [
        ({"bogus.weight": torch.zeros(2)}, "unknown parameter"),
        ({"model.norm.weight": torch.zeros(3)}, "shape"),
        ({"model.norm.weight": torch.zeros(128)}, "every parameter"),
    ],
)
def test_client_update_with_wrong_names_or_shapes_is_refused_before_sending(trainer, params, word):
    v0 = trainer.health()["version"]
    with pytest.raises(ServerError, match=word) as refused:
        trainer.update_model_params(params)
    assert refused.value.status == 400
    assert trainer.health()["version"] == v0 and trainer.health()["transport"] == trainer.transport


DYING_TRAINER = """
import os, sys, torch
sys.path.insert(0, {root!r})
from client import Client, broadcast, pack
c = Client({url!r})
c.init_communicator({transport!r}, device={device!r}, weight_sync_timeout=30)
buckets = pack(c._named_tensors(torch.load({weights!r})), 64 << 10)  # many small buckets
# the server answers a first line once its workers receive
body = {{"buckets": [b for b, _ in buckets], "mode": {mode!r}}}
answer = c._request("POST", "/update_weights", body, stream=True)
next(answer.iter_lines())
# one of many, then die
broadcast(c.group, torch.zeros(buckets[0][0]["size"], dtype=torch.uint8, device=c.device), 30)
print("sent one bucket", flush=True)
os._exit(1)
"""


@pytest.mark.parametrize(
    "transport,device",
    [
        ("gloo", "cpu"),
        pytest.param("nccl", "cuda:1", marks=[pytest.mark.gpu, needs_two_gpus]),
    ],
)
@pytest.mark.parametrize("mode", ["drain", "in-flight"])
def test_trainer_dying_mid_update_leaves_server_serving_old_weights(
    server, hf, tmp_path, transport, device, mode
):
    model, _ = hf
    before = server_greedy(server)
    v0 = server.health()["version"]
    # a request in flight: drained first, or paused through the failed update and then resumed
    long = dict(temperature=0.0, max_tokens=1900, ignore_eos=True)
    early = server.generate(["in flight"], is_async=True, **long)
    weights = tmp_path / "weights.pt"
    torch.save(perturbed(model, seed=2).state_dict(), weights)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = DYING_TRAINER.format(
        root=root,
        url=server.base_url,
        weights=str(weights),
        transport=transport,
        device=device,
        mode=mode,
    )
    dying = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "sent one bucket" in dying.stdout, dying.stderr[-2000:]
    start = time.monotonic()
    assert server_greedy(server) == (before[0], {v0})  # waits at the gate until the update failed
    assert time.monotonic() - start < 60 + 15  # the server's --weight-sync-timeout plus a margin
    assert server.health()["version"] == v0
    [[c]] = early.result()  # on the old weights from its first token to its last
    assert c.versions == [[v0, 0]]
    assert c.token_ids == server.generate(["in flight"], **long)[0][0].token_ids

    server.init_communicator()  # a new trainer can join and update
    try:
        assert server.update_model_params(model) == v0 + 1
        assert server_greedy(server)[0] == before[0]
    finally:
        server.close_communicator()


def test_close_then_init_again(server, hf):
    v0 = server.health()["version"]
    for i in range(2):
        server.init_communicator()
        assert server.update_model_params(hf[0]) == v0 + i + 1
        server.close_communicator()
    r = post(
        server,
        "/update_weights",
        {
            "buckets": [
                {
                    "size": 512,
                    "params": [
                        {"name": n, "dtype": "float32", "shape": shape, "offset": 0}
                        for n, shape in list(server.spec.items())[:1]
                    ],
                }
            ]
        },
    )
    assert r.status_code == 400  # an update must carry every parameter
    params, offset = [], 0
    for n, shape in server.spec.items():
        params.append({"name": n, "dtype": "float32", "shape": shape, "offset": offset})
        offset += (4 * math.prod(shape) + 15) // 16 * 16
    full = [{"size": offset, "params": params}]
    r = post(server, "/update_weights", {"buckets": full})
    assert r.status_code == 409 and "init_communicator" in r.json()["error"]  # no group after close


def test_updates_go_over_one_kept_connection(trainer, hf, monkeypatch):
    """An update's streamed answer is read to its end, so the next update reuses its connection
    rather than opening (and the server setting up) a new one."""
    connects = []
    connect = urllib3.connection.HTTPConnection.connect

    def counted(self):
        connects.append(self.port)
        return connect(self)

    trainer.update_model_params(hf[0])
    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect", counted)
    for _ in range(3):
        trainer.update_model_params(hf[0])
    assert connects == []


def recorded_bodies(monkeypatch) -> list:
    """The bodies the clients send from now on."""
    bodies, request = [], Client._request

    def recorded(self, method, path, body=None, *args, **options):
        bodies.append(body)
        return request(self, method, path, body, *args, **options)

    monkeypatch.setattr(Client, "_request", recorded)
    return bodies


def test_a_push_of_the_same_layout_sends_no_params_and_loads_the_new_weights(
    trainer, hf, monkeypatch, restore_weights
):
    """From the second push of a model on, the body names the version whose buckets' params it
    reuses, not the params; the server loads the new weights all the same."""
    model, tokenizer = hf
    bodies = recorded_bodies(monkeypatch)
    v1 = trainer.update_model_params(perturbed(model, seed=5))
    new = perturbed(model, seed=6)
    assert trainer.update_model_params(new) == v1 + 1
    assert "same_layout" not in bodies[0] and bodies[1]["same_layout"] == v1
    assert all("params" not in b for b in bodies[1]["buckets"])
    assert server_greedy(trainer) == (hf_greedy(new, tokenizer, PROMPTS), {v1 + 1})


@pytest.mark.parametrize(
    "change,word",
    [
        (lambda body: body | {"same_layout": body["same_layout"] - 1}, "last update made"),
        (lambda body: body | {"same_layout": True}, "last update made"),
        (lambda body: body | {"buckets": body["buckets"] * 2}, "number and sizes"),
        (lambda body: body | {"buckets": [{"size": 16}]}, "number and sizes"),
        (
            lambda body: body | {"buckets": [b | {"params": []} for b in body["buckets"]]},
            "name no params",
        ),
    ],
)
def test_a_same_layout_update_unlike_the_last_one_is_refused(
    trainer, hf, monkeypatch, change, word
):
    bodies = recorded_bodies(monkeypatch)
    trainer.update_model_params(hf[0])
    v = trainer.update_model_params(hf[0])
    # the second push's body, naming the version the push before it made: now the last one's
    r = post(trainer, "/update_weights", change(bodies[-1] | {"same_layout": v}))
    assert r.status_code == 400 and word in r.json()["error"], r.text
    assert trainer.health()["version"] == v
    # the trainer's own next push still goes
    assert trainer.update_model_params(hf[0]) == v + 1


def test_after_a_refused_reference_the_next_push_sends_the_params(trainer, hf, monkeypatch):
    bodies = recorded_bodies(monkeypatch)
    v = trainer.update_model_params(hf[0])
    # as if another update had come in between
    trainer.layout = (v - 1, trainer.layout[1])
    with pytest.raises(ServerError, match="last update made"):
        trainer.update_model_params(hf[0])
    assert trainer.update_model_params(hf[0]) == v + 1
    assert "same_layout" in bodies[-2] and "same_layout" not in bodies[-1]


def test_a_refused_init_communicator_leaves_the_weight_sync_set_up_before(server, hf):
    """init_communicator("cpu") (a device where a transport goes), refused, and a call the server
    refuses change nothing: the weight sync set up before still pushes."""
    server.init_communicator(transport="gloo")
    try:
        v0 = server.health()["version"]
        with pytest.raises(ValueError, match="transport must be one of"):
            server.init_communicator("cpu")
        r = post(server, "/init_communicator", {"transport": "gloo", "world_size": 2})
        assert r.status_code == 400 and server.health()["transport"] == "gloo"
        assert server.update_model_params(hf[0]) == v0 + 1
    finally:
        server.close_communicator()


def test_an_update_whose_caller_goes_away_after_sending_still_lands(server, hf):
    model, tokenizer = hf
    new = perturbed(model, seed=5)
    server.init_communicator(transport="gloo")
    v0 = server.health()["version"]
    buckets = pack(server._named_tensors(new), 32 << 20)
    body = {"buckets": [b for b, _ in buckets]}
    answer = server._request("POST", "/update_weights", body, stream=True)
    next(answer.iter_lines())  # the workers receive
    server._send_buckets(buckets)
    answer.close()  # gone before the new version is answered
    deadline = time.monotonic() + 60
    while server.health()["version"] != v0 + 1:
        assert time.monotonic() < deadline, "the update was cancelled with its caller"
        time.sleep(0.05)
    try:
        assert server_greedy(server) == (hf_greedy(new, tokenizer, PROMPTS), {v0 + 1})
    finally:
        server.init_communicator(transport="gloo")
        server.update_model_params(model)
        server.close_communicator()


def failing_server(load, tmp_path, monkeypatch):
    """A server whose workers' `load`-th weight load fails after half its tensors: a worker of the
    tests' own (tests/failing_worker.py), as what makes a real load fail part-way (a CUDA error, a
    model family loaded wrongly) cannot be produced at will here."""
    monkeypatch.setenv("ASYNC_GRPO_WORKER", "tests.failing_worker.FailingLoadWorker")
    monkeypatch.setenv("ASYNC_GRPO_FAIL_LOAD", str(load))
    return launch_server(*GPU_FLAGS, log_path=tmp_path / "server.log")


def test_a_load_that_fails_part_way_stops_the_server_non_zero_and_the_trainer_at_once(
    model_path, tmp_path, monkeypatch
):
    """Drain updates, from train.py: its first push loads, its second (after step 0) fails part
    way. The trainer stops with the server's error rather than reconnecting (it would wait
    --reconnect-timeout for a server that exits), nothing is served on the mixed weights, and the
    server exits non-zero for a supervisor to restart it."""
    proc, client = failing_server(2, tmp_path, monkeypatch)
    cfg = train.Config(
        model=model_path,
        steps=3,
        prompts_per_step=4,
        micro_batches=2,
        group_size=2,
        out=str(tmp_path / "run"),
        reconnect_timeout=600,
    )
    try:
        with pytest.raises(ServerError) as failed:
            train.train(cfg, client)
        assert failed.value.status == 500 and "ASYNC_GRPO_FAIL_LOAD" in failed.value.message
        with pytest.raises((ServerError, ConnectionError)):
            client.generate(["mixed?"], max_tokens=2)
        assert proc.wait(60) != 0
        assert "engine failed" in (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            stop_server(proc)


def test_an_in_flight_load_that_fails_part_way_never_resumes_the_paused_requests(
    hf, tmp_path, monkeypatch
):
    proc, client = failing_server(1, tmp_path, monkeypatch)
    try:
        client.init_communicator(transport="gloo")
        # paused by the update, never resumed on the mixed weights
        paused = client.generate(["x"], max_tokens=1900, ignore_eos=True, is_async=True)
        wait_for_in_flight(client, seconds=0)
        with pytest.raises(ServerError) as failed:
            client.update_model_params(perturbed(hf[0], seed=6), mode="in-flight")
        assert failed.value.status == 500 and "ASYNC_GRPO_FAIL_LOAD" in failed.value.message
        # nothing is served on the mixed weights, and the server exits for a supervisor to restart
        with pytest.raises((ServerError, ConnectionError)):
            client.generate(["mixed?"], max_tokens=2)
        with pytest.raises((ServerError, ConnectionError)):
            paused.result()
        assert proc.wait(60) != 0
        assert "engine failed" in (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            stop_server(proc)


NO_VLLM_TRAINER = """
import sys
# from here on `import vllm` raises ImportError, as on a trainer machine without it
sys.modules["vllm"] = None
sys.path.insert(0, {root!r})
import torch
from transformers import AutoModelForCausalLM
from client import Client
try:
    import vllm
    raise SystemExit("vllm was importable")
except ImportError:
    pass
c = Client({url!r})
c.init_communicator("gloo")
print("version", c.update_model_params(AutoModelForCausalLM.from_pretrained({path!r})), flush=True)
c.close_communicator()
"""


def test_a_trainer_without_vllm_pushes_weights(server, hf, tmp_path, restore_weights):
    model, tokenizer = hf
    new = perturbed(model, seed=3)
    new.save_pretrained(tmp_path / "new")
    v0 = server.health()["version"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = NO_VLLM_TRAINER.format(root=root, url=server.base_url, path=str(tmp_path / "new"))
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"version {v0 + 1}" in run.stdout
    assert server_greedy(server) == (hf_greedy(new, tokenizer, PROMPTS), {v0 + 1})


@pytest.mark.gpu
@pytest.mark.parametrize(
    "body,word",
    [
        ({"transport": "pigeon"}, "transport"),
        ({"transport": "gloo", "host": "127.0.0.1", "world_size": 7}, "world_size"),
        ({"transport": "gloo", "world_size": 2}, "host"),
        ({"transport": "ipc", "gpu": "GPU-not-this-one"}, "ipc"),
        (
            {"transport": "nccl", "host": "127.0.0.1", "world_size": 2}
            if not torch.cuda.is_available()
            else {"transport": "nccl"},
            "",
        ),
    ],
)
def test_a_transport_the_server_cannot_follow_is_refused(server, body, word):
    r = post(server, "/init_communicator", body)
    assert r.status_code == 400 and word in r.json()["error"]
    assert server.health()["transport"] is None
    assert server.generate(["still serving"], max_tokens=4)[0][0].finish_reason is not None


def test_the_ipc_fill_writes_what_fill_bucket_does_through_views_kept_for_the_layout():
    """IpcBuffer.fill (CUDA only in use; its buffer, views and copies are the same on a CPU): the
    bytes of fill_bucket, cast on the way; a second fill of the same layout reuses its buffer and
    views and writes the new values; another layout gets views and a buffer of its own, and the
    old buffer's handle is dropped."""
    ipc = IpcBuffer(torch.device("cpu"))
    named = [(f"w{i}", torch.randn(3, 5 + i)) for i in range(4)]
    [(bucket, tensors)] = pack(named, math.inf, torch.bfloat16)
    expected = torch.zeros(bucket["size"], dtype=torch.uint8)
    fill_bucket(expected, bucket, tensors)
    ipc.fill(bucket, tensors)
    assert torch.equal(ipc.buffer, expected)
    buffer, views = ipc.buffer, ipc.views
    # share() would keep the buffer's handle (CUDA only): it stands for one here
    ipc.handle = {"handle": "of this buffer"}
    # new values in the same layout (the next update)
    tensors = [-2 * t for t in tensors]
    fill_bucket(expected, bucket, tensors)
    ipc.fill(bucket, tensors)
    assert torch.equal(ipc.buffer, expected)
    assert ipc.buffer is buffer and ipc.views is views and ipc.handle is not None
    [(other, tensors)] = pack(named[:2], math.inf, torch.bfloat16)
    ipc.fill(other, tensors)
    assert ipc.views is not views and len(ipc.views) == 2
    assert ipc.buffer is not buffer and ipc.handle is None


@pytest.mark.gpu
@needs_cuda
def test_the_trainer_on_the_servers_gpu_uses_ipc_by_default(server, hf):
    server.init_communicator()
    try:
        assert server.transport == "ipc" and server.health()["transport"] == "ipc"
        v0 = server.health()["version"]
        for i in range(3):  # the server keeps the trainer's buffer open: later updates reuse it
            assert server.update_model_params(hf[0]) == v0 + i + 1
        assert server.last_update["receive_s"] < 1.0
        # the handle, and the views the worker kept of it, carry each later update's new bytes
        model, tokenizer = hf
        new = perturbed(model, seed=5)
        assert server.update_model_params(new) == v0 + 4
        assert server_greedy(server) == (hf_greedy(new, tokenizer, PROMPTS), {v0 + 4})
        assert server.update_model_params(model) == v0 + 5
        assert server_greedy(server) == (hf_greedy(model, tokenizer, PROMPTS), {v0 + 5})
    finally:
        server.close_communicator()


@pytest.mark.gpu
@needs_two_gpus
def test_nccl_update_from_a_trainer_on_another_gpu(server, hf):
    model, tokenizer = hf
    new = perturbed(model, seed=4)
    v0 = server.health()["version"]
    server.init_communicator(transport="nccl", device="cuda:1")
    try:
        assert server.update_model_params(new) == v0 + 1
        assert server_greedy(server) == (hf_greedy(new, tokenizer, PROMPTS), {v0 + 1})
        assert server.update_model_params(model) == v0 + 2
    finally:
        server.close_communicator()


def test_the_trainers_group_store_listens_on_its_host_alone(server):
    """The trainer hosts the weight group's TCPStore at `host` (127.0.0.1 here): another address of
    this machine (127.0.0.2, loopback too) reaches nothing, where every interface once did."""
    server.init_communicator(transport="gloo", host="127.0.0.1")
    try:
        port = server.health()["group_port"]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5)
    finally:
        server.close_communicator()


# a handle as client.share_cuda writes it, of a 1 MiB buffer
HANDLE = {
    "offset": 0,
    "device": 0,
    "handle": "AAAA",
    "storage_bytes": 1 << 20,
    "storage_offset": 0,
    "ref": base64.b64encode(b"/torch_4242_123456_0").decode(),
    "ref_offset": 3,
    "event": None,
    "event_sync": False,
    "gpu": "GPU-0",
}


@pytest.mark.parametrize(
    "bad",
    [
        # a worker would increment an int64 of any shared-memory file, at any offset
        {"ref": base64.b64encode(b"/psm_other_program").decode()},
        {"ref": base64.b64encode(b"/torch_1_2_3/../../x").decode()},
        {"ref": "not base64!"},
        {"ref_offset": 10**6},
        {"ref_offset": -8},
        # a buffer smaller than its bucket
        {"storage_bytes": 1000},
        {"offset": (1 << 20) - 100},
        {"storage_offset": -1},
    ],
)
def test_an_ipc_handle_naming_another_file_or_offset_is_refused(bad):
    """server.check_handle on ipc handles (no GPU here: the route cannot reach it on the CPU)."""
    server_module.check_handle(HANDLE, "ipc", 4096)
    with pytest.raises(server_module.ApiError) as refused:
        server_module.check_handle(HANDLE | bad, "ipc", 4096)
    assert "ref" in refused.value.text
