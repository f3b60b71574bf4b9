"""Seconds to push a model's weights into the server, against the numbers that frame it.

    # CPU: 512 hidden x 24 layers, float32, gloo
    .venv/bin/python bench/weight_sync.py
    # the same with smaller buckets (the client's default: 32 MiB)
    .venv/bin/python bench/weight_sync.py --bucket-mb 8
    # GPU: a Qwen2.5-0.5B-shaped model, bf16, one GPU
    python3 bench/weight_sync.py --device cuda
    # the same model on two GPUs: server on 0, trainer on 1, NCCL
    python3 bench/weight_sync.py --device cuda:1

CPU (--device cpu), side by side in one run, on a Qwen2 built by local.tiny_model (float32):
  1. raw:       one gloo broadcast of the same number of bytes as one uint8 buffer between two
                plain processes; the limit. Timed on the sender, run before the server starts.
  2. ours:      client.update_model_params(model) into a real server over gloo: packed buckets,
                one HTTP call, one broadcast per bucket, then the server loads everything at once.
  3. per-param: one HTTP call and one broadcast per tensor, the slow path TRL's vLLM client takes,
                into a receiver written here (the server rejects partial updates): a spawned process
                with an aiohttp route that copies each tensor into an HF copy of the model. It
                EXCLUDES the engine's weight-loading cost, so it is a lower bound on a real
                per-parameter path's time: our speedup over it is conservative. Run before the
                server.
  4. fixed cost: the tiny model train.py trains (3 MB, 26 tensors) pushed over gloo into a server
                of its own, in drain and in-flight mode: what an update costs when bytes hardly
                count.
  Ours names the params of its last push by reference from the second push on (same_layout);
  after it, the same pushes with the params sent each time, the way before.
  The last line is `sync_vs_raw=<raw / ours> packed_vs_per_param=<per-param / ours>
  fixed_cost_s=<4. in drain mode> by_reference_vs_params=<params sent each time / ours>
  http_by_reference_vs_params=<the same of their HTTP parts>`.
GPU (--device cuda): a Qwen2.5-0.5B-shaped Qwen2 (896 hidden, 24 layers, 14 heads, 2 KV heads,
4864 intermediate, 151,936 vocabulary, tied; random bf16 weights made here), the trainer's copy on
the same GPU as the server (which takes --gpu-memory-utilization 0.3):
  1. raw:       one device-to-device copy of the same number of bytes on that GPU; the limit.
  2. ours ipc:  client.update_model_params(model) with the `ipc` transport (the default here);
                then the same with the params sent each time (not by reference).
  3. ours gloo: the same with the `gloo` transport, through CPU buffers on both sides.
  4. fixed cost: the tiny model on a server started as train.py --device cuda starts it (compiled,
                --gpu-memory-utilization 0.3), over ipc and gloo, drain and in-flight.
  The last line is `seconds_per_update=<ipc> ipc_vs_raw=<raw / ipc> ipc_vs_gloo=<gloo / ipc>
  fixed_cost_s=<4. ipc drain> fixed_cost_in_flight_s=<4. ipc in-flight>
  by_reference_vs_params=<ipc, params sent each time / ipc> http_by_reference_vs_params=<the same
  of their HTTP parts>`.
Two GPUs (--device cuda:1): the same Qwen2.5-0.5B-shaped bf16 model. The server takes GPU 0 (as in
--device cuda: launch_server's default GPU, --gpu-memory-utilization 0.3, --enforce-eager); this
process is the trainer, its model copy on cuda:1. Every side sends from cuda:1 and receives on
cuda:0, each rank's NCCL communicator on its own GPU (client.weight_group). The two baselines run
first, so both GPUs are free when the server starts:
  1. raw:       one NCCL broadcast of the same number of bytes as one uint8 buffer, from this
                process (rank 0, the buffer on cuda:1) to a spawned plain process (rank 1, its
                buffer on cuda:0); the limit. A handshake broadcast from the receiver precedes each
                round (not timed); timed on the sender until the broadcast has completed (the device
                is synchronized).
  2. per-param: as on the CPU, one HTTP call and one NCCL broadcast per tensor, into a spawned
                receiver on cuda:0 whose HF copy of the model is bf16 on cuda:0; the trainer's
                tensors on cuda:1. It EXCLUDES the engine's weight loading: a lower bound on a real
                per-parameter path.
  3. ours nccl: client.init_communicator(transport="nccl", device="cuda:1"), then
                client.update_model_params(model): packed buckets, one NCCL broadcast each, into the
                server's worker on GPU 0, which then loads them (receive_s, load_s: the worker's
                split).
  4. fixed cost: the tiny model on a server started as train.py --device cuda:1 starts it, over
                nccl from cuda:1, drain and in-flight.
  The first lines name the GPUs and the model; the last is `seconds_per_update=<ours>
  nccl_vs_raw=<raw / ours> packed_vs_per_param=<per-param / ours> transfer_vs_raw=<raw / send_s>
  fixed_cost_s=<4. drain> fixed_cost_in_flight_s=<4. in-flight>`, send_s being the trainer's
  packing and sending of every bucket (client.last_update).
Each of ours and the fixed costs prints where its time went (describe): the trainer's sends; the
drain (or in-flight pause); the collective_rpc into the workers, of which their receive and load;
the reset of the paused requests' KV and the version's label; and the rest, HTTP and the
trainer's packing.
Each is the median of its rounds, after one warm-up. With --profile, 20 more updates of ours (on a
GPU over ipc) under cProfile: the trainer's side, its costliest functions by their own time.
"""

