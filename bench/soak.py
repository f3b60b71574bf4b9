"""Soak: thousands of requests from many clients while the trainer pushes weights; then memory.

    # 2,000 requests in flight, 3 updates, 5,000 requests in all
    .venv/bin/python bench/soak.py
    .venv/bin/python bench/soak.py --clients 32 --in-flight 4000

One server on the built-in tiny model (started here, default flags). Three phases:
  1. warm-up: 100 requests, one after another; the server process's RSS is read (rss_100).
  2. soak: `--clients` threads, each with its own Client, submit `--in-flight` requests (1 prompt,
     n=2, up to 16 tokens) without waiting, while a trainer thread pushes the model's weights 3
     times over gloo; then every result is fetched. A request is lost if it cannot be fetched or has
     the wrong number of completions. Every completion must carry one version for its request,
     between the version loaded when it was submitted and the one loaded when it was fetched.
  3. more requests (fetched as they go) up to 5,000 in all; RSS again (rss_5000).
The last line is `lost=<n> wrong_version=<n> rss_ratio=<rss_5000 / rss_100>`.
"""

import argparse
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import psutil  # noqa: E402
import torch  # noqa: E402

from client import Client  # noqa: E402
from local import launch_server, stop_server, tiny_model  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16, help="concurrent client threads")
    p.add_argument(
        "--in-flight", type=int, default=2000, help="requests submitted before any is fetched"
    )
    p.add_argument("--total", type=int, default=5000, help="requests in all")
    p.add_argument("--updates", type=int, default=3, help="weight pushes during the soak")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM

    path = tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    proc, trainer = launch_server(
        "--model", path, log_path=os.path.join(tempfile.mkdtemp(prefix="bench-soak-"), "server.log")
    )
    server = psutil.Process(proc.pid)
    sampling = dict(n=2, max_tokens=16, temperature=1.0)
    try:
        for i in range(100):
            trainer.generate([f"warm {i}"], **sampling)
        rss_100 = server.memory_info().rss

        # 2. the soak
        trainer.init_communicator(transport="gloo")
        loaded = [trainer.health()["version"]]  # versions loaded so far, in order
        submitted = threading.Event()
        count = iter(range(a.in_flight))
        lock = threading.Lock()

        def submit(k):
            client, mine = Client(trainer.base_url), []
            while True:
                with lock:
                    i = next(count, None)
                if i is None:
                    return client, mine
                if i == a.in_flight // 4:
                    submitted.set()  # a quarter is in: the trainer starts pushing
                mine.append((loaded[-1], client.generate([f"soak {i}"], is_async=True, **sampling)))

        def push():
            submitted.wait()
            for _ in range(a.updates):
                loaded.append(trainer.update_model_params(model))

        start = time.perf_counter()
        pusher = threading.Thread(target=push)
        pusher.start()
        with ThreadPoolExecutor(a.clients) as pool:
            batches = list(pool.map(submit, range(a.clients)))
        pusher.join()
        lost = wrong_version = 0
        for _client, mine in batches:
            for low, future in mine:
                try:
                    [completions] = future.result(timeout=600)
                except Exception as e:
                    print(f"lost {future.request_id}: {e}")
                    lost += 1
                    continue
                versions = {c.version for c in completions}
                lost += len(completions) != sampling["n"]
                wrong_version += len(versions) != 1 or not low <= min(versions) <= loaded[-1]
        soak_s = time.perf_counter() - start
        trainer.close_communicator()
        print(
            f"soak: {a.in_flight} requests from {a.clients} clients, "
            f"versions loaded {loaded}, {soak_s:.1f} s"
        )

        # 3. more requests, then memory again
        done = 100 + a.in_flight
        with ThreadPoolExecutor(a.clients) as pool:
            list(
                pool.map(
                    lambda i: trainer.generate([f"more {i}"], **sampling), range(a.total - done)
                )
            )
        rss_5000 = server.memory_info().rss
        health = trainer.health()
    finally:
        stop_server(proc)
    print(
        f"server RSS: {rss_100 / 2**20:.0f} MiB after 100 requests, "
        f"{rss_5000 / 2**20:.0f} MiB after {a.total}; "
        f"results still held: {health['pending_results']}"
    )
    print(f"lost={lost} wrong_version={wrong_version} rss_ratio={rss_5000 / rss_100:.3f}")


if __name__ == "__main__":
    main()
