"""Scaling out: one trainer over two servers (client.Router), and train.py under torchrun (FSDP2).

Run: .venv/bin/python -m pytest tests/test_scale.py

The two servers are started once for the whole file: a plain one and one with
--data-parallel-size 2 (two engine replicas behind one HTTP server), so that the data-parallel
ranks are tested too. The torchrun test runs train.py twice on the plain one, with seeded requests
(--seed-requests) so that both runs get the same samples.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch
from safetensors.torch import load_file
from test_weight_sync import hf_greedy, perturbed, wait_for_in_flight
from transformers import AutoModelForCausalLM, AutoTokenizer

import tasks
import train
from client import Client, Router, free_port, push_until_done
from conftest import GPU_FLAGS, run_in_process, stop_in_background
from local import launch_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the data-parallel server's replicas: on the CPU both share it; on GPUs each needs its own
DATA_PARALLEL = () if torch.cuda.device_count() == 1 else ("--data-parallel-size", "2")
needs_data_parallel = pytest.mark.skipif(
    not DATA_PARALLEL, reason="--data-parallel-size 2 needs two GPUs on a GPU machine"
)
PROMPTS = ["hello world", "the cat sat", "1+2="]


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    """{"plain": (process, ports), "data-parallel": (...)}, started side by side; a test that
    restarts one puts the new process here."""
    logs, started = tmp_path_factory.mktemp("scale"), {}

    def start(name, *flags):
        ports = {"port": free_port(), "group_port": free_port()}
        proc, _ = launch_server(
            "--model", model_path, *GPU_FLAGS, *flags, log_path=logs / f"{name}.log", **ports
        )
        started[name] = (proc, ports)

    try:
        with ThreadPoolExecutor(2) as pool:
            starts = [
                # a push that finds a request in flight there longer than 1 s is refused (503)
                pool.submit(start, "plain", "--drain-timeout", "1"),
                pool.submit(start, "data-parallel", *DATA_PARALLEL),
            ]
        for s in starts:
            s.result()
        yield started
    finally:
        for proc, _ in started.values():
            stop_in_background(proc)


@pytest.fixture
def router(servers):
    """A Router over both servers (the plain one first), weight sync set up over gloo."""
    router = Router(
        [f"http://127.0.0.1:{servers[n][1]['port']}" for n in ("plain", "data-parallel")]
    )
    router.init_communicator(transport="gloo")
    yield router
    router.close_communicator()


@pytest.fixture(scope="module")
def hf(model_path):
    return AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32
    ), AutoTokenizer.from_pretrained(model_path)


def greedy(client, prompts=PROMPTS, copies=1):
    """Each prompt's greedy tokens, asked `copies` times at once (a data-parallel server spreads
    them over its replicas): [[tokens of each copy] per prompt] and the versions seen."""
    futures = [
        client.generate(prompts, temperature=0.0, max_tokens=24, is_async=True)
        for _ in range(copies)
    ]
    results = [f.result() for f in futures]
    tokens = [[r[i][0].token_ids for r in results] for i in range(len(prompts))]
    return tokens, {c[0].version for r in results for c in r}


def test_split_prompts_go_to_the_server_with_the_fewest_pending(router):
    plain, data_parallel = router.clients
    # six prompts pending on the plain server
    waiting = plain.generate(["x"] * 6, max_tokens=2, is_async=True)
    futures = router.submit_each([f"{i}+1=" for i in range(8)], n=2, max_tokens=4)
    # the other server takes prompts until it has six too; then they alternate
    assert [f.client is plain for f in futures] == [False] * 6 + [True, False]
    done = list(router.as_completed(futures))
    assert {f.request_id for f, _ in done} == {f.request_id for f in futures}
    assert all(len(result[0]) == 2 for _, result in done)
    waiting.result()


def test_a_batch_is_spread_over_the_servers_by_prompts(router):
    """Each prompt to the server with the fewest pending; the results in the batch's order, as
    one server gives them (greedy, same weights)."""
    plain, data_parallel = router.clients
    prompts = [f"{i}+1=" for i in range(6)]
    future = router.generate(prompts, temperature=0.0, max_tokens=4, is_async=True)
    assert [sum(c.pending.values()) for c in router.clients] == [3, 3]
    results = future.result()
    expected = plain.generate(prompts, temperature=0.0, max_tokens=4)
    assert [r[0].token_ids for r in results] == [r[0].token_ids for r in expected]


def keep_busy(client):
    """A request generating on `client` for ~5 s on 2 cores, past the plain server's drain (1 s)
    and a push's 2-s deadline: 32 sequences of 1,500 tokens (one sequence took 1.7 s on a fast
    machine, and a push went through)."""
    busy = client.generate(["busy"], n=32, max_tokens=1500, ignore_eos=True, is_async=True)
    wait_for_in_flight(client, seconds=0.1)
    return busy


def test_a_busy_server_stays_live_and_takes_the_update(router, hf):
    """The plain server answers 503 to a push while a request runs there longer than its
    --drain-timeout (1 s): it is up and busy, not lost. The Router asks again until the drain
    succeeds, and every server ends at the new version."""
    model, _ = hf
    plain, data_parallel = router.clients
    busy = keep_busy(plain)
    version = router.update_model_params(perturbed(model, seed=8))
    assert router.live == [plain, data_parallel]
    assert plain.health()["version"] == data_parallel.health()["version"] == version
    assert busy.result()[0][0].version == version - 1
    router.update_model_params(model)


# the server whose weight sync break_weight_sync_once breaks (a test puts its Client here)
BREAK = {}


def break_weight_sync_once(completion, row):
    """addition's reward; its first call (step 0 trains) closes the weight sync of the server in
    BREAK from the server's side: the push after the step is refused there (409, no weight sync),
    and the Router drops a server that is up, and holds the next step's requests."""
    if "client" in BREAK:
        BREAK.pop("client")._request("POST", "/close_communicator")
    return tasks.addition_reward(completion, row)


