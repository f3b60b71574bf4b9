"""Client for server.py, and the trainer's side of weight sync.

    client = Client("http://127.0.0.1:8000")
    [[c0, ..., c7]] = client.generate(["2+2="], n=8, max_tokens=32)      # waits for the result
    future = client.generate(prompts, n=8, is_async=True)                  # returns at once
    ...                                                                    # train on something else
    completions = future.result()

    client.init_communicator()                 # the trainer is rank 0 of the weight group
    version = client.update_model_params(model)  # one HTTP call + one broadcast per packed bucket
    client.close_communicator()

Weights travel over NCCL when the trainer's tensors are on CUDA and over gloo otherwise.
"""
import math
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import requests
import torch

from engine import Completion, Episode, group_backend


class ServerError(Exception):
    """The server answered with an error; `status` is the HTTP code, the message is the server's."""

    def __init__(self, status, message):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class RemoteFuture:
    """A request the server is working on; `result()` collects it with /get_future."""

    def __init__(self, client, request_id, kind="generate"):
        self.client, self.request_id, self.kind = client, request_id, kind

    def result(self, timeout=None):
        """Wait (long-polling the server in slices of at most 60 s) and return the result."""
        return self.client.get_future(self.request_id, timeout, kind=self.kind)


class Client:
    def __init__(self, base_url="http://127.0.0.1:8000", timeout=600.0):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self.http = requests.Session()
        self.group, self.spec, self.dtype = None, None, None

    def _request(self, method, path, body=None, timeout=None, http=None):
        try:
            r = (http or self.http).request(method, self.base_url + path, json=body, timeout=timeout or self.timeout)
        except requests.ConnectionError as e:
            raise ConnectionError(f"server unreachable at {self.base_url}: {e}") from None
        if r.status_code >= 400:
            try:
                message = r.json()["error"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise ServerError(r.status_code, message)
        return r.json()

    def health(self, timeout=10.0):
        return self._request("GET", "/health", timeout=timeout)

    # -- generation -----------------------------------------------------------

    def generate(self, prompts, n=1, temperature=1.0, max_tokens=16, priority=0, is_async=False, **sampling):
        """Completions for each prompt (a string or a list of token ids): a list per prompt of
        `n` Completion(text, token_ids, logprobs, finish_reason, version). Other keyword
        arguments are vLLM SamplingParams fields (top_p, top_k, seed, stop, ...).
        With is_async=True, return a RemoteFuture at once instead."""
        body = dict(prompts=list(prompts), n=n, temperature=temperature, max_tokens=max_tokens, priority=priority, **sampling)
        request_id = self._request("POST", "/generate", body)["request_id"]
        future = RemoteFuture(self, request_id)
        return future if is_async else future.result()

    def rollout(self, prompts, n=1, tools=None, max_turns=4, max_episode_tokens=256, temperature=1.0, max_tokens=64,
                is_async=False, **sampling):
        """Multi-turn tool episodes: a list per prompt of `n` Episode(token_ids, loss_mask, logprobs,
        turns, tool_calls, finish_reason). `tools` limits which registered tools may be called; a turn
        ending in `call_end` ("</tool>" unless given) calls "NAME ARGUMENT" written after `call_start`."""
        body = dict(prompts=list(prompts), n=n, max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                    temperature=temperature, max_tokens=max_tokens, **sampling)
        if tools is not None:
            body["tools"] = list(tools)
        future = RemoteFuture(self, self._request("POST", "/rollout", body)["request_id"], kind="rollout")
        return future if is_async else future.result()

    def get_future(self, request_id, timeout=None, kind="generate"):
        deadline = self.timeout if timeout is None else timeout
        waited = 0.0
        while True:
            wait = min(60.0, max(deadline - waited, 0.0))
            try:
                reply = self._request("POST", "/get_future", {"request_id": request_id, "timeout": wait}, timeout=wait + 30)
                break
            except ServerError as e:
                waited += wait
                if e.status != 408 or waited >= deadline:
                    raise
        if kind == "rollout":
            return [[Episode(**e) for e in per_prompt] for per_prompt in reply["episodes"]]
        return [[Completion(**c) for c in per_prompt] for per_prompt in reply["completions"]]

    # -- weight sync (the trainer is rank 0) ----------------------------------

    def init_communicator(self, host="127.0.0.1", device=None, timeout=60.0):
        """Join the server's workers in a weight group hosted by this process at `host`.
        `device` decides the backend: CUDA -> NCCL, CPU -> gloo."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self._drop_group()
        info = self.health()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        world_size = 1 + info["workers"]
        with ThreadPoolExecutor(1) as pool:  # the server joins while we host the rendezvous
            reply = pool.submit(self._request, "POST", "/init_communicator",
                                {"host": host, "world_size": world_size}, timeout + 30, requests)
            self.group = stateless_init_torch_distributed_process_group(
                host, info["group_port"], 0, world_size, group_backend(self.device), timeout=timedelta(seconds=timeout))
            answer = reply.result()
        self.spec, self.dtype, self.group_timeout = answer["params"], getattr(torch, answer["dtype"]), timeout

    def close_communicator(self):
        if self.group is not None:
            self._request("POST", "/close_communicator")
            self._drop_group()

    def _drop_group(self):
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            group, self.group = self.group, None
            stateless_destroy_torch_distributed_process_group(group)

    def update_model_params(self, model, bucket_mb=32):
        """Push a torch.nn.Module's parameters (or a state dict) into the server; return the new
        weight version. Tied weights are sent once; tensors are cast to the server's dtype and
        packed into buckets of at most `bucket_mb` MiB, one broadcast each."""
        if self.group is None:
            raise RuntimeError("call init_communicator() first")
        named = self._named_tensors(model)
        buckets = pack(named, bucket_mb << 20)
        with ThreadPoolExecutor(1) as pool:  # announce, then broadcast while the server receives
            reply = pool.submit(self._request, "POST", "/update_weights", {"buckets": [b for b, _ in buckets]},
                                self.group_timeout * (1 + len(buckets)) + 30, requests)
            try:
                sending = []
                for bucket, tensors in buckets:
                    buffer = torch.empty(bucket["size"], dtype=torch.uint8, device=self.device)
                    for p, t in zip(bucket["params"], tensors):
                        buffer[p["offset"]:p["offset"] + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
                    opts = torch.distributed.BroadcastOptions()
                    opts.rootRank = 0
                    sending.append((buffer, self.group.broadcast([buffer], opts)))  # packs the next while this one travels
                for _, work in sending:
                    work.wait()
            except Exception as e:  # the server went away or refused: its answer says why
                try:
                    reply.result()
                except ServerError as server_error:
                    self._drop_group()
                    raise server_error from e
                raise
            try:
                self.last_update = reply.result()  # {version, receive_s, load_s}
                return self.last_update["version"]
            except ServerError:
                self._drop_group()  # the server dropped the group after a failed update
                raise

    def _named_tensors(self, model):
        """[(checkpoint name, tensor)] in the server's dtype, checked against its parameter spec."""
        items = model.named_parameters() if isinstance(model, torch.nn.Module) else model.items()
        items = [(name.removeprefix("module.").removeprefix("_orig_mod."), t) for name, t in items]  # DDP, compile
        known = {t.data_ptr() for name, t in items if name in self.spec}
        named = []
        for name, t in items:
            if name not in self.spec:
                if t.data_ptr() in known:
                    continue  # a tied weight (lm_head = embed_tokens) is sent once, under the server's name
                raise ValueError(f"the server's model has no parameter '{name}'")
            if list(t.shape) != self.spec[name]:
                raise ValueError(f"'{name}' has shape {list(t.shape)}, the server's is {self.spec[name]}")
            named.append((name, t.detach().to(self.device, self.dtype).contiguous()))
        missing = set(self.spec) - {name for name, _ in named}
        if missing:  # the server reloads whole layers: it takes complete updates only
            raise ValueError(f"an update must carry every parameter; missing {len(missing)}: {sorted(missing)[:5]}")
        return named


def pack(named, bucket_bytes):
    """Greedy packing in order: [(bucket announcement, [tensors])]; offsets aligned to 16 bytes."""
    buckets, params, tensors, size = [], [], [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if params and size + nbytes > bucket_bytes:
            buckets.append(({"size": size, "params": params}, tensors))
            params, tensors, size = [], [], 0
        params.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": size})
        tensors.append(t)
        size += math.ceil(nbytes / 16) * 16
    if params:
        buckets.append(({"size": size, "params": params}, tensors))
    return buckets


# -----------------------------------------------------------------------------
# a local server process, for the demo, the tests and the benchmarks


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(*flags, log_path=os.devnull, timeout=300.0, env=None, prefix=()):
    """Start `python server.py *flags` on free ports; return (process, Client) once it is up.
    `prefix` goes before the command (e.g. ("taskset", "-c", "0") to pin it to a core)."""
    port, group_port = free_port(), free_port()
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*prefix, sys.executable, server, "--port", str(port), "--group-port", str(group_port), *flags],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    client = Client(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # the engine takes ~25 s to start on CPU
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}; see {log_path}")
        try:
            client.health(timeout=2)
            return proc, client
        except ConnectionError:
            time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"server did not start within {timeout} s; see {log_path}")


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
