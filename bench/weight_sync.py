"""Seconds to push a model's weights into the server, against the two numbers that frame it.

    .venv/bin/python bench/weight_sync.py                   # 512 hidden x 24 layers: 290 tensors, 216 MiB
    .venv/bin/python bench/weight_sync.py --bucket-mb 64    # the same with smaller buckets

Side by side in one run, on a Qwen2 built by engine.tiny_model (float32, gloo on CPU):
  1. raw:       one broadcast of the same number of bytes as one uint8 buffer between two plain
                processes; the limit. Timed on the sender, run before the server starts (2 cores).
  2. ours:      client.update_model_params(model) into a real server: packed buckets, one HTTP
                call, one broadcast per bucket, then the server loads everything at once.
  3. per-param: one HTTP call and one broadcast per tensor, the slow path TRL's vLLM client takes,
                into a receiver written here (the server rejects partial updates): a spawned
                process with an aiohttp route that copies each tensor into an HF copy of the model.
                It EXCLUDES the engine's weight-loading cost, so it is a lower bound on a real
                per-parameter path's time: our speedup over it is conservative. Run before the server.
Each is the median of its rounds, after one warm-up. The last line is
`sync_vs_raw=<raw / ours> packed_vs_per_param=<per-param / ours>`.
"""
import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import requests  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group as destroy_group  # noqa: E402
from vllm.distributed.utils import stateless_init_torch_distributed_process_group as init_group  # noqa: E402

from client import free_port, launch_server, stop_server  # noqa: E402
from engine import tiny_model  # noqa: E402


def broadcast(group, tensor, root=0):
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()


def median_seconds(fn, rounds):
    """Median wall time of `rounds` calls of `fn()`, after one warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -----------------------------------------------------------------------------
# 1. raw: one uint8 buffer between two plain processes


def raw_receiver(port, nbytes, rounds):
    group = init_group("127.0.0.1", port, 1, 2, "gloo")
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        broadcast(group, torch.ones(1), root=1)  # handshake: the receiver is ready
        broadcast(group, buffer)
    destroy_group(group)


def raw_broadcast_seconds(nbytes, rounds):
    port = free_port()
    receiver = multiprocessing.get_context("spawn").Process(target=raw_receiver, args=(port, nbytes, 1 + rounds))
    receiver.start()
    group = init_group("127.0.0.1", port, 0, 2, "gloo")  # rank 0 hosts the rendezvous
    buffer = torch.ones(nbytes, dtype=torch.uint8)

    def one_round():
        broadcast(group, torch.zeros(1), root=1)  # wait until the receiver is ready (not timed below)
        start = time.perf_counter()
        broadcast(group, buffer)
        return time.perf_counter() - start

    one_round()  # warm-up
    seconds = statistics.median(one_round() for _ in range(rounds))
    receiver.join()
    destroy_group(group)
    return seconds


# -----------------------------------------------------------------------------
# 3. per-param: the baseline, one HTTP call + one broadcast per tensor, into an HF model (no engine)


def per_param_receiver(path, group_port, http_port):
    """Rank 1 until terminated: POST /update_param {name, dtype, shape} receives that one tensor
    and copies it into the matching parameter of an HF model loaded from the same checkpoint."""
    import socket

    from aiohttp import web
    from transformers import AutoModelForCausalLM

    params = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())

    async def update_param(request):
        body = await request.json()
        buffer = torch.empty(body["shape"], dtype=getattr(torch, body["dtype"]))
        broadcast(group, buffer)  # blocks the event loop: the trainer sends one tensor at a time anyway
        params[body["name"]].data.copy_(buffer)
        return web.json_response({"name": body["name"]})

    sock = socket.create_server(("127.0.0.1", http_port))  # connections queue from here on, so once
    group = init_group("127.0.0.1", group_port, 1, 2, "gloo")  # the trainer has joined, it may post
    app = web.Application()
    app.router.add_post("/update_param", update_param)
    web.run_app(app, sock=sock, print=None)  # SIGTERM ends it
    destroy_group(group)


def per_param_seconds(path, model, rounds):
    group_port, http_port = free_port(), free_port()
    receiver = multiprocessing.get_context("spawn").Process(target=per_param_receiver, args=(path, group_port, http_port))
    receiver.start()
    try:
        group = init_group("127.0.0.1", group_port, 0, 2, "gloo")  # rank 0 hosts the rendezvous
        url, http = f"http://127.0.0.1:{http_port}/update_param", requests.Session()

        def update():
            with ThreadPoolExecutor(1) as pool:  # as in client.update_model_params: receive while we broadcast
                for name, t in model.named_parameters():  # the tied lm_head is listed once
                    t = t.detach()
                    announce = {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    reply = pool.submit(http.post, url, json=announce, timeout=120)
                    broadcast(group, t)
                    reply.result().raise_for_status()

        seconds = median_seconds(update, rounds)
        destroy_group(group)
        return seconds
    finally:
        receiver.terminate()
        receiver.join()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=512, help="hidden size of the benchmark model")
    p.add_argument("--layers", type=int, default=24, help="decoder layers of the benchmark model (12 tensors each)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds for raw and ours (the median is reported)")
    p.add_argument("--per-param-rounds", type=int, default=3, help="timed rounds of the per-parameter baseline")
    p.add_argument("--bucket-mb", type=int, default=None, help="bucket size for ours (default: the client's default)")
    a = p.parse_args()

    from transformers import AutoModelForCausalLM

    path = tiny_model(path=os.path.join(ROOT, ".cache", f"bench-model-h{a.hidden_size}-l{a.layers}"),
                      hidden_size=a.hidden_size, num_layers=a.layers)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    named = list(model.named_parameters())  # tied lm_head is listed once, as the client sends it
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"model: {len(named)} tensors, {nbytes / 2**20:.1f} MiB float32", flush=True)

    raw = raw_broadcast_seconds(nbytes, a.rounds)
    print(f"raw broadcast:     {raw:7.3f} s  ({nbytes / 2**20 / raw:6.0f} MiB/s)", flush=True)
    per_param = per_param_seconds(path, model, a.per_param_rounds)
    print(f"per-param:         {per_param:7.3f} s  ({nbytes / 2**20 / per_param:6.0f} MiB/s)  "
          "excludes engine weight loading: a lower bound", flush=True)

    proc, client = launch_server("--model", path, log_path=os.path.join(tempfile.mkdtemp(prefix="bench-sync-"), "server.log"))
    try:
        client.init_communicator()
        bucket = {} if a.bucket_mb is None else {"bucket_mb": a.bucket_mb}
        ours = median_seconds(lambda: client.update_model_params(model, **bucket), a.rounds)
        print(f"ours (packed):     {ours:7.3f} s  ({nbytes / 2**20 / ours:6.0f} MiB/s)", flush=True)
        last = client.last_update  # where the worker spent the last update
        print(f"  in the worker: receive {last['receive_s']:.3f} s, load (reload_weights + re-pack) {last['load_s']:.3f} s")
        client.close_communicator()
    finally:
        stop_server(proc)
    print(f"sync_vs_raw={raw / ours:.3f} packed_vs_per_param={per_param / ours:.1f}")


if __name__ == "__main__":
    main()