def test_a_server_dropped_after_a_failed_push_costs_a_resubmission_not_the_run(
    servers, model_path, hf, tmp_path
):
    """On-policy (K = 0) the next step waits on both servers for the version of the push that
    fails on one: the Router aborts what that one holds, the trainer hears so, reconnects (the
    server is back in) and submits the step again. A timeout of 30 s: before, the trainer waited
    for the version that never came, up to the server's --min-version-timeout."""
    urls = [f"http://127.0.0.1:{servers[n][1]['port']}" for n in ("plain", "data-parallel")]
    router = Router(urls, timeout=30)
    BREAK["client"] = Client(urls[0])
    cfg = train.Config(
        model=model_path,
        steps=3,
        prompts_per_step=4,
        micro_batches=2,
        group_size=2,
        out=str(tmp_path),
        reward="test_scale:break_weight_sync_once",
    )
    history = train.train(cfg, router)
    assert "client" not in BREAK and [h["step"] for h in history] == [0, 1, 2]
    assert router.live == router.clients
    assert len({client.health()["version"] for client in router.clients}) == 1
    router.init_communicator(transport="gloo")
    router.update_model_params(hf[0])
    router.close_communicator()


def test_a_server_busy_past_the_deadline_is_a_timeout_not_a_wait_forever(servers, hf):
    """The plain server refuses a push (503) while a request runs there longer than its
    --drain-timeout (1 s; before the killed-server test starts it again without): push_until_done
    asks again, with backoff, until its deadline."""
    plain = Client(f"http://127.0.0.1:{servers['plain'][1]['port']}")
    plain.init_communicator(transport="gloo")
    busy = keep_busy(plain)
    with pytest.raises(TimeoutError, match="still busy after 2"):
        push_until_done(plain, hf[0], timeout=2)
    # nothing was sent: the request goes on on the weights it started with
    version = plain.health()["version"]
    assert busy.result()[0][0].version == version
    plain.close_communicator()


