"""Client for server.py, and the trainer's side of weight sync. Needs torch and requests, not vLLM.

    client = Client("http://127.0.0.1:8000")
    [[c0, ..., c7]] = client.generate(["2+2="], n=8, max_tokens=32)      # waits for the result
    future = client.generate(prompts, n=8, is_async=True)                  # returns at once
    ...                                                                    # train on something else
    completions = future.result()

    client.init_communicator()          # the trainer chooses the transport; the server follows
    version = client.update_model_params(model)  # one HTTP call, the packed buckets meanwhile
    client.close_communicator()

Weight transports: `ipc` when the trainer's tensors are on the server's own GPU (CUDA IPC handles,
no copy through the host), `nccl` when they are on another GPU, `gloo` when they are on the CPU.
The weight wire format lives here, both ends of it: the group (`weight_group`, `broadcast`,
`wait_broadcast`, `close_group`), the packed buckets (`pack`, `fill_bucket`, `unpack`, `copy_into`)
and CUDA IPC handles (`share_cuda`, `open_cuda`; the trainer's buffer: `IpcBuffer`). The trainer
writes it from here; the server's workers (engine.WeightSyncWorker) read it from here too, so that
a trainer needs no vLLM.
"""

import base64
import contextlib
import hashlib
import importlib
import json
import math
import os
import queue
import random
import re
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import requests
import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRANSPORTS = ("ipc", "nccl", "gloo")


# -- what the server returns -----------------------------------------------------------------------
@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token, same length as token_ids
    finish_reason: str | None  # "stop", "length" or "abort"
    version: int  # the weight version of its first token
    # with sampling `logprobs` k > 0: per token, the k likeliest {token, logprob}
    top_logprobs: list[list[dict]] | None = None
    # [[version, index of its first token]] per weight version that sampled it, oldest first: one
    # span unless an in-flight update came while it was generated
    versions: list[list[int]] | None = None
    # the prompt's token ids, as the server tokenised it (the same in each of a prompt's n)
    prompt_token_ids: list[int] | None = None


def trl_output(results) -> dict:
    """generate()'s or chat()'s [prompt][n] Completions in the shape TRL's VLLMClient returns:
    prompt_ids per prompt; completion_ids, logprobs and logprob_token_ids per completion, prompt
    after prompt (the last two a list per token: the sampled token's)."""
    completions = sum(results, [])
    return {
        "prompt_ids": [per_prompt[0].prompt_token_ids for per_prompt in results],
        "completion_ids": [c.token_ids for c in completions],
        "logprobs": [[[lp] for lp in c.logprobs] for c in completions],
        "logprob_token_ids": [[[t] for t in c.token_ids] for c in completions],
    }


@dataclass
class Episode:
    # prompt, then each turn's sampled tokens and each tool's output, in order
    token_ids: list[int] = field(default_factory=list)
    # 1 on tokens the model sampled, 0 on prompt and tool tokens
    loss_mask: list[int] = field(default_factory=list)
    # the sampled token's logprob where loss_mask is 1, else None
    logprobs: list[float | None] = field(default_factory=list)
    # per model turn: text, version, finish_reason
    turns: list[dict] = field(default_factory=list)
    # per call: name, argument, result
    tool_calls: list[dict] = field(default_factory=list)
    # "stop" / "length" (the model's last turn), "max_turns" or "budget"
    finish_reason: str = ""
    # as a Completion's, over token_ids
    versions: list[list[int]] | None = None

    def append(self, token_ids, logprobs, versions=()):
        """Add tokens: sampled ones with their `logprobs` (in the loss) and their `versions`, a
        Completion's [[version, first token]] spans counted from its first token; or, with logprobs
        None, the prompt's or a tool's (masked out)."""
        if versions:
            self.versions += [[v, len(self.token_ids) + start] for v, start in versions]
        self.token_ids += token_ids
        self.loss_mask += [0 if logprobs is None else 1] * len(token_ids)
        self.logprobs += [None] * len(token_ids) if logprobs is None else logprobs


# -- the weight group: the same code in the trainer (rank 0) and in each server worker (rank 1..)
# ---
def weight_group(transport, host, port, rank, world_size, weight_sync_timeout, device=None):
    """A process group of torch.distributed's own pieces, each with an explicit timeout: a TCPStore
    hosted by rank 0 (the trainer) and a gloo or NCCL backend. One tiny broadcast warms it up, so a
    peer that cannot reach us fails here, not in an update. NCCL makes its communicator on the GPU
    of the first tensor, so each rank sends that one from its own GPU, `device`."""
    timeout = timedelta(seconds=weight_sync_timeout)
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        # the trainer's store listens on `host` alone (TCPStore would bind every interface):
        # whoever reaches it could take a rank and receive every pushed weight
        master_listen_fd=store_socket(host, port).detach() if rank == 0 else None,
    )
    if transport == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        # NCCL's watchdog kills the process on timeout: only a backstop behind `wait_broadcast`
        options._timeout = timeout * 2
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout=timeout)
        device = torch.device("cpu")
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        broadcast(group, torch.zeros(1, device=device), weight_sync_timeout)
    return group