import argparse
import cProfile
import multiprocessing
import os
import pstats
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import requests  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from client import close_group, free_port, weight_group  # noqa: E402
from local import launch_server, stop_server, tiny_model  # noqa: E402
from shapes import QWEN25_05B  # noqa: E402

# how train.py starts its server on a GPU (its --gpu-memory-utilization default), compiled
DEMO_GPU_FLAGS = ("--gpu-memory-utilization", "0.3")


def init_group(host, port, rank, world_size, device="cpu"):
    """gloo on the CPU; on a GPU, NCCL with this rank's communicator on `device` (its own GPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        # this process's CUDA work, NCCL's streams included, on its GPU
        torch.cuda.set_device(device)
        return weight_group(
            "nccl", host, port, rank, world_size, weight_sync_timeout=120, device=device
        )
    return weight_group("gloo", host, port, rank, world_size, weight_sync_timeout=120)


def broadcast(group, tensor, root=0):
    """A blocking broadcast from `root` (the handshakes go from the receiver, rank 1). gloo's wait()
    blocks until it is done; NCCL's only makes the current CUDA stream wait, so the device is
    synchronized too: on return the tensor has really been sent or received."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def median_seconds(fn, rounds):
    """Median wall time of `rounds` calls of `fn()`, after one warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# the parts of an update (client.last_update, and the wall time of update_model_params)
PARTS = ("total_s", "pack_s", "send_s", "drain_s", "rpc_s", "receive_s", "load_s", "reset_s")


def update_parts(client, model, rounds, params_each_time=False, **options):
    """The median of each part of client.update_model_params(model, **options) over `rounds`
    updates, after one warm-up. From the second push on, the client names the params of its last
    one by reference (same_layout); with `params_each_time`, each push sends them in full."""
    runs = []
    for _ in range(1 + rounds):
        if params_each_time:
            # the client forgets its last layout, so it announces every param again
            client.layout = (None, None)
        start = time.perf_counter()
        client.update_model_params(model, **options)
        runs.append({"total_s": time.perf_counter() - start, **client.last_update})
    return {k: statistics.median(r[k] for r in runs[1:]) for k in PARTS}


def profile_updates(client, model, rounds=20, top=15):
    """--profile: `rounds` more updates under cProfile, the trainer's side of them: its costliest
    functions by their own time (the server's part shows as the wait in a socket read)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(rounds):
        client.update_model_params(model)
    profile.disable()
    print(f"--profile: the trainer's side of {rounds} updates, by own time", flush=True)
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(top)
    sys.stdout.flush()


def http_part(m) -> float:
    """An update's seconds beside the trainer's packing, the drain, the collective_rpc and the
    reset: the request, the server's checks, its answer."""
    return m["total_s"] - m["pack_s"] - m["drain_s"] - m["rpc_s"] - m["reset_s"]


def describe(name, m):
    """One line: where an update's time went. The trainer sends while the workers receive, inside
    the collective_rpc; `HTTP` is the rest: the request, the server's checks, its answer."""
    rest = http_part(m)
    return (
        f"{name:<30} {m['total_s']:7.4f} s = the trainer packs {m['pack_s']:.4f} + drain/pause "
        f"{m['drain_s']:.4f} + collective_rpc {m['rpc_s']:.4f} (meanwhile: the trainer sends "
        f"{m['send_s']:.4f}, the worker receives {m['receive_s']:.4f} and loads "
        f"{m['load_s']:.4f}) + reset/label {m['reset_s']:.4f} + HTTP {rest:.4f}"
    )


def fixed_cost(transports, rounds, server_flags=()):
    """The fixed cost of an update, where bytes hardly count: the tiny model (3 MB, float32)
    pushed into an idle server on it, started as train.py starts it (with `server_flags`), per
    transport [(transport, the trainer's device)] and update mode. Returns {(transport, mode):
    update_parts}."""
    from transformers import AutoModelForCausalLM

    model, results = AutoModelForCausalLM.from_pretrained(tiny_model()), {}
    log = os.path.join(tempfile.mkdtemp(prefix="bench-sync-"), "server.log")
    proc, client = launch_server("--model", tiny_model(), *server_flags, log_path=log)
    try:
        for transport, device in transports:
            client.init_communicator(transport=transport, device=device)
            for mode in ("drain", "in-flight"):
                m = update_parts(client, model.to(device), rounds, mode=mode)
                results[transport, mode] = m
                print(describe(f"fixed cost ({transport}, {mode}):", m), flush=True)
            client.close_communicator()
    finally:
        stop_server(proc)
    return results


# -----------------------------------------------------------------------------
# 1. raw: one uint8 buffer between two plain processes


def raw_receiver(port, nbytes, rounds, device="cpu"):
    group = init_group("127.0.0.1", port, 1, 2, device)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(rounds):
        broadcast(group, torch.ones(1, device=device), root=1)  # handshake: the receiver is ready
        broadcast(group, buffer)
    close_group(group)


def raw_broadcast_seconds(nbytes, rounds, device="cpu", receiver_device="cpu"):
    """Median seconds of one broadcast of `nbytes` from this process (on `device`) to a spawned one
    (on `receiver_device`): gloo on the CPU, NCCL between GPUs."""
    port = free_port()
    receiver = multiprocessing.get_context("spawn").Process(
        target=raw_receiver, args=(port, nbytes, 1 + rounds, receiver_device)
    )
    receiver.start()
    group = init_group("127.0.0.1", port, 0, 2, device)  # rank 0 hosts the rendezvous
    buffer = torch.ones(nbytes, dtype=torch.uint8, device=device)

    def one_round():
        # wait until the receiver is ready (not timed below)
        broadcast(group, torch.zeros(1, device=device), root=1)
        start = time.perf_counter()
        # on a GPU: until the device is synchronized, i.e. the broadcast has completed
        broadcast(group, buffer)
        return time.perf_counter() - start

    one_round()  # warm-up
    seconds = statistics.median(one_round() for _ in range(rounds))
    receiver.join()
    close_group(group)
    return seconds


# -----------------------------------------------------------------------------
# 3. per-param: the baseline, one HTTP call + one broadcast per tensor, into an HF model (no engine)


def per_param_receiver(path, group_port, http_port, device="cpu", dtype="float32"):
    """Rank 1 until terminated: POST /update_param {name, dtype, shape} receives that one tensor
    and copies it into the matching parameter of an HF model loaded from the same checkpoint
    (in `dtype` on `device`; on a GPU the tensors come over NCCL)."""
    import socket

    from aiohttp import web
    from transformers import AutoModelForCausalLM

    params = dict(
        AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        .to(device)
        .named_parameters()
    )

    async def update_param(request):
        body = await request.json()
        buffer = torch.empty(body["shape"], dtype=getattr(torch, body["dtype"]), device=device)
        # blocks the event loop: the trainer sends one tensor at a time anyway
        broadcast(group, buffer)
        # on a GPU: queued on the stream, before anything later
        params[body["name"]].data.copy_(buffer)
        return web.json_response({"name": body["name"]})

    # connections queue from here on, so once the trainer has joined, it may post
    sock = socket.create_server(("127.0.0.1", http_port))
    group = init_group("127.0.0.1", group_port, 1, 2, device)
    app = web.Application()
    app.router.add_post("/update_param", update_param)
    web.run_app(app, sock=sock, print=None)  # SIGTERM ends it
    close_group(group)


def per_param_seconds(
    path, model, rounds, device="cpu", receiver_device="cpu", receiver_dtype="float32"
):
    """Median seconds of sending `model` (its tensors on `device`) one tensor at a time into a
    per_param_receiver (its model in `receiver_dtype` on `receiver_device`)."""
    group_port, http_port = free_port(), free_port()
    receiver = multiprocessing.get_context("spawn").Process(
        target=per_param_receiver,
        args=(path, group_port, http_port, receiver_device, receiver_dtype),
    )
    receiver.start()
    group = None
    try:
        group = init_group("127.0.0.1", group_port, 0, 2, device)  # rank 0 hosts the rendezvous
        url, http = f"http://127.0.0.1:{http_port}/update_param", requests.Session()

        def update():
            # as in client.update_model_params: receive while we broadcast
            with ThreadPoolExecutor(1) as pool:
                for name, t in model.named_parameters():  # the tied lm_head is listed once
                    t = t.detach()
                    announce = {
                        "name": name,
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                    }
                    reply = pool.submit(http.post, url, json=announce, timeout=120)
                    broadcast(group, t)
                    reply.result().raise_for_status()

        return median_seconds(update, rounds)
    finally:
        if group is not None:
            close_group(group)
        receiver.terminate()
        receiver.join(60)
        if receiver.is_alive():  # it did not leave its group in time
            receiver.kill()
            receiver.join()


def launch_gpu_server(path):
    """The server both GPU benchmarks push into: bf16, 0.3 of GPU 0, eager."""
    return launch_server(
        "--model",
        path,
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        "0.3",
        "--enforce-eager",
        log_path=os.path.join(tempfile.mkdtemp(prefix="bench-sync-"), "server.log"),
    )


def qwen25_05b_shaped():
    """The folder of a random Qwen2.5-0.5B-shaped model in bfloat16 (built once)."""
    path = os.path.join(ROOT, ".cache", "bench-qwen2.5-0.5b-shape")
    return tiny_model(path, dtype="bfloat16", **QWEN25_05B)


def cuda_main(a):
    from transformers import AutoModelForCausalLM

    path = qwen25_05b_shaped()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
    # the tied lm_head is listed once, as the client sends it
    named = list(model.named_parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(
        f"model: Qwen2.5-0.5B shape, {len(named)} tensors, {nbytes / 2**20:.1f} MiB bfloat16, "
        f"on {torch.cuda.get_device_name()}",
        flush=True,
    )

    src, dst = (
        torch.ones(nbytes, dtype=torch.uint8, device="cuda"),
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
    )

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize()

    raw = median_seconds(copy, a.rounds)
    src = dst = None  # free both before the server starts (not `del`: copy() closes over them)
    print(f"raw copy on GPU:   {raw:7.4f} s  ({nbytes / 2**30 / raw:6.0f} GiB/s)", flush=True)

    proc, client = launch_gpu_server(path)
    seconds = {}
    try:
        for transport in ("ipc", "gloo"):
            client.init_communicator(transport=transport)
            m = update_parts(client, model, a.rounds)
            seconds[transport] = m["total_s"]
            print(
                f"ours ({transport + '):':<6}    {seconds[transport]:7.4f} s  "
                f"({nbytes / 2**30 / seconds[transport]:6.1f} GiB/s)",
                flush=True,
            )
            print(describe(f"  0.5B shape ({transport}, drain):", m), flush=True)
            if transport == "ipc":
                by_reference = m
                full = update_parts(client, model, a.rounds, params_each_time=True)
                print(describe("  the same, params sent each time:", full), flush=True)
                if a.profile:
                    profile_updates(client, model)
            client.close_communicator()
    finally:
        stop_server(proc)
    # the tiny model on a server started as train.py --device cuda starts it: compiled, 0.3 of GPU
    fixed = fixed_cost([("ipc", "cuda"), ("gloo", "cuda")], 4 * a.rounds, DEMO_GPU_FLAGS)
    ipc = seconds["ipc"]
    print(
        f"seconds_per_update={ipc:.4f} ipc_vs_raw={raw / ipc:.3f} "
        f"ipc_vs_gloo={seconds['gloo'] / ipc:.1f} "
        f"fixed_cost_s={fixed['ipc', 'drain']['total_s']:.4f} "
        f"fixed_cost_in_flight_s={fixed['ipc', 'in-flight']['total_s']:.4f} "
        f"by_reference_vs_params={full['total_s'] / ipc:.3f} "
        f"http_by_reference_vs_params={http_part(full) / http_part(by_reference):.2f}"
    )


def two_gpu_main(a):
    """--device cuda:1: the server on GPU 0, the trainer (this process) on GPU 1, weights over
    NCCL."""
    from transformers import AutoModelForCausalLM

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda:1 needs two GPUs; {torch.cuda.device_count()} visible")
    trainer, receiver = torch.device("cuda", 1), torch.device("cuda", 0)  # the server takes GPU 0
    torch.cuda.set_device(trainer)  # this process's CUDA work (and its NCCL groups') on GPU 1
    print(
        f"GPUs: cuda:0 {torch.cuda.get_device_name(0)} (the server, the baselines' receivers); "
        f"cuda:1 {torch.cuda.get_device_name(1)} (the trainer, every sender)",
        flush=True,
    )
    path = qwen25_05b_shaped()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(trainer)
    # the tied lm_head is listed once, as the client sends it
    named = list(model.named_parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    n_params = sum(t.numel() for _, t in named)
    print(
        f"model: Qwen2.5-0.5B shape, {n_params / 1e6:.0f}M parameters, {len(named)} tensors, "
        f"{nbytes / 2**20:.1f} MiB bfloat16, the trainer's copy on cuda:1",
        flush=True,
    )

    # the baselines first, while both GPUs are free of the server
    raw = raw_broadcast_seconds(nbytes, a.rounds, trainer, receiver)
    print(
        f"raw NCCL broadcast cuda:1 -> cuda:0:  {raw:7.4f} s  ({nbytes / 2**30 / raw:6.1f} GiB/s)",
        flush=True,
    )
    per_param = per_param_seconds(path, model, a.per_param_rounds, trainer, receiver, "bfloat16")
    print(
        f"per-param over NCCL:                 {per_param:7.4f} s  "
        f"({nbytes / 2**30 / per_param:6.1f} GiB/s)  "
        "excludes engine weight loading (into an HF copy on cuda:0): a lower bound",
        flush=True,
    )

    proc, client = launch_gpu_server(path)
    try:
        client.init_communicator(transport="nccl", device="cuda:1")
        bucket = {} if a.bucket_mb is None else {"bucket_mb": a.bucket_mb}
        m = update_parts(client, model, a.rounds, **bucket)
        ours = m["total_s"]
        print(
            f"ours (nccl, packed):                 {ours:7.4f} s  "
            f"({nbytes / 2**30 / ours:6.1f} GiB/s)",
            flush=True,
        )
        print(describe("  0.5B shape (nccl, drain):", m), flush=True)
        client.close_communicator()
    finally:
        stop_server(proc)
    # the tiny model on a server started as train.py --device cuda:1 starts it
    fixed = fixed_cost([("nccl", "cuda:1")], 4 * a.rounds, DEMO_GPU_FLAGS)
    print(
        f"seconds_per_update={ours:.4f} nccl_vs_raw={raw / ours:.3f} "
        f"packed_vs_per_param={per_param / ours:.1f} transfer_vs_raw={raw / m['send_s']:.3f} "
        f"fixed_cost_s={fixed['nccl', 'drain']['total_s']:.4f} "
        f"fixed_cost_in_flight_s={fixed['nccl', 'in-flight']['total_s']:.4f}"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--hidden-size", type=int, default=512, help="hidden size of the benchmark model"
    )
    p.add_argument(
        "--layers",
        type=int,
        default=24,
        help="decoder layers of the benchmark model (12 tensors each)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed rounds for raw and ours (the median is reported)",
    )
    p.add_argument(
        "--per-param-rounds", type=int, default=3, help="timed rounds of the per-parameter baseline"
    )
    p.add_argument(
        "--bucket-mb",
        type=int,
        default=None,
        help="bucket size for ours (default: the client's default)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "cuda:1"],
        default="cpu",
        help="cuda: the one-GPU benchmark; "
        "cuda:1: the two-GPU one, the trainer on GPU 1 (see above)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="20 more updates of ours (GPU: ipc) under cProfile: where the trainer's time goes",
    )
    a = p.parse_args()
    if a.device == "cuda":
        return cuda_main(a)
    if a.device == "cuda:1":
        return two_gpu_main(a)

    from transformers import AutoModelForCausalLM

    path = tiny_model(
        path=os.path.join(ROOT, ".cache", f"bench-model-h{a.hidden_size}-l{a.layers}"),
        hidden_size=a.hidden_size,
        num_layers=a.layers,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    named = list(model.named_parameters())  # tied lm_head is listed once, as the client sends it
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"model: {len(named)} tensors, {nbytes / 2**20:.1f} MiB float32", flush=True)

    raw = raw_broadcast_seconds(nbytes, a.rounds)
    print(f"raw broadcast:     {raw:7.3f} s  ({nbytes / 2**20 / raw:6.0f} MiB/s)", flush=True)
    per_param = per_param_seconds(path, model, a.per_param_rounds)
    print(
        f"per-param:         {per_param:7.3f} s  ({nbytes / 2**20 / per_param:6.0f} MiB/s)  "
        "excludes engine weight loading: a lower bound",
        flush=True,
    )

    proc, client = launch_server(
        "--model", path, log_path=os.path.join(tempfile.mkdtemp(prefix="bench-sync-"), "server.log")
    )
    try:
        client.init_communicator()
        bucket = {} if a.bucket_mb is None else {"bucket_mb": a.bucket_mb}
        m = update_parts(client, model, a.rounds, **bucket)
        ours = m["total_s"]
        print(f"ours (packed):     {ours:7.3f} s  ({nbytes / 2**20 / ours:6.0f} MiB/s)", flush=True)
        print(describe("  where it went:", m), flush=True)
        full = update_parts(client, model, a.rounds, params_each_time=True, **bucket)
        print(describe("  params sent each time:", full), flush=True)
        if a.profile:
            profile_updates(client, model)
        client.close_communicator()
    finally:
        stop_server(proc)
    fixed = fixed_cost([("gloo", "cpu")], 2 * a.rounds)[("gloo", "drain")]["total_s"]
    print(
        f"sync_vs_raw={raw / ours:.3f} packed_vs_per_param={per_param / ours:.1f} "
        f"fixed_cost_s={fixed:.4f} by_reference_vs_params={full['total_s'] / ours:.3f} "
        f"http_by_reference_vs_params={http_part(full) / http_part(m):.2f}"
    )


if __name__ == "__main__":
    main()