def test_an_openai_session_stays_on_one_server(router):
    url = router.session_url("agent-1")
    # load its server, so that the other one is the least loaded: the session must not follow
    chosen = next(c for c in router.clients if c.base_url == url)
    pending = chosen.generate(["y"] * 4, max_tokens=2, is_async=True)
    assert router.session_url("agent-1") == url
    assert router.least_loaded().base_url != url
    pending.result()


def test_after_updates_every_server_serves_one_version_with_the_new_weights(router, hf):
    model, tokenizer = hf
    first = router.update_model_params(perturbed(model, seed=3))
    new = perturbed(model, seed=4)
    assert router.update_model_params(new) == first + 1
    expected = hf_greedy(new, tokenizer, PROMPTS)
    for client in router.clients:
        assert client.health()["version"] == first + 1
        tokens, versions = greedy(client)
        assert versions == {first + 1}
        assert [t[0] for t in tokens] == expected
    router.update_model_params(model)


@pytest.mark.gpu
@needs_data_parallel
def test_every_replica_of_a_data_parallel_server_loads_the_update(router, hf):
    """Before data_parallel_index was read, both replicas' workers took one rank in the weight
    group, and the group never formed."""
    model, tokenizer = hf
    _, data_parallel = router.clients
    new = perturbed(model, seed=5)
    router.update_model_params(new)
    assert data_parallel.health()["workers"] == 2
    tokens, _ = greedy(data_parallel, copies=8)
    # every copy, whichever replica ran it
    assert tokens == [[t] * 8 for t in hf_greedy(new, tokenizer, PROMPTS)]
    router.update_model_params(model)


def test_a_killed_server_is_dropped_then_readmitted_with_the_current_weights(
    router, servers, model_path, hf, tmp_path
):
    """Killed by SIGKILL: vLLM's engine core and its workers notice that the server is gone and
    exit; the Router drops the server, and readmits the one started on its ports."""
    model, tokenizer = hf
    plain, data_parallel = router.clients
    proc, ports = servers.pop("plain")
    engine = psutil.Process(proc.pid).children(recursive=True)
    assert any("EngineCore" in p.name() for p in engine), engine
    proc.kill()
    proc.wait()
    dropped = router.update_model_params(perturbed(model, seed=6))
    assert router.live == [data_parallel]
    future = router.generate(["z"], max_tokens=2, is_async=True)
    assert not plain.pending and data_parallel.pending
    future.result()
    # they exit within seconds: gone, or zombies whose parent died
    _, alive = psutil.wait_procs(engine, timeout=60)
    for p in alive:
        p.kill()
    assert not alive, alive

    proc, _ = launch_server(
        "--model", model_path, *GPU_FLAGS, log_path=tmp_path / "restarted.log", **ports
    )
    servers["plain"] = (proc, ports)
    assert plain.health()["version"] == 0  # a new server
    new = perturbed(model, seed=7)
    assert router.update_model_params(new) == dropped + 1
    assert plain in router.live and data_parallel in router.live
    tokens, versions = greedy(plain)
    assert versions == {dropped + 1}
    assert [t[0] for t in tokens] == hf_greedy(new, tokenizer, PROMPTS)
    router.update_model_params(model)