def store_socket(host, port) -> socket.socket:
    """A socket listening on `host`'s address alone, at `port`, for the trainer's TCPStore."""
    [(family, _, _, _, address)] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[:1]
    return socket.create_server(address, family=family)


def broadcast(group, tensor, weight_sync_timeout):
    """Broadcast `tensor` from the trainer (rank 0) and block until it has really arrived."""
    # rootRank 0: the trainer
    wait_broadcast(group.broadcast([tensor], dist.BroadcastOptions()), tensor, weight_sync_timeout)


def wait_broadcast(work, tensor, weight_sync_timeout):
    """Wait until a broadcast has arrived, at most `weight_sync_timeout` s. gloo's wait() blocks
    (bounded by the group's timeout). NCCL's only makes the tensor's CUDA stream wait for it: work
    queued after it is ordered right, but would hang for good if the peer died. So a thread waits
    for the stream, and we for the thread, within the timeout: no polling."""
    work.wait()
    if tensor.is_cuda:
        arrived = torch.cuda.current_stream(tensor.device).record_event()
        waiter = threading.Thread(target=arrived.synchronize, daemon=True)
        waiter.start()
        waiter.join(weight_sync_timeout)
        if waiter.is_alive():
            raise TimeoutError(f"a broadcast did not complete within {weight_sync_timeout} s")


def close_group(group):
    """Leave a group (None: none). An NCCL group is aborted, never shut down: shutdown() waits
    until every rank leaves, while the trainer and the workers leave one after the other (and a
    dead peer never does)."""
    if isinstance(group, getattr(dist, "ProcessGroupNCCL", ())):
        group.abort()


def share_cuda(buffer: torch.Tensor) -> dict:
    """A CUDA IPC handle of a uint8 buffer, as JSON. Plain fields, never a pickle: the server
    must not unpickle what arrives over HTTP."""
    from torch.multiprocessing.reductions import reduce_tensor

    # reduce_tensor gives rebuild_cuda_tensor's arguments; we send those that describe the memory:
    # 3 tensor offset, 6 device, 7 storage handle, 8 its bytes, 9 its offset, 11 ref counter
    # handle, 12 its offset, 13 event handle, 14 event_sync_required
    args = reduce_tensor(buffer)[1]
    return {
        "offset": args[3],
        "device": args[6],
        "handle": to_base64(args[7]),
        "storage_bytes": args[8],
        "storage_offset": args[9],
        "ref": to_base64(args[11]),
        "ref_offset": args[12],
        "event": to_base64(args[13]),
        "event_sync": args[14],
        "gpu": device_uuid(buffer.device),
    }