def train_py(launcher, server, out, model_path):
    """train.py for two sync-batch steps on `server`, its requests seeded, under `launcher` (None:
    in this process); returns the final parameters (from its checkpoint) and each step's gradient
    norm."""
    flags = ["--model", model_path, "--server-url", server, "--steps", "2", "--out", str(out)]
    flags += ["--prompts-per-step", "8", "--micro-batches", "2", "--group-size", "4"]
    flags += ["--max-tokens", "8", "--schedule", "sync-batch", "--seed", "3", "--seed-requests"]
    script = os.path.join(ROOT, "train.py")
    if launcher:
        run = subprocess.run(
            [*launcher, script, *flags], capture_output=True, text=True, timeout=600
        )
    else:
        run = run_in_process(script, *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    return load_file(out / "checkpoint" / "model.safetensors"), metrics(out)


def metrics(out):
    """Each step's gradient norm, and the tokens the first step's mismatch was measured on."""
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [row["grad_norm"] for row in rows], rows[0]["mismatch_tokens"]


def test_torchrun_on_two_ranks_ends_with_the_parameters_of_one_process(
    servers, model_path, tmp_path
):
    """Each rank trains on half of every micro-batch (whole groups), FSDP2 sums the gradients;
    both runs get the same samples (seeded requests on one server). AdamW hides the gradient's
    scale, so the gradient norms are compared too (relative 1e-5). Parameters: absolute 5e-5,
    against steps of lr = 1e-3. The ranks' sums are added in another order, and a weight whose
    gradient is near AdamW's eps (1e-8) moves by an amount its last digits decide: one run
    differed by up to 9.4e-6 there. The first step's mismatch covers every sampled token, whichever
    rank computed it."""
    server = f"http://127.0.0.1:{servers['plain'][1]['port']}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    one, (one_norms, one_tokens) = train_py(None, server, tmp_path / "one", model_path)
    two, (two_norms, two_tokens) = train_py(torchrun, server, tmp_path / "two", model_path)
    start = load_file(os.path.join(model_path, "model.safetensors"))
    assert one.keys() == two.keys()
    # training moved the weights, by much more than the tolerance
    assert max((one[k] - start[k]).abs().max() for k in one) > 1e-3
    assert max((one[k] - two[k]).abs().max() for k in one) < 5e-5
    assert two_norms == pytest.approx(one_norms, rel=1e-5)
    assert two_tokens == one_tokens > 0


FULL_WEIGHTS = """
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
import train
dist.init_process_group("gloo")
model = train.load_model({model!r})
train.shard(model)
weights = train.full_weights(model, "bfloat16")
reference = train.load_model({model!r}).state_dict()
equal = all(torch.equal(t, reference[n].to(torch.bfloat16)) for n, t in weights.items())
dtypes = sorted({{str(t.dtype) for t in weights.values()}})
held = {{"rank": dist.get_rank(), "names": sorted(weights), "dtypes": dtypes, "equal": equal}}
# one write of the whole line: the two ranks share stdout, and print's text and newline go apart
sys.stdout.write(json.dumps(held) + "\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def test_under_fsdp_only_rank_0_holds_the_full_weights_and_in_the_served_dtype(
    model_path, tmp_path
):
    script = tmp_path / "full_weights.py"
    script.write_text(FULL_WEIGHTS.format(root=ROOT, model=model_path))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    run = subprocess.run([*torchrun, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    ranks = {r["rank"]: r for r in map(json.loads, lines)}
    names = [n for n, _ in AutoModelForCausalLM.from_pretrained(model_path).named_parameters()]
    assert ranks[0]["names"] == sorted(names) and ranks[0]["equal"]
    assert ranks[0]["dtypes"] == ["torch.bfloat16"]
    assert ranks[1]["names"] == []


def test_the_scale_bench_on_two_servers_reports_speedups_of_sides_that_trained(servers, tmp_path):
    """bench/scale.py's CPU smoke run on this file's two servers: one rank, then two torchrun
    ranks, each training (a side that trained nothing would stop it: tests/test_bench.py), then
    generation over one server and two."""
    urls = ",".join(f"http://127.0.0.1:{servers[n][1]['port']}" for n in ("plain", "data-parallel"))
    flags = ["--server-urls", urls, "--out", str(tmp_path), "--warm-start-steps", "20"]
    # the smallest run that trains on both sides: 2 steps of 8 prompts x 2, one measured
    flags += ["--steps", "2", "--group-size", "2", "--max-tokens", "16"]
    flags += ["--prompts", "4", "--n", "2", "--rounds", "1"]
    run = run_in_process(os.path.join(ROOT, "bench", "scale.py"), *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (
        "1 rank: frac_reward_zero_std=" in run.stdout
        and "2 ranks: frac_reward_zero_std=" in run.stdout
    )
    assert "training_speedup=" in run.stdout and "generation_speedup=" in run.stdout