def open_cuda(shared: dict, size: int, device: torch.device) -> torch.Tensor:
    """The uint8 buffer behind a share_cuda() handle, opened in this process on `device`.
    torch caches opened handles while the tensor lives, so a buffer reused by the trainer is
    opened once (~170 ms on an H200) and costs nothing on later updates."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([size]),
        (1,),
        shared["offset"],
        torch.TypedStorage,
        torch.uint8,
        device.index,
        from_base64(shared["handle"]),
        shared["storage_bytes"],
        shared["storage_offset"],
        False,
        from_base64(shared["ref"]),
        shared["ref_offset"],
        from_base64(shared["event"]),
        shared["event_sync"],
    )


def to_base64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def from_base64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def choose_transport(transport, device, server_gpus):
    """(transport, device of the trainer's send buffers) for Client.init_communicator: the
    transport given or the one `device` calls for (default: CUDA if available), checked."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if transport is None:
        same_gpu = device.type == "cuda" and device_uuid(device) in server_gpus
        transport = "ipc" if same_gpu else "nccl" if device.type == "cuda" else "gloo"
    if transport not in TRANSPORTS or (transport != "gloo" and device.type != "cuda"):
        raise ValueError(
            f"transport must be one of {TRANSPORTS}, and ipc or nccl need the trainer on CUDA; "
            f"got {transport!r} on {device}"
        )
    # gloo sends from CPU buffers
    return transport, torch.device("cpu") if transport == "gloo" else device


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def fingerprint(named, dtype=None) -> str:
    """A short hash of weights [(name, tensor)]: 16 values at each end of 16 of them, in `dtype`; of
    a peft model's, its base weights alone (`base_layer`s, without the adapter). The server's of the
    base weights it serves and a trainer's of its model's (in the server's dtype) agree when those
    weights do."""
    base = [(name.replace(".base_layer.", "."), t) for name, t in named if ".lora_" not in name]
    # 16 tensors, evenly among the names, and views of 16 values at each end of each, then one copy
    # and one cast of them all: part of every update, so a few kernels and little Python, not a few
    # of each per tensor (a 0.5B model has 290); weights of another base differ in every tensor
    edges = []
    for _, t in sorted(base, key=lambda item: item[0])[:: max(1, len(base) // 16)]:
        edges += [t[:1].flatten()[:16], t[-1:].flatten()[-16:]]
    edges = torch.cat(edges).detach()
    return hashlib.sha256(edges.to(dtype or edges.dtype).float().cpu().numpy()).hexdigest()[:16]


def pack(named, bucket_bytes, dtype=None):
    """Greedy packing in order: [(bucket announcement, [tensors])]; offsets aligned to 16 bytes.
    Each tensor is announced in `dtype` (the server's; None: its own), which fill_bucket casts
    it to as it copies it in."""
    buckets = []
    for name, t in named:
        nbytes = t.numel() * (dtype or t.dtype).itemsize
        # a new bucket where this one would overflow (a larger tensor goes alone)
        if not buckets or buckets[-1][0]["size"] + nbytes > bucket_bytes:
            buckets.append(({"size": 0, "params": []}, []))
        bucket, tensors = buckets[-1]
        kind = str(dtype or t.dtype).removeprefix("torch.")
        param = {"name": name, "dtype": kind, "shape": list(t.shape), "offset": bucket["size"]}
        bucket["params"].append(param)
        tensors.append(t)
        bucket["size"] += math.ceil(nbytes / 16) * 16
    return buckets


def fill_bucket(buffer, bucket, tensors):
    """Copy a bucket's tensors into `buffer` at their announced offsets, cast to their announced
    dtype on the way (one pass over each tensor, no copy of it in the server's dtype; one call)."""
    copy_into([view for _, view in unpack(buffer, bucket["params"])], tensors)


def copy_into(targets, sources):
    """Copy each of `sources` into its target, cast on the way, as one call: torch's multi-tensor
    kernel, as its optimizers use (torch._foreach_copy_, private: called here alone)."""
    if targets:
        torch._foreach_copy_(targets, sources)


def unpack(buffer: torch.Tensor, params):
    """Views into one received bucket: yields (name, tensor) for params [{name, dtype, shape,
    offset}]."""
    for p in params:
        dtype = DTYPES[p["dtype"]]
        end = p["offset"] + math.prod(p["shape"]) * dtype.itemsize
        yield p["name"], buffer[p["offset"] : end].view(dtype).view(p["shape"])


class IpcBuffer:
    """ipc, the trainer's side: one buffer on its GPU that the workers copy from, its CUDA IPC
    handle, valid while the buffer keeps its size, and its views, valid while the layout stays
    (the worker's twin: engine.IpcViews)."""

    def __init__(self, device):
        self.device = device
        self.buffer = self.handle = self.layout = self.views = None

    def share(self, bucket, tensors) -> dict:
        """Fill the buffer with a bucket's tensors: the handle that announces it."""
        self.fill(bucket, tensors)
        # the workers read it from another process
        torch.cuda.synchronize(self.device)
        # one handle per buffer: the workers keep it open, a new one they would open again
        self.handle = self.handle or share_cuda(self.buffer)
        return self.handle

    def fill(self, bucket, tensors):
        """fill_bucket through views made once per layout, the copies as one foreach call (290
        tensors for a 0.5B model)."""
        if self.buffer is None or self.buffer.numel() != bucket["size"]:
            # a new buffer needs a new handle and views; the old one freed first (its views hold it)
            self.buffer = self.views = self.layout = self.handle = None
            self.buffer = torch.zeros(bucket["size"], dtype=torch.uint8, device=self.device)
        if self.layout != bucket["params"]:
            self.views = [view for _, view in unpack(self.buffer, bucket["params"])]
            self.layout = bucket["params"]
        copy_into(self.views, tensors)


# -- the client ------------------------------------------------------------------------------------
class ServerError(Exception):
    """The server answered with an error; `status` is the HTTP code, the message is the server's.
    `engine_dead`: the server's vLLM engine died (the message says why), and will not come back
    until the server restarts; other 503s (busy, updating, draining) pass."""

    def __init__(self, status, message, engine_dead=False):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.engine_dead = engine_dead


class RemoteFuture:
    """A request the server is working on; `result()` collects it with /get_future."""

    def __init__(self, client, request_id):
        self.client = client
        self.request_id = request_id
        # once fetched: when the server queued, started and finished it (its time.time())
        self.timing = None
        # the result once fetched (the server frees it then)
        self.fetched = None

    def result(self, timeout=None):
        """Wait (long-polling the server in slices of at most 60 s) and return the result; a
        TimeoutError if it is not done within `timeout` s (then ask again: nothing is lost)."""
        if self.fetched is None:
            _, self.fetched, self.timing = self.client._collect([self.request_id], timeout)
        return self.fetched

    def done(self) -> bool:
        """Whether the result is ready (if so, it is fetched now, and result() returns it)."""
        with contextlib.suppress(TimeoutError):
            self.result(timeout=0)
        return self.fetched is not None

    def abort(self):
        self.client.abort(self.request_id)


def collect_each(futures, timeout=None):
    """The results of one-prompt RemoteFutures, as one request's: a list per prompt."""
    return [future.result(timeout)[0] for future in futures]


class AbortsOnError(contextlib.AbstractContextManager):
    """`with Client(url) as client:` (or a Router) aborts the requests it submitted and never
    fetched if the block raises (a trainer that fails mid-step leaves nothing generating on the
    server)."""

    def __exit__(self, error_type, error, traceback):
        if error is not None:
            self.abort_pending()


class Client(AbortsOnError):
    """One server's client: generation, tool episodes, the trainer's side of weight sync."""

    def __init__(
        self, base_url=None, timeout=600.0, api_key=None, host="127.0.0.1", server_port=8000
    ):
        """The server at `base_url`, or as TRL's VLLMClient, `host` and `server_port`. `api_key`
        (default: $VLLM_API_KEY) for a server started with --api-key. Nothing is retried: a server
        that cannot be reached is a ConnectionError at once (a trainer waits for one that
        restarts: train.reconnect; check_server waits for one that starts)."""
        self.base_url = (base_url or f"http://{host}:{server_port}").rstrip("/")
        self.timeout = timeout
        key = api_key or os.environ.get("VLLM_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = requests.Session()
        # ids submitted and not yet fetched -> their number of prompts (a Router's load measure)
        self.pending = {}
        # set by init_communicator: the server's parameters (names, shapes) and its dtype
        self.spec = self.dtype = None
        # what the last full push sent, {name: tensor} (update_named_param sends it again)
        self.pushed = {}
        # the weight group, its transport, send buffers and last layout: none yet (_drop_group)
        self.group = None
        self._drop_group()

    def _request(self, method, path, body=None, timeout=None, http=None, stream=False):
        """The answer's JSON; with `stream`, the response itself, to read as it comes."""
        url = self.base_url + path
        timeout = timeout or self.timeout
        try:
            r = (http or self.http).request(
                method, url, json=body, timeout=timeout, headers=self.headers, stream=stream
            )
        except requests.ConnectionError as e:
            raise ConnectionError(f"server unreachable at {self.base_url}: {e}") from None
        if r.status_code >= 400:
            try:
                reply = r.json()
                message = reply["error"]
                # the /v1 routes: OpenAI's shape
                message = message["message"] if isinstance(message, dict) else message
            except (ValueError, KeyError, TypeError):
                reply = {}
                message = r.text
            raise ServerError(r.status_code, message, reply.get("engine_dead", False))
        return r if stream else r.json()

    def health(self, timeout=10.0):
        return self._request("GET", "/health", timeout=timeout)

    def tools(self):
        """Every tool /rollout may call, as OpenAI tool schemas (a chat template's `tools`)."""
        return self._request("GET", "/tools")["tools"]

    def check_server(self, total_timeout=0.0, retry_interval=2.0):
        """TRL's: wait until the server answers /health, asking every `retry_interval` s, at most
        `total_timeout` s (then a ConnectionError); its /health."""
        deadline = time.monotonic() + total_timeout
        while True:
            with contextlib.suppress(ConnectionError, ServerError):
                return self.health()
            if time.monotonic() + retry_interval > deadline:
                raise ConnectionError(f"no server up at {self.base_url} after {total_timeout} s")
            time.sleep(retry_interval)

    def reset_prefix_cache(self) -> bool:
        """TRL's: empty the server's prefix cache; whether it was (not while requests run)."""
        return self._request("POST", "/reset_prefix_cache")["reset"]

    def abort(self, request_id):
        """Cancel a submitted request on the server (its prompts stop generating) and free it,
        waiting at most 30 s (or the client's timeout, if shorter) for the answer."""
        self.pending.pop(request_id, None)
        try:
            self._request("POST", "/abort", {"request_id": request_id}, min(30.0, self.timeout))
        except ServerError as e:
            if e.status != 404:  # 404: it finished and was fetched, or expired, meanwhile
                raise

    def abort_pending(self):
        """Abort every request submitted and not fetched, as far as the server answers: a server
        gone or silent (shutting down) ends it at the first abort; the results there expire.
        Called while an error unwinds, it never raises one of its own in the error's place."""
        for request_id in list(self.pending):
            try:
                self.abort(request_id)
            except ServerError:
                continue
            except (ConnectionError, requests.RequestException):
                self.pending.clear()
                return

    # -- generation -------------------------------------------------------------------------------
    def generate(self, prompts, is_async=False, **sampling):
        """Completions for each prompt (a string, a list of token ids, or a conversation: a list of
        {role, content} messages, which the server renders with the model's chat template): a list
        per prompt of `n` Completion(text, token_ids, logprobs, finish_reason, version). Keyword
        arguments are vLLM SamplingParams fields (n, temperature, max_tokens, top_p, top_k, seed,
        stop, ...; the server's defaults are n=1, max_tokens=16 and vLLM's), `priority` (lower runs
        first), or `min_version`. With is_async=True, return a RemoteFuture at once instead."""
        return self._submit("/generate", {"prompts": list(prompts), **sampling}, is_async)

    # TRL's name for generate() on conversations
    chat = generate

    def submit_each(self, prompts, **sampling):
        """generate() with one request per prompt, all in one call: a RemoteFuture per prompt, in
        order (collect them with as_completed(), in the order they finish)."""
        body = {"prompts": list(prompts), "split_prompts": True, **sampling}
        ids = self._request("POST", "/generate", body)["request_ids"]
        self.pending.update(dict.fromkeys(ids, 1))
        return [RemoteFuture(self, i) for i in ids]

    def rollout(self, prompts, is_async=False, **options):
        """Multi-turn tool episodes: a list per prompt of `n` Episode. Keyword arguments: n, tools,
        max_turns (4), max_episode_tokens (256), call_start, call_end, result_format, and
        generate's sampling fields (max_tokens 64 here, a turn's);
        docs/http.md#multi-turn-tool-episodes."""
        body = {"prompts": list(prompts), "max_tokens": 64, **options}
        return self._submit("/rollout", body, is_async)

    def session(self, session_id):
        """The calls an OpenAI client made with the header X-Session-ID: `session_id`: (calls, the
        merged Episode, or None when the calls do not continue one another token for token)."""
        reply = self._request("GET", f"/v1/sessions/{session_id}")
        return reply["calls"], Episode(**reply["episode"]) if reply["episode"] else None

    def _submit(self, path, body, is_async):
        """Submit one request: its RemoteFuture with `is_async`, else its result."""
        request_id = self._request("POST", path, body)["request_id"]
        self.pending[request_id] = len(body["prompts"])
        future = RemoteFuture(self, request_id)
        return future if is_async else future.result()

    def get_future(self, request_id, timeout=None):
        """The result of a submitted request, by its id (RemoteFuture.result)."""
        return RemoteFuture(self, request_id).result(timeout)

    def as_completed(self, futures, timeout=None):
        """Yield (future, result) in the order the server finishes them, not the order given."""
        remaining = {f.request_id: f for f in futures}
        while remaining:
            for request_id, result, timing in self._collect(list(remaining), timeout, every=True):
                future = remaining.pop(request_id)
                future.fetched, future.timing = result, timing
                yield future, result

    def _collect(self, request_ids, timeout=None, every=False):
        """Long-poll /get_future, in slices of at most 60 s, until one of `request_ids` is done:
        (its id, its result, its timing), or with `every`, a list of those for all of them that
        are done by then. A result is [[Completion]] or [[Episode]]."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        body = {"request_ids": request_ids} if every else {"request_id": request_ids[0]}
        while True:
            wait = min(60.0, max(deadline - time.monotonic(), 0.0))
            try:
                reply = self._request("POST", "/get_future", {**body, "timeout": wait}, wait + 30)
                break
            except ServerError as e:
                # 408: not done within this slice
                if e.status != 408:
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(e.message) from None
        done = []
        for r in reply.get("results", [reply]):
            self.pending.pop(r["request_id"], None)
            if "episodes" in r:
                result = [[Episode(**e) for e in per] for per in r["episodes"]]
            else:
                result = [[Completion(**c) for c in per] for per in r["completions"]]
            done.append((r["request_id"], result, r.get("timing")))
        return done if every else done[0]

    # -- weight sync (the trainer is rank 0) ------------------------------------------------------
    def init_communicator(
        self, transport=None, host="127.0.0.1", device=None, weight_sync_timeout=60.0
    ):
        """Set up weight sync with the server's workers; `transport` ipc, nccl or gloo (default:
        chosen from `device`, where the trainer's tensors are). `host`: this machine's address as
        the workers reach it. `weight_sync_timeout`: our side's (the server has its own flag)."""
        info = self.health()
        transport, self.device = choose_transport(transport, device, info["gpus"])
        # a call refused above changes nothing: the weight sync set up before stays
        self._drop_group()
        port = info["group_port"]
        world_size = 1 + info["workers"]
        # the group's host and size (ipc needs no group), and ipc's GPU, which the server checks
        body = {"transport": transport, "host": host, "world_size": world_size}
        if transport == "ipc":
            body["gpu"] = device_uuid(self.device)
        # the server's workers join the group while we host its store (rank 0): the request runs
        # on a thread, with a session of its own (a requests.Session is not thread-safe)
        wait = weight_sync_timeout + 30
        http = requests.Session()
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(self._request, "POST", "/init_communicator", body, wait, http)
            try:
                if transport != "ipc":
                    self.group = weight_group(
                        transport, host, port, 0, world_size, weight_sync_timeout, self.device
                    )
            except Exception as e:
                # the server's answer says why, if it has one
                reply.result()
                raise ConnectionError(f"weight group at {host}:{port} failed: {e}") from None
            answer = reply.result()
        self.transport = transport
        self.ipc = IpcBuffer(self.device) if transport == "ipc" else None
        self.weight_sync_timeout = weight_sync_timeout
        self.spec = answer["params"]
        self.dtype = getattr(torch, answer["dtype"])

    def close_communicator(self):
        if self.transport is not None:
            self._request("POST", "/close_communicator")
            self._drop_group()

    def _drop_group(self):
        close_group(self.group)
        self.group = self.transport = self.ipc = None
        # nccl, gloo: two send buffers, reused between updates (ipc's: IpcBuffer)
        self.buffers = [None, None]
        # the version our last update made and its buckets' params (checked by the server then)
        self.layout = (None, None)

    def _send_buffer(self, slot, size):
        """A reusable uint8 buffer of at least `size` bytes on the trainer's device."""
        if self.buffers[slot] is None or self.buffers[slot].numel() < size:
            self.buffers[slot] = None  # free the old one first
            self.buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.buffers[slot][:size]

    def update_model_params(self, model, bucket_mb=32, mode="drain", version=0):
        """Push a torch.nn.Module's parameters (or a state dict; a peft model: its adapter) into the
        server in one call; return the new weight version, or `version` if higher
        (docs/internals.md#clientupdate_model_params)."""
        if hasattr(model, "peft_config"):
            return self.update_adapter(model, mode, version)
        if self.transport is None:
            raise RuntimeError("call init_communicator() first")
        start = time.perf_counter()
        named = self._named_tensors(model)
        buckets = pack(named, math.inf if self.ipc else bucket_mb << 20, self.dtype)
        # ipc: one bucket, filled now, which the workers copy from
        if self.ipc:
            buckets[0][0]["handle"] = self.ipc.share(*buckets[0])
        pack_s = time.perf_counter() - start
        # an error status here means nothing was sent, and the group stays as it is
        body = {"buckets": [b for b, _ in buckets], "mode": mode, "version": version}
        layout, (then, layout_then) = [b["params"] for b, _ in buckets], self.layout
        # forgotten until this push succeeds: after a refusal or a failure the next sends params
        self.layout = (None, None)
        if layout == layout_then:
            # the same names, shapes and offsets as the update that made version `then`, which the
            # server checked then: the buckets name their sizes (and handles) alone
            body["buckets"] = [{k: v for k, v in b.items() if k != "params"} for b, _ in buckets]
            body["same_layout"] = then
        with self._request("POST", "/update_weights", body, stream=True) as answer:
            try:
                lines = answer.iter_lines()
                # {"receiving": true}: the workers receive; we pack and send each bucket (ipc: done)
                read_json_line(lines)
                start = time.perf_counter()
                if not self.ipc:
                    self._send_buckets(buckets)
                send_s = time.perf_counter() - start
                result = read_json_line(lines)
                # read to its end: only then does its connection serve the next update (a new
                # one each time costs a connect and the server's setup of it)
                next(lines, None)
                if "error" in result:
                    raise ServerError(result["status"], result["error"])
            except Exception:
                # a failed update: the server's workers left the group (or the server exits)
                self._drop_group()
                raise
        # pack_s and send_s here, receive_s and load_s in the workers: where the time went
        self.last_update = {"pack_s": pack_s, "send_s": send_s, **result}
        self.pushed = dict(named)
        self.layout = (result["version"], layout)
        return result["version"]

    def update_named_param(self, name, tensor, **options):
        """TRL's: push one tensor, a new version as a full push is. The server loads whole layers,
        so the others go along, as the last update_model_params sent them (none before the first:
        the server then refuses it)."""
        return self.update_model_params({**self.pushed, name: tensor}, **options)

    def update_adapter(self, model, mode="drain", version=0, via=None):
        """Push a peft model's active LoRA adapter into a server started with --enable-lora, as
        PEFT saves it (adapter_config.json, adapter_model.safetensors); return the new version.
        `via`: "file" (in /dev/shm, for a server on this host) or "body" (any server)."""
        # Why not the weight transports: vLLM loads adapters from a folder only, so the workers
        # would write what they received to one anyway, and an adapter is megabytes, where an
        # update's fixed cost (the announcing call, collective_rpc, the load) outweighs bytes.
        # A file in shared memory skips the body's base64 and JSON, which on a GPU cost more than
        # vLLM's add_lora (bench/lora.py, docs/results.md); the body needs only HTTP.
        from peft import get_peft_model_state_dict
        from safetensors.torch import save, save_file

        start = time.perf_counter()
        # by default a file for a server on this host's loopback, where /dev/shm exists
        local = urllib.parse.urlsplit(self.base_url).hostname in ("127.0.0.1", "localhost", "::1")
        via = via or ("file" if local and os.path.isdir("/dev/shm") else "body")
        # a set in the config (target_modules) is a list in JSON
        config = model.peft_config[model.active_adapter].to_dict()
        config = json.loads(json.dumps(config, default=sorted))
        # in the server's dtype (an fp32 adapter to a bf16 server: half the bytes, and what it
        # would cast to anyway); safetensors' save copies GPU tensors to the CPU itself
        self.dtype = self.dtype or getattr(torch, self.health()["dtype"])
        state = {k: t.detach().to(self.dtype) for k, t in get_peft_model_state_dict(model).items()}
        body = {"adapter_config": config, "mode": mode, "version": version}
        # the server checks that it serves the base weights the adapter was trained on
        body["base_fingerprint"] = fingerprint(model.named_parameters(), self.dtype)
        if via == "file":
            # the server reads it (shared_file checks the name) while we wait
            fd, body["adapter_file"] = tempfile.mkstemp(".safetensors", "adapter-", "/dev/shm")
            os.close(fd)
            save_file(state, body["adapter_file"])
        else:
            body["adapter_model"] = to_base64(save(state))
        encode_s = time.perf_counter() - start
        try:
            self.last_update = self._request("POST", "/update_adapter", body)
        finally:
            if via == "file":
                os.remove(body["adapter_file"])
        self.last_update["encode_s"] = encode_s
        return self.last_update["version"]

    def _send_buckets(self, buckets):
        """Broadcast the buckets (nccl/gloo), packing each next one while the last one travels."""
        sending = [None, None]  # the work in flight from each buffer
        for i, (bucket, tensors) in enumerate(buckets):
            if sending[i % 2] is not None:
                # its buffer is ours again (NCCL: the copies into it wait on the stream)
                sending[i % 2][0].wait()
            buffer = self._send_buffer(i % 2, bucket["size"])
            fill_bucket(buffer, bucket, tensors)
            sending[i % 2] = (self.group.broadcast([buffer], dist.BroadcastOptions()), buffer)
        for work in filter(None, sending):
            wait_broadcast(*work, self.weight_sync_timeout)

    def _named_tensors(self, model):
        """[(checkpoint name, tensor)]; a tied weight (lm_head = embed_tokens) is sent once, under
        the server's name. The server checks names and shapes before anything is sent."""
        items = model.named_parameters() if isinstance(model, torch.nn.Module) else model.items()
        # DDP, compile
        items = [(name.removeprefix("module.").removeprefix("_orig_mod."), t) for name, t in items]
        known = {t.data_ptr() for name, t in items if name in self.spec}
        named = []
        for name, t in items:
            # a tied weight's other name: its tensor goes under the server's name
            if name in self.spec or t.data_ptr() not in known:
                named.append((name, t.detach()))
        return named


def read_json_line(lines):
    """The next JSON line of an answer read as it comes (/update_weights)."""
    try:
        return json.loads(next(lines))
    except (StopIteration, requests.RequestException) as e:
        raise ConnectionError(f"the server went away mid-answer: {e!r}") from None


def server_lost(e):
    """Whether to set weight sync up with the server anew once it answers: unreachable, restarted
    (404, 409) or its weight group broken (502, 504); a 503 is busy, and a dead engine stops the
    run (a RuntimeError with the cause). Other errors are raised by the caller."""
    if getattr(e, "engine_dead", False):
        raise RuntimeError(f"the server's engine died: {e.message}") from None
    return not isinstance(e, ServerError) or e.status in (404, 409, 502, 504)


def push_until_done(client, model, timeout=600.0, **options):
    """client.update_model_params, asked again while the server is busy (503: requests were still
    in flight after its --drain-timeout, and nothing was sent) and still answers /health, with
    backoff between the asks (0.1 s, doubling up to 5 s): a TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    backoff = 0.1
    while True:
        try:
            return client.update_model_params(model, **options)
        except ServerError as e:
            if e.status != 503 or e.engine_dead:
                raise
            if time.monotonic() + backoff > deadline:
                raise TimeoutError(f"{client.base_url} still busy after {timeout} s: {e}") from None
            client.health()
            time.sleep(backoff)
            backoff = min(2 * backoff, 5.0)


# -- several servers -------------------------------------------------------------------------------
class Router(AbortsOnError):
    """Several servers behind Client's methods: `Router(["http://a:8000", "http://b:8000"])`,
    prompts spread over the live servers, every update to each; a lost server is dropped and
    re-admitted at the next update (docs/internals.md#router)."""

    def __init__(self, urls, **options):
        """`options`: Client's."""
        self.clients = [Client(url, **options) for url in urls]
        self.live = list(self.clients)
        self.version = 0  # the version every live server serves, once weight sync is set up
        self.sessions = {}  # X-Session-ID -> the Client of its server
        # collects the spread batches of generate(is_async=True)
        self.pool = ThreadPoolExecutor(4)

    def abort_pending(self):
        for client in self.clients:
            client.abort_pending()

    def least_loaded(self, placed=None):
        """The live server with the fewest of our prompts pending, counting those `placed` on it."""
        if not self.live:
            raise ConnectionError("no server is live")
        placed = placed or {}
        return min(self.live, key=lambda c: sum(c.pending.values()) + len(placed.get(c, ())))

    def submit_each(self, prompts, **sampling):
        """Client.submit_each with the prompts spread over the live servers, each on the server
        least loaded once the prompts before it are placed: a RemoteFuture per prompt, in order."""
        placed = {}  # Client -> the indices of its prompts
        for i in range(len(prompts)):
            placed.setdefault(self.least_loaded(placed), []).append(i)
        futures = {}
        for client, mine in placed.items():
            futures.update(zip(mine, client.submit_each([prompts[i] for i in mine], **sampling)))
        return [futures[i] for i in range(len(prompts))]

    def generate(self, prompts, is_async=False, **sampling):
        """Client.generate over the live servers, a request per prompt (submit_each): the results
        in one list (is_async: a concurrent.futures.Future of it)."""
        futures = self.submit_each(prompts, **sampling)
        return self.pool.submit(collect_each, futures) if is_async else collect_each(futures)

    def rollout(self, prompts, **options):
        return self.least_loaded().rollout(prompts, **options)

    def tools(self):
        return self.least_loaded().tools()

    def session_url(self, session_id):
        """Where an OpenAI client sends the calls of X-Session-ID `session_id`: one server, chosen
        at the first call, so that they merge into one episode there."""
        if session_id not in self.sessions:
            self.sessions[session_id] = self.least_loaded()
        return self.sessions[session_id].base_url

    def session(self, session_id):
        return self.sessions[session_id].session(session_id)

    def as_completed(self, futures, timeout=None):
        """Client.as_completed over several servers: each long-polled on a thread of its own, the
        results yielded as they come, whichever server they come from."""
        done = queue.Queue()

        def poll(client, own):
            try:
                for item in client.as_completed(own, timeout):
                    done.put(item)
            except Exception as e:  # handed to the caller
                done.put(e)

        for client in {f.client for f in futures}:
            own = [f for f in futures if f.client is client]
            threading.Thread(target=poll, args=(client, own), daemon=True).start()
        for _ in futures:
            # every poll ends with a result or its error, within `timeout` (the client's by default)
            item = done.get()
            if isinstance(item, Exception):
                raise item
            yield item

    def health(self, timeout=10.0):
        """The /health of the live server with the lowest version: what a trainer checks."""
        return min((c.health(timeout) for c in self.live), key=lambda h: h["version"])

    # -- weight sync: one group per server --------------------------------------------------------
    def init_communicator(self, **sync):
        """Client.init_communicator with every server; those that do not answer are dropped.
        `sync` is kept to re-admit them."""
        self.sync = sync
        self.live = [c for c in self.clients if self._admit(c)]

    def _admit(self, client):
        """Set up weight sync with `client`'s server; whether it answered."""
        try:
            client.init_communicator(**self.sync)
            self.version = max(self.version, client.health()["version"])
            return True
        except (ConnectionError, ServerError) as e:
            if not server_lost(e):
                raise
            return False

    def update_model_params(self, model, **options):
        """Push to every live server, after re-admitting the dropped ones that answer again; all
        then serve version self.version + 1. A server lost meanwhile is dropped."""
        self.live += [c for c in self.clients if c not in self.live and self._admit(c)]
        options["version"] = self.version + 1
        with ThreadPoolExecutor(max(len(self.live), 1)) as pool:
            pushes = [pool.submit(push_until_done, c, model, **options) for c in self.live]
        errors = [push.exception() for push in pushes]
        for client, error in zip(self.live, errors):
            if error is not None and not server_lost(error):
                raise error
            # what a dropped server holds would wait there for versions it never gets: aborted, a
            # trainer waiting for it hears so (404) and submits it again
            if error is not None:
                client.abort_pending()
        self.live = [c for c, error in zip(self.live, errors) if error is None]
        if not self.live:
            raise ConnectionError(f"every server was lost during the update: {errors}")
        self.version = options["version"]
        return self.version

    def close_communicator(self):
        for client in self.live:
            client.close_communicator()


# -- a local server process, for the demo, the tests and the benchmarks ----------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# what huggingface_hub takes for a repo id: NAME or ORG/NAME
HUB_ID = re.compile(r"(\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b")


def model_error(model) -> str:
    """What is wrong with a `--model`, in one line: a folder without tokenizer files
    (transformers' own error blames sentencepiece or tiktoken instead), or a path to nothing that
    cannot be a hub id either (vLLM's error would be a long traceback); else ""."""
    if os.path.isdir(model or "") and not any(
        os.path.exists(os.path.join(model, name)) for name in TOKENIZER_FILES
    ):
        return f"model folder {model} has none of the tokenizer files {', '.join(TOKENIZER_FILES)}"
    if model and not os.path.exists(model) and not HUB_ID.fullmatch(model):
        return f"no model folder {model}, and no hub id (NAME or ORG/NAME) either"
    return ""


def load_function(spec, flag):
    """The function that `spec`, "module:function", names (the module importable by this process:
    beside this file, in the current folder or on PYTHONPATH), or a ValueError that names the
    `flag`."""
    module, _, name = spec.partition(":")
    # the caller's folder too, as `python -m` has it (python path/train.py has train.py's)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{flag} {spec} (module:function): {e}") from None


def free_port():
    """A port free now, below the ports the OS hands out for port 0 (32768 and up on Linux): a
    weight group's port is bound only once a trainer joins, and a port the OS gives another socket
    meanwhile (vLLM's own, of a data-parallel server) must not be it."""
    while True:
        port = random.randrange(20000, 32768)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
