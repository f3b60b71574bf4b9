"""GRPO with asynchronous rollouts: train on micro-batch i while the server generates i+1..N.

    python train.py                      # demo: the tiny model learns addition (minutes on a CPU)
    python train.py --schedule sync-batch    # the synchronous loop, for comparison
    python train.py --config examples/run.yaml   # GSM8K on Qwen2.5-0.5B-Instruct, on a GPU
    python train.py --dataset my.jsonl --reward my_rewards:boxed --max-tokens 256 \\
        --save-every 20 --out runs/mine
    python train.py --resume runs/mine --steps 200     # goes on from its last checkpoint
    python train.py --config runs/mine/config.yaml --out runs/b    # a new run with those flags
    python train.py --dataset openai/gsm8k:main --prompt-column question \\
        --reward tasks:gsm8k_reward,tasks:format_reward --reward-weights 1,0.2
    python train.py --eval-only --model runs/mine/checkpoint --dataset my.jsonl

Where this departs from the GRPO paper:
1. Each batch is used for one optimizer step: no PPO ratio or clip. With --max-staleness 0 (the
   default) every sample comes from the weights it trains, exactly on-policy, and the loop checks
   each sample's version; with 1, samples are one version old and weighted by truncated IS.
2. No KL penalty and no reference model.
3. The loss is token-level, normalised by all completion tokens of the optimizer step (TRL's
   dapo; --loss-type grpo and dr_grpo as TRL's).
"""

import argparse
import collections
import contextlib
import difflib
import functools
import gc
import importlib.util
import inspect
import json
import math
import os
import random
import re
import reprlib
import shlex
import signal
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from statistics import mean

import torch
import torch.distributed as dist
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from client import (
    DTYPES,
    Client,
    Episode,
    Router,
    ServerError,
    collect_each,
    load_function,
    model_error,
    push_until_done,
    server_lost,
)
from local import SHAPES, TINY_MODEL_DIR, launch_server, save_model, stop_server, tiny_model
from plot import RunLog
from tasks import TASKS, answer_reward


def flag(default, help, choices=None, at_least=None):
    """A Config field, exposed by parse_config as a --flag with this help, at least `at_least`."""
    return field(default=default, metadata={"help": help, "choices": choices, "at_least": at_least})


@dataclass
class Config:
    """The flags: `python train.py --help` lists them; docs/training.md says more of each."""

    # model, data, and where things run
    model: str = flag("", "HF folder or hub id (default: the built-in model, warm-started)")
    model_size: str = flag("tiny", "the built-in model's shape (local.SHAPES)", list(SHAPES))
    warm_start_steps: int = flag(100, "supervised steps teaching the built-in model the task")
    dataset: str = flag("", "jsonl/json/csv/parquet file, save_to_disk folder or hub NAME[:CONFIG]")
    dataset_split: str = flag("train", "the split of a hub dataset or a folder of several")
    prompt_column: str = flag("prompt", "the column of the prompts: a string or chat messages")
    answer_column: str = flag("answer", "the column the rewards read as the row's answer")
    eval_dataset: str = flag("", "held-out prompts, as --dataset (default: --dataset's first ones)")
    chat_template: str = flag("", "a Jinja file: the chat template of conversational rows")
    system_prompt: str = flag("", "a system message first in each row (makes a string the user's)")
    reward: str = flag("", "module:function,...: (completion, row) -> [0, 1] or None (Rewards)")
    reward_weights: str = flag("", "w1,w2,...: each --reward's weight in the sum (default 1)")
    success_threshold: float = flag(1.0, "a reward (the sum) of at least this is a success")
    task: str = flag("addition", "the built-in data, reward and tools (TASKS)", list(TASKS))
    max_turns: int = flag(3, "tool episodes: model turns per episode", at_least=1)
    tools: str = flag("", "tool episodes with these server tools, NAME,... (calculator: calc)")
    dtype: str = flag("", "dtype of the served weights: float32, or with --server-url the server's")
    server_url: str = flag("", "running servers: URL or URL,URL,... (default: --num-servers)")
    num_servers: int = flag(1, "servers to start on the model (GPUs: server k on GPU k)")
    server_args: str = flag("", "flags for the server train.py starts: '--max-model-len 512 ...'")
    reconnect_timeout: float = flag(300.0, "seconds to wait for a server that restarted or left")
    device: str = flag("cpu", "trainer device: cpu or cuda[:k] (weights over gloo, IPC or NCCL)")
    trainer_host: str = flag("127.0.0.1", "this machine's address as the servers' workers reach it")
    gpu_memory_utilization: float = flag(0.3, "the GPU share of the server train.py starts")
    out: str = flag("runs/demo", "folder for metrics.jsonl, plot.png and the checkpoint")
    save_every: int = flag(0, "save the checkpoint every K steps (0: at the end only)", at_least=0)
    checkpoint: bool = flag(True, "save the checkpoint at the end (--no-checkpoint: metrics only)")
    resume: str = flag("", "continue the run in this --out from its checkpoint")
    config: str = flag("", "a YAML file of flags by name (lr: 1e-5), those given here win")
    seed_requests: bool = flag(False, "seed each step's requests from its prompts (exact resumes)")
    seed: int = flag(0, "seed for data, sampling and init")
    # GRPO
    steps: int = flag(120, "optimizer steps", at_least=1)
    prompts_per_step: int = flag(32, "prompts per optimizer step")
    micro_batches: int = flag(4, "N: gradient-accumulation micro-batches per step", at_least=1)
    group_size: int = flag(8, "G: completions per prompt (TRL's num_generations)", at_least=2)
    max_tokens: int = flag(4, "completion length limit", at_least=1)
    temperature: float = flag(1.0, "sampling temperature")
    lr: float = flag(1e-3, "AdamW learning rate")
    max_grad_norm: float = flag(1.0, "gradient clipping")
    loss_type: str = flag("dapo", "TRL's: the loss divisor", ["dapo", "grpo", "dr_grpo"])
    scale_rewards: str = flag("group", "TRL's: advantages / the std of", ["group", "batch", "none"])
    # memory
    train_micro_batch: int = flag(0, "sequences per forward/backward (0: all)", at_least=0)
    train_micro_tokens: int = flag(0, "padded tokens per forward at most (0: any)", at_least=0)
    bf16: bool = flag(False, "bfloat16 autocast for forward and backward (fp32 master weights)")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward")
    # the schedule
    schedule: str = flag("overlap", "when the trainer gets samples", ["overlap", "sync-batch"])
    max_staleness: int = flag(0, "K: steps generated ahead, on weights K versions old", at_least=0)
    update_mode: str = flag("drain", "a push and the requests in flight", ["drain", "in-flight"])
    is_cap: float = flag(2.0, "cap of the importance weights of stale tokens (TIS)")
    mismatch_warning: float = flag(0.05, "mean trainer-server logprob difference that warns")
    # LoRA
    lora_rank: int = flag(0, "R: train a LoRA adapter of rank R (0: every weight)", at_least=0)
    lora_alpha: int = flag(0, "LoRA scale alpha / R (0: alpha = 2R)", at_least=0)
    lora_targets: str = flag("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "layers")
    # evaluation
    eval_only: bool = flag(False, "evaluate --model (else --server-url's weights) and exit")
    eval_every: int = flag(0, "evaluate every K steps and at the end (0: never)", at_least=0)
    eval_prompts: int = flag(0, "held-out prompts (0: 8; --eval-only: all)", at_least=0)
    eval_n: int = flag(8, "samples per held-out prompt", at_least=1)
    pass_k: str = flag("", "k of pass@k and maj@k: 1,4,10 (default: 1, 2, 4, ... <= --eval-n)")
    # logging
    wandb: str = flag("", "W&B project to log to as well (needs wandb installed)")
    peak_tflops: float = flag(0.0, "a GPU's dense bf16 TFLOP/s, for MFU (0: PEAK_TFLOPS)")

    def __post_init__(self):
        for f in fields(self):
            least = f.metadata["at_least"]
            if least is not None and getattr(self, f.name) < least:
                raise ValueError(f"{f.name} must be >= {least}")
        if self.prompts_per_step % self.micro_batches:
            raise ValueError("prompts_per_step must be divisible by micro_batches")
        if self.chat_template and not os.path.exists(self.chat_template):
            raise ValueError(f"no chat template file {self.chat_template}")
        if self.resume and not os.path.exists(state_path(self.resume)):
            raise ValueError(f"--resume {self.resume}: no {state_path(self.resume)}")
        if model_error(self.model):
            raise ValueError(model_error(self.model))
        if self.pass_k and not re.fullmatch(r"\d+(,\d+)*", self.pass_k):
            raise ValueError(f"--pass-k {self.pass_k}: a list of k, like 1,4,10")
        if not all(1 <= k <= self.eval_n for k in pass_ks(self)):
            raise ValueError(f"--pass-k {self.pass_k}: each k from 1 to --eval-n ({self.eval_n})")
        if self.wandb and not importlib.util.find_spec("wandb"):
            raise ValueError("--wandb: wandb is not installed (pip install wandb)")
        if self.server_url and self.server_args:
            raise ValueError("--server-args is for a server train.py starts")
        # under torchrun, rank r takes GPU r
        if "LOCAL_RANK" in os.environ and self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device} under torchrun: use cuda or cpu")
        Rewards(self)
        if self.resume:
            self.out = self.resume
            self.model = os.path.dirname(state_path(self.resume))
        # a LoRA run's checkpoint is an adapter
        self.lora_rank = self.lora_rank or adapter_config(self.model).get("r", 0)
        # torchrun's
        ranks = int(os.environ.get("WORLD_SIZE", 1))
        alone = (self.resume or self.lora_rank) and ranks > 1
        if self.prompts_per_step // self.micro_batches % ranks or alone:
            raise ValueError(
                "under torchrun each micro-batch's prompts must divide among the ranks, and "
                "--resume and --lora-rank run in one process only (sharded optimizer state)"
            )


def parse_config(argv=None) -> Config:
    """The flags of `argv`, over those of --config's YAML file, over a resumed run's."""
    parser = argparse.ArgumentParser(
        usage="%(prog)s [--config FILE] [--FLAG VALUE ...] (--help lists them)",
        description=__doc__,
        epilog=Config.__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    for f in fields(Config):
        if f.type is bool:
            options = {"action": argparse.BooleanOptionalAction}
        else:
            options = {"type": type(f.default), "choices": f.metadata["choices"]}
        # --reward given again adds functions (parse_flags joins them)
        if f.name == "reward":
            options["action"] = "append"
        # no defaults here: a flag not given is absent (a resumed run's checkpoint has it)
        # (a task may set its own: TASKS' defaults)
        text = f"{f.metadata['help']} (default: {f.default!r})"
        parser.add_argument(as_flag(f.name), default=argparse.SUPPRESS, help=text, **options)
    try:
        given = parse_flags(parser, argv)
        if "config" in given:
            given = parse_flags(parser, config_flags(given.pop("config"))) | given
        settings = resumed_settings(given, parser)
        # the task's own defaults, where neither a flag nor the resumed run sets them
        return Config(**TASKS[settings.get("task", Config.task)].defaults | settings)
    except (ValueError, OSError, yaml.YAMLError) as e:
        parser.error(str(e))


def parse_flags(parser, argv) -> dict:
    """{name: value} of the flags in `argv`; those of --reward as one comma list."""
    given = vars(parser.parse_args(argv))
    if "reward" in given:
        given["reward"] = ",".join(given["reward"])
    return given


def config_flags(path) -> list[str]:
    """The flags that a YAML file's mapping of flag names sets (`max_staleness: 1`, a list as a
    comma list); a name that is no flag is a ValueError naming the nearest one."""
    # a missing file, or YAML that does not parse, names the file (parse_config)
    with open(path) as f:
        settings = yaml.safe_load(f) or {}
    if not isinstance(settings, dict):
        raise ValueError(f"--config {path}: not a mapping of flag names to values (`lr: 1e-5`)")
    names = [f.name for f in fields(Config)]
    argv = []
    for name, value in settings.items():
        if name not in names:
            nearest = difflib.get_close_matches(name, names, n=1, cutoff=0)[0]
            raise ValueError(f"{path}: {name} is no flag (the nearest: {nearest}; TRL's: README)")
        # an empty value (`eval_dataset:`) leaves the flag as it is
        if value is None:
            continue
        # true and false as --flag and --no-flag, a list as a comma list; a value as one word, as
        # it may begin with "--" (server_args)
        value = ",".join(map(str, value)) if isinstance(value, list) else value
        option = as_flag(name if value is not False else "no_" + name)
        argv.append(option if isinstance(value, bool) else f"{option}={value}")
    return argv


def as_flag(name):
    return "--" + name.replace("_", "-")


# what the queued steps of a checkpoint and its data order are made of: a resume keeps them
DATA_ORDER = ("dataset", "task", "reward", "prompts_per_step", "micro_batches", "group_size")


def resumed_settings(given, parser):
    """The flags `given`; with --resume, every other one from the run's OUT/config.yaml, each given
    one that differs printed, and each restored one that names code or a model (a checkpoint is
    trusted like code). A change of DATA_ORDER's is a ValueError."""
    if "resume" not in given or not os.path.exists(state_path(given["resume"])):
        return given
    saved = parse_flags(parser, config_flags(os.path.join(given["resume"], "config.yaml")))
    for name, value in given.items():
        # --lr: start_run says it, against the optimizer's own
        if name not in saved or saved[name] == value or name in ("resume", "lr"):
            continue
        if name in DATA_ORDER:
            raise ValueError(
                f"--resume: {as_flag(name)} {value} is not the run's {saved[name]!r}: its queued "
                "steps and data order are of that one (a new run needs another --out)"
            )
        print(f"{as_flag(name)} {value} from here on (the run's: {saved[name]!r})", file=sys.stderr)
    # the checkpoint is the model: an adapter's names its base
    saved["model"] = base_model(os.path.dirname(state_path(given["resume"])))
    for name in ("model", "reward", "tools", "server_args"):
        if saved.get(name) and name not in given:
            print(f"{as_flag(name)} {saved[name]} (the checkpoint's)", file=sys.stderr)
    return {name: value for name, value in saved.items() if name != "model"} | given


# -- the loop: train() and what it calls, in the order it calls it ---------------------------------
def train(cfg: Config, client: Client, data=None):
    """Run GRPO; `data`: load_data's (training rows, held-out rows), loaded here if not given."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    data, held_out = data or load_data(cfg)
    tok = load_tokenizer(cfg.model, cfg.chat_template)
    # under torchrun its sharded twin: the loop below is the same
    policy_type = ShardedPolicy if dist.is_initialized() else Policy
    policy = policy_type(cfg, (tok, " ".join(rendered_prompt(r, cfg) for r in data[:4])))
    start, queued_rows, history = start_run(cfg, policy.opt, rng, data)
    # the server samples from exactly our weights
    sampler = Sampler(client, cfg, policy.weights(cfg.dtype), queued_rows, start)
    # setup's objects live as long as the run: out of the garbage collector's way (docs/training.md)
    gc.freeze()
    t_run = time.time()
    # metrics, TensorBoard, plot.png (drawn too when the run stops: error, Ctrl-C); with `client`
    # an error aborts the requests generating; a bar where stderr is a terminal, else lines
    with (
        contextlib.closing(RunLog(cfg, history)) as run_log,
        client,
        tqdm(range(start, cfg.steps), desc="GRPO", disable=None) as bar,
        checkpoint_on_stop(cfg, policy, tok, rng, sampler),
    ):
        for step in bar:
            t_step = time.time()
            evaluation = None
            if cfg.eval_every and step % cfg.eval_every == 0:
                # on the weights this step samples; a step that loses the server goes without
                evaluation = sampler.unless_lost(evaluate, client, held_out, cfg)
            # this is where the overlap happens: micro-batches train while the rest still generate
            stats = step_gradient(sampler, policy, tok, measure_all=step == start)
            # the optimizer steps and step s+1+K is queued, together (a stop between leaves none)
            sampler.advance(policy, stats, rng, data, step)
            with timed(stats.sync):
                sampler.unless_lost(sampler.push, policy.weights(cfg.dtype))
            if cfg.save_every and (step + 1) % cfg.save_every == 0:
                save_checkpoint(cfg, policy, tok, step + 1, rng, sampler)
            row = step_metrics(step, stats, cfg, t_step, t_run, evaluation)
            warn(row, cfg, first=step == start)
            run_log.log(row)
            show_progress(bar, row)
        if cfg.eval_every:
            run_log.log_eval(cfg.steps, final_eval(client, held_out, cfg))
    if cfg.checkpoint:
        save_checkpoint(cfg, policy, tok, cfg.steps, rng, sampler)
    finish_run(cfg, sampler.client, history)
    return history


@contextlib.contextmanager
def checkpoint_on_stop(cfg, policy, tok, rng, sampler):
    """A run that stops (an error, Ctrl-C) leaves the checkpoint of its last completed step
    (RunLog draws its plot): `--resume` goes on from there, as the error's note says."""
    try:
        yield
    except BaseException as e:
        # under torchrun the optimizer's state is sharded: a checkpoint there does not resume
        if sampler.next_step is not None and policy.resumable:
            save_checkpoint(cfg, policy, tok, sampler.next_step, rng, sampler)
            e.add_note(
                f"stopped at step {sampler.next_step}; checkpoint in {cfg.out}; "
                f"go on with: python train.py --resume {cfg.out}"
            )
        raise
    finally:
        # train()'s frozen objects, never freed else, not even at exit, where libtriton (which
        # transformers imports) reports the ones it made as leaks (29 lines of nanobind's)
        gc.unfreeze()


@contextlib.contextmanager
def stops_deferred():
    """Ctrl-C and SIGTERM (which __main__ makes a Ctrl-C) wait till the block ends, then stop the
    run: what the block changes is changed whole (Sampler.advance). Python runs signal handlers in
    the main thread only; elsewhere the block just runs."""
    held, stops = [], (signal.SIGINT, signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()
    handlers = [signal.signal(s, lambda s, _: held.append(s)) for s in stops] if main else []
    try:
        yield
    finally:
        for s, handler in zip(stops, handlers):
            signal.signal(s, handler)
    # the first to its own handler again (__main__'s, for both: a KeyboardInterrupt)
    if held:
        signal.raise_signal(held[0])


@dataclass
class QueuedStep:
    """A step's prompts, sampled and not yet trained on; `requests`: submit_rollouts()'s, once
    submitted, to the server at weight `version`."""

    rows: list
    requests: list = None
    version: int = 0


class Sampler:
    """The loop's side of the server: the steps submitted and not yet trained on (oldest first),
    the weights we pushed last and the version the server holds them as; reconnecting to a lost
    server (unless_lost), after which the queued steps are submitted again."""

    def __init__(self, client, cfg, weights, queued_rows, start=0):
        self.client = client
        self.cfg = cfg
        self.weights = weights
        # the step at the head of the queue (None while it and the weights disagree)
        self.next_step = start
        # K + 1 steps queued at most; a checkpoint of a larger K sampled more: they wait here
        queued = min(cfg.max_staleness, cfg.steps - 1 - start) + 1
        self.queue = collections.deque(QueuedStep(rows) for rows in queued_rows[:queued])
        self.sampled = collections.deque(queued_rows[queued:])
        self.connect()

    def connect(self):
        """Set weight sync up, push our weights, and leave the queued steps to be submitted."""
        self.version = first_push(self.client, self.cfg, self.weights)
        for queued in self.queue:
            queued.requests = None

    def unless_lost(self, function, *args):
        """function(*args); None if the server was lost meanwhile (then reconnected)."""
        try:
            return function(*args)
        except (ConnectionError, ServerError) as e:
            if not server_lost(e):
                raise
            self.reconnect(e)

    def reconnect(self, why):
        """Wait for the server (at most --reconnect-timeout s), set weight sync up again and push
        our weights."""
        timeout = self.cfg.reconnect_timeout
        print(f"\nlost the server ({why}); reconnecting for up to {timeout} s", file=sys.stderr)
        self.client.abort_pending()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.connect()
                break
            except (ConnectionError, ServerError) as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not back within {timeout} s: {e}") from None
                # a server still down fails at once, one not ready yet answers 503: every second
                time.sleep(1)
        print(f"reconnected: the server holds our weights as v{self.version}", file=sys.stderr)

    def advance(self, policy, stats, rng, data, step):
        """Step the optimizer on step s's gradient, pop s and queue s+1+K (K = --max-staleness),
        submitted at once for the next version (docs/training.md, "When a step is sampled")."""
        # the weights and the queue disagree until both are done: a stop waits till then, and an
        # error between leaves no checkpoint
        with stops_deferred():
            self.next_step = None
            with timed(stats.train):
                stats.divisor = loss_divisor(stats.samples, self.cfg)
                stats.grad_norm = policy.step(stats.divisor)
            self.queue.popleft()
            if step + 1 + self.cfg.max_staleness < self.cfg.steps:
                # rows sampled already (by a run of a larger K) come first, in their order
                rows = self.sampled.popleft() if self.sampled else None
                self.queue.append(QueuedStep(rows or rng.sample(data, self.cfg.prompts_per_step)))
            # the queue and the weights agree again: a stop from here leaves the checkpoint of s+1
            self.next_step = step + 1
        # submitted before the push it waits for; if the server is lost meanwhile, it is
        # reconnected and the next step submits
        self.unless_lost(self.submit_queued, self.version + 1)

    def submit_queued(self, version):
        """Submit the queued steps not submitted yet, to sample exactly weights `version`: those
        the server holds, or the next, held by the server until our push loads them (no round trip
        between the push and the generation)."""
        for queued in self.queue:
            if queued.requests is None:
                queued.version = version
                queued.requests = submit_rollouts(self.client, queued.rows, self.cfg, version)

    def push(self, weights):
        """Push `weights`, one version more than the server held (else the run stops); a drain
        that outlasts --drain-timeout is no lost server: push_until_done pushes again."""
        self.weights = weights
        pushed = push_until_done(self.client, weights, mode=self.cfg.update_mode)
        if pushed != self.version + 1:
            raise RuntimeError(
                f"one push took the server's weights from version {self.version} to {pushed}: "
                "something else pushes into it, or an update was lost"
            )
        self.version = pushed


def first_push(client, cfg, weights):
    """Set weight sync up and push `weights`: the version the server holds them as."""
    # an adapter goes in an HTTP body: no weight sync to set up
    if not cfg.lora_rank:
        client.init_communicator(host=cfg.trainer_host, device=cfg.device)
    return client.update_model_params(weights)


def step_gradient(sampler, policy, tok, measure_all):
    """Accumulate the oldest queued step's gradient (accumulate_step), starting over if the server
    is lost meanwhile (at most 3 times). Returns its StepStats."""
    for _ in range(3):
        stats = sampler.unless_lost(accumulate_step, sampler, policy, tok, measure_all)
        if stats is not None:
            return stats
        policy.zero_grad()
    raise RuntimeError("the server was lost 3 times during one step")


@contextlib.contextmanager
def timed(intervals):
    """Append the block's [start, end] (time.time()) to `intervals`: where a step's time went."""
    start = time.time()
    yield
    intervals.append([start, time.time()])


@dataclass
class StepStats:
    """A step's record for step_metrics: its rows, samples, each micro-batch's Backward, FLOPs, the
    gradient's norm, and its phases' [start, end] times: generating, training, pushing."""

    rows: list
    # the version of our weights that the step trains
    version: int
    samples: list = field(default_factory=list)
    backwards: list = field(default_factory=list)
    # (computed, useful): backward_flops'
    flops: torch.Tensor = 0
    # what the step's summed gradient was divided by (loss_divisor), and then its norm
    divisor: int = 0
    grad_norm: float = 0.0
    gen: list = field(default_factory=list)
    train: list = field(default_factory=list)
    sync: list = field(default_factory=list)


def accumulate_step(sampler, policy, tok, measure_all):
    """Collect the oldest queued step's samples and accumulate each micro-batch's gradient as it
    lands, its versions checked; with `measure_all` the mismatch is measured on every sample."""
    cfg = sampler.cfg
    # steps 0..K at the start, and the steps a lost server held (Sampler.advance)
    sampler.submit_queued(sampler.version)
    queued = sampler.queue[0]
    stats = StepStats(queued.rows, sampler.version)
    rewards = Rewards(cfg)
    # outputs: [prompt][G] Completion or Episode
    for rows, outputs, times in collect(sampler.client, queued.rows, queued.requests, cfg):
        stats.gen.append([min(t["started"] for t in times), max(t["finished"] for t in times)])
        # the trainer waited for this micro-batch until now
        with timed(stats.train):
            # B = prompts * G
            samples = []
            for row, group in zip(rows, outputs):
                samples += [to_sample(row, output, rewards) for output in group]
            # the step was submitted that many pushes ago
            check_versions(sampler, samples, stats.version - queued.version)
            totals = torch.tensor([s.reward for s in samples]).view(len(rows), cfg.group_size)
            # (B,) within whole groups, before any split
            advantages = group_advantages(totals, cfg.scale_rewards).flatten()
            stats.samples += samples
            stats.backwards.append(
                policy.backward(samples, advantages, stats.version, tok.pad_token_id, measure_all)
            )
            stats.flops += backward_flops(policy.model, samples, advantages, cfg, measure_all)
    return stats


def check_versions(sampler, samples, staleness):
    """Stop the run unless every token of `samples`, a step submitted `staleness` pushes ago, is
    that many versions behind ours (drain updates), or at most that many (in flight). Versions
    that went back mean a new server: ConnectionError, and the loop reconnects."""
    version = sampler.version
    min_lag = staleness if sampler.cfg.update_mode == "drain" else 0
    versions = {v for sample in samples for v in sample.versions}
    if version - staleness <= min(versions) and max(versions) <= version - min_lag:
        return
    # versions start again at 0 in a new server
    if sampler.client.health()["version"] < version:
        raise ConnectionError(f"the server restarted: its weight version went back from {version}")
    raise RuntimeError(
        f"sample versions {sorted(versions)} at trainer version {version}: the schedule "
        f"promises {min_lag} to {staleness} behind"
    )


# -- the schedules: submit_rollouts() sends a step's prompts, collect() hands them over ------------
def episode_tools(cfg) -> list[str]:
    """The server tools the episodes may call: --tools, else the task's (calculator: calc)."""
    return cfg.tools.split(",") if cfg.tools else list(TASKS[cfg.task].tools)


def submit_prompts(client, rows, cfg, **sampling):
    """Each row's prompt its own request: completions, or with episode_tools multi-turn tool
    episodes. Their RemoteFutures, in the rows' order."""
    tools = episode_tools(cfg)
    # rendered by the chat template (rendered_prompt), with the tools' schemas from the server
    chat = cfg.system_prompt or any(isinstance(row["prompt"], list) for row in rows)
    schemas = chat_tools(client, tools) if chat else None
    prompts = [rendered_prompt(row, cfg, schemas, tokenize=True) for row in rows]
    if not tools:
        # all in one call: the engine decodes one big batch
        return client.submit_each(prompts, **sampling)
    # the tokens after the prompt, sampled and tool output: --max-tokens a turn, 16 for the tool
    episode_tokens = cfg.max_turns * (cfg.max_tokens + 16)
    episode = dict(tools=tools, max_turns=cfg.max_turns, max_episode_tokens=episode_tokens)
    # a chat model reads each tool's answer as its template's `tool` message
    if chat:
        episode["result_format"] = tool_message_format(cfg)
    return [client.rollout([prompt], is_async=True, **episode, **sampling) for prompt in prompts]


def submit_rollouts(client, rows, cfg, version):
    """Send a step's prompts at once, a request each, to start on weights `version` alone (the
    server holds them until it loads those): their RemoteFutures, in the rows' order."""
    sampling = dict(n=cfg.group_size, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    # on weights `version` alone; a queued step's results wait on the server, however long the
    # steps before it train
    sampling |= dict(min_version=version, max_version=version, keep_result=True)
    if cfg.seed_requests:
        # a function of the step's rows: the same prompts get the same seed, whenever they are sent
        sampling["seed"] = cfg.seed + zlib.crc32(json.dumps(rows).encode())
    return submit_prompts(client, rows, cfg, **sampling)


def collect(client, rows, futures, cfg):
    """Yield the step's micro-batches, (rows, samples [prompt][G], server timings), in the order the
    schedule hands them over, whole groups each: any order, one gradient (docs/training.md)."""
    size = len(rows) // cfg.micro_batches
    if cfg.schedule == "sync-batch":
        # wait for the whole step, then train on its slices
        results = collect_each(futures)
        for i in range(0, len(rows), size):
            part = slice(i, i + size)
            yield rows[part], results[part], [future.timing for future in futures[part]]
        return
    # the overlap: hand the trainer each next `size` prompts' groups in the order they finish,
    # while the rest are still decoding; rollout lengths are long-tailed, so most finish early
    row_of = {future.request_id: row for row, future in zip(rows, futures)}
    done = []
    for future, [group] in client.as_completed(futures):
        done.append((row_of[future.request_id], group, future.timing))
        if len(done) == size:
            yield [r for r, _, _ in done], [g for _, g, _ in done], [t for _, _, t in done]
            done = []


# -- a micro-batch's samples, their advantages and the policy gradient -----------------------------
@dataclass
class Sample:
    """One sample as the trainer reads it: token ids (the prompt's as the server tokenised it), loss
    mask (1 = sampled by the model), behaviour logprobs (None where not sampled), the weight
    version of each token, its reward (the sum) and each function's, and whether --max-tokens cut
    it."""

    ids: list
    mask: list
    logprobs: list
    versions: list
    reward: float = 0.0
    rewards: list = ()
    truncated: bool = False
    # tool calls of an episode, and those answered with an error
    tool_calls: int = 0
    tool_errors: int = 0

    def sampled(self, values):
        """Those of per-token `values` at the tokens the model sampled."""
        return [value for value, m in zip(values, self.mask) if m]


def to_sample(row, output, rewards) -> Sample:
    """A server output of `row`, a Completion or a tool Episode (its loss mask, its tool calls), as
    the Sample the trainer reads."""
    # Client.session's episode is None when the calls do not continue one another token for token
    if output is None:
        raise ValueError("no episode (None): the session's calls did not merge (see its 'reason')")
    if not isinstance(output, Episode):
        # a Completion as an episode of one turn, built as RolloutEngine.episode builds each turn
        completion, output = output, Episode(finish_reason=output.finish_reason, versions=[])
        output.append(completion.prompt_token_ids, None)
        output.append(completion.token_ids, completion.logprobs, completion.versions)
        output.turns.append(dict(text=completion.text, version=completion.version))
    # an episode merged from a session has no spans: its first turn's version
    spans = output.versions or [[output.turns[0]["version"], 0]]
    return Sample(
        ids=output.token_ids,
        mask=output.loss_mask,
        logprobs=output.logprobs,
        versions=per_token(spans, len(output.token_ids)),
        **rewards(output.turns[-1]["text"], row),
        truncated=output.finish_reason == "length",
        tool_calls=len(output.tool_calls),
        tool_errors=sum(call["result"].startswith("error") for call in output.tool_calls),
    )


def per_token(spans, length):
    """The version of each of `length` tokens, from [[version, first token]] spans (tokens before
    the first span, a prompt's, never trained on, take its version)."""
    starts = [0] + [start for _, start in spans[1:]] + [length]
    versions = []
    for (version, _), start, end in zip(spans, starts, starts[1:]):
        versions += [version] * (end - start)
    return versions


def group_advantages(rewards: torch.Tensor, scale="group") -> torch.Tensor:
    """(prompts, G) rewards -> advantages: minus the group's mean, over the std of `scale` (TRL's
    scale_rewards: "group", "batch" of the micro-batch's groups, "none")."""
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages /= rewards.std(dim=1, keepdim=True) + 1e-4
    elif scale == "batch":
        advantages /= rewards.std() + 1e-4
    # all equal: exactly 0 (the mean of eight 1/3s would leave ~3e-4), so `backward` skips them
    return torch.where((rewards == rewards[:, :1]).all(dim=1, keepdim=True), 0.0, advantages)


class Policy:
    """The model trained and its optimizer, in one process: a micro-batch's backward, the optimizer
    step, the weights to push, the state to save. ShardedPolicy is its torchrun twin; LoRA is
    load_policy's."""

    # the ranks whose gradients FSDP averages; sharded optimizer state does not resume
    ranks = 1
    resumable = True

    def __init__(self, cfg, probe=None):
        """The policy in float32 on --device; `probe`: (tokenizer, text) for check_logprobs."""
        self.cfg = cfg
        self.model = load_policy(cfg)
        if probe:
            check_logprobs(self.model, *probe)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            # transformers checkpoints only in training mode; the models we train have no dropout
            self.model.train()
        self.shard()
        # with --lora-rank, the adapter's parameters alone
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=0.0)

    def shard(self):
        """One process: nothing to shard."""

    def backward(self, samples, advantages, version, pad_id, measure_all) -> "Backward":
        """backward() of the whole micro-batch."""
        return backward(self.model, samples, advantages, version, self.cfg, pad_id, measure_all)

    def step(self, divisor) -> float:
        """Normalise the step's summed gradient, clip it and step the optimizer: the norm."""
        # the loss normalisation: divide the summed gradient by the step's loss_divisor (dapo:
        # every completion token; under torchrun FSDP has averaged the ranks' gradients: / ranks)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad /= max(divisor, 1) / self.ranks
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm.item()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def weights(self, dtype=""):
        """{name: tensor} to push and save: the model's own parameters, no copy (`dtype` is for
        the sharded twin); a peft model itself, whose adapter Client.update_model_params pushes."""
        if self.cfg.lora_rank:
            return self.model
        return {name: p.detach() for name, p in self.model.named_parameters()}


class Backward(collections.namedtuple("Backward", ["is_weights", "deltas", "loss"])):
    """What a backward leaves for the metrics: the stale tokens' importance weights, trainer minus
    server logprobs of the measured tokens the current weights sampled, the summed loss."""

    @staticmethod
    def joined(results) -> "Backward":
        """One Backward of several (forwards, micro-batches, ranks)."""
        # an empty one first: no results (every sample skipped) give empty tensors
        weights, deltas, losses = zip((torch.empty(0), torch.empty(0), 0.0), *results)
        return Backward(torch.cat(weights), torch.cat(deltas), sum(losses))


def backward(model, samples, advantages, version, cfg, pad_id, measure_all=False, skip=True):
    """Accumulate the policy gradient of `samples` on our weights `version`, in the forwards that
    `forwards` plans: their Backward."""
    results = []
    for part, part_advantages, grad in forwards(samples, advantages, cfg, measure_all, skip):
        results.append(chunk_backward(model, part, part_advantages, version, cfg, pad_id, grad))
    return Backward.joined(results)


def forwards(samples, advantages, cfg, measure_all=False, skip=True):
    """Yield backward's forwards as (sequences, their advantages, with gradient), each of at most
    --train-micro-batch sequences and --train-micro-tokens padded tokens (a longer one alone)."""
    # a sample of advantage 0 adds nothing to the gradient: no forward for it, though it counts in
    # the divisor; with `skip` off (torchrun) every rank runs as many passes as the others, FSDP's
    # gathers being collective
    trained = (advantages != 0) | (not skip)
    # with `measure_all`, a forward of the skipped samples too, apart and without gradient: the
    # statistics cover them, and the gradient is the one of the samples trained on, bit for bit
    for chosen, grad in ((trained, True), (~trained & measure_all, False)):
        # longest first: a forward pads its sequences to the longest, so like lengths go together
        index = sorted(chosen.nonzero().flatten().tolist(), key=lambda i: -len(samples[i].ids))
        part = []
        for j in index:
            # a forward of longest-first sequences pads them all to its first one's length
            padded = (len(part) + 1) * len(samples[part[0]].ids) if part else 0
            if part and (len(part) == cfg.train_micro_batch or 0 < cfg.train_micro_tokens < padded):
                yield [samples[i] for i in part], advantages[part], grad
                part = []
            part.append(j)
        if part:
            yield [samples[i] for i in part], advantages[part], grad


def chunk_backward(model, samples, advantages, version, cfg, pad_id, grad=True) -> Backward:
    """One forward of `samples`, and with `grad` backward (gradients accumulate, the step
    normalises them)."""
    ids = [sample.ids for sample in samples]
    masks = [sample.mask for sample in samples]
    old_logprobs = [sample.logprobs for sample in samples]
    batch = make_batch([[]] * len(samples), ids, pad_id, masks, old_logprobs)
    versions = [torch.tensor(sample.versions) for sample in samples]
    # (b, T-1) True where weights older than ours sampled the target token
    stale = pad_sequence(versions, batch_first=True, padding_value=version)[:, 1:] < version
    autocast = torch.autocast(model.device.type, torch.bfloat16, enabled=cfg.bf16)
    with autocast, torch.set_grad_enabled(grad):
        logprobs = token_logprobs(model, batch, cfg.temperature)  # (b, T-1)
    old, sampled = batch["old_logprobs"], batch["mask"] > 0
    loss, w = pg_loss(logprobs, old, advantages, batch["mask"], stale, cfg.is_cap, cfg.loss_type)
    if grad:
        loss.backward()
    # the trainer's logprobs of the fresh sampled tokens against the server's
    deltas = (logprobs.detach() - old)[~stale & sampled]
    return Backward(w[stale & sampled], deltas, loss.item())


def make_batch(prompt_ids, completion_ids, pad_id, loss_masks=None, old_logprobs=None):
    """Right-padded (B, T) input_ids, attention, and a loss mask that is 1 on completion tokens
    (or, for multi-turn episodes, on the tokens the model sampled: `loss_masks`); with
    `old_logprobs` (per token, None where not sampled) also the behaviour logprobs."""
    rows = [p + c for p, c in zip(prompt_ids, completion_ids)]
    masks = loss_masks or [[0] * len(p) + [1] * len(c) for p, c in zip(prompt_ids, completion_ids)]
    T = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad_id] * (T - len(r)) for r in rows])  # (B, T)
    attention = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])  # (B, T)
    mask = torch.tensor([m + [0] * (T - len(m)) for m in masks], dtype=torch.float32)  # (B, T)
    # aligned with the targets
    batch = {"input_ids": input_ids, "attention": attention, "mask": mask[:, 1:]}
    if old_logprobs is not None:
        # (B, T)
        old = torch.tensor([[x or 0.0 for x in lp] + [0.0] * (T - len(lp)) for lp in old_logprobs])
        batch["old_logprobs"] = old[:, 1:]
    return batch


def token_logprobs(model, batch, temperature=1.0, chunk_tokens=2048):
    """(B, T-1): log p(token t+1 | tokens <= t) at the sampling temperature where batch["mask"] is
    set, 0 elsewhere; the output layer by chunks (output_logprobs, docs/training.md)."""
    ids = batch["input_ids"].to(model.device)
    attention = batch["attention"].to(model.device)
    # the model's own forward, so that FSDP's hooks run under torchrun; it makes the logits of one
    # position, the hidden states go through the output layer in chunks below
    hidden = model(
        input_ids=ids, attention_mask=attention, logits_to_keep=1, output_hidden_states=True
    ).hidden_states[-1]
    # the output layer runs only where the loss mask is set: (tokens, H), (tokens,)
    keep = batch["mask"].to(model.device).flatten() > 0
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])[keep]
    targets = ids[:, 1:].reshape(-1)[keep]
    out = output_logprobs(model, hidden, targets, temperature, chunk_tokens)
    # each kept position's logprob in its place, 0 elsewhere
    return out.new_zeros(keep.shape).masked_scatter(keep, out).view(len(ids), -1).cpu()


def output_logprobs(model, hidden, targets, temperature=1.0, chunk_tokens=2048):
    """(tokens,): log p(target) of each (tokens, H) hidden state through the output layer at the
    sampling temperature, `chunk_tokens` at a time, each chunk recomputed in backward."""
    head = model.get_output_embeddings()
    # 0 is greedy: no scaling
    scale = 1 / temperature if temperature > 0 else 1.0

    def chunk_logprobs(h, t):
        # (chunk, V), in bf16 under autocast: log_softmax reads it and writes fp32 in one pass
        logits = postprocess_logits(head(h), model.config, scale)
        return logits.log_softmax(1, dtype=torch.float32).gather(1, t[:, None]).squeeze(1)

    out = []
    for i in range(0, len(targets), chunk_tokens):
        chunk = slice(i, i + chunk_tokens)
        out.append(checkpoint(chunk_logprobs, hidden[chunk], targets[chunk], use_reentrant=False))
    return torch.cat(out)


def postprocess_logits(logits, config, scale=1.0):
    """What a family's `forward` does to the output layer's logits (soft-capping, scaling), as vLLM
    does, times `scale` (1 / temperature); `logits` themselves where there is nothing to apply.
    Which families and why: docs/training.md."""
    config = config.get_text_config()
    cap = getattr(config, "final_logit_softcapping", None)
    scale *= (getattr(config, "logit_scale", None) or 1.0) / getattr(config, "logits_scaling", 1.0)
    if not cap and scale == 1:
        return logits
    if cap:
        logits = torch.tanh(logits.float() / cap) * cap
    return logits.float() * scale


def pg_loss(logprobs, old_logprobs, advantages, mask, stale, is_cap=2.0, loss_type="dapo"):
    """The policy-gradient loss -w * A * log p(token), summed over the `mask`ed tokens, and w: 1
    on-policy, truncated importance sampling min(p / p_old, is_cap) on `stale` tokens, without
    gradient (docs/training.md). The caller divides the step's sum by loss_divisor."""
    ratio = torch.exp(logprobs.detach() - old_logprobs).clamp(max=is_cap)
    w = torch.where(stale, ratio, torch.ones_like(ratio))
    if loss_type == "grpo":
        # each sequence's mean over its own tokens: loss_divisor then counts sequences
        mask = mask / mask.sum(1, keepdim=True).clamp(min=1)
    return -(w * advantages[:, None] * logprobs * mask).sum(), w


def loss_divisor(samples, cfg):
    """The share of `samples` in what the step's summed loss is divided by (TRL's loss_type): dapo,
    their completion tokens; grpo, their number (pg_loss took each one's mean); dr_grpo, a
    constant: their number x --max-tokens."""
    if cfg.loss_type == "dapo":
        return sum(sum(sample.mask[1:]) for sample in samples)
    return len(samples) * (cfg.max_tokens if cfg.loss_type == "dr_grpo" else 1)


# -- after each step: metrics (plot.py's RunLog records them) --------------------------------------
def step_metrics(step, stats, cfg, t_step, t_run, evaluation=None):
    """One row of metrics.jsonl, from the step's StepStats; its times and speed: docs/training.md,
    "A step's time"."""
    train_s = sum(b - a for a, b in stats.train)
    sync_s = stats.sync[0][1] - stats.sync[0][0]
    step_s = time.time() - t_step
    joined = Backward.joined(stats.backwards)
    # no stale samples: weight 1, none clipped
    w = joined.is_weights if len(joined.is_weights) else torch.ones(1)
    row = {
        "step": step,
        **sample_metrics(stats.samples, cfg, stats.version),
        # what the gradient is of: the summed loss over the step's loss_divisor
        "loss": joined.loss / max(stats.divisor, 1),
        "version": stats.version,
        # which prompts the step trained on, in a number: runs compare their steps by it
        "prompts_crc32": zlib.crc32(json.dumps([r["prompt"] for r in stats.rows]).encode()),
        "schedule": cfg.schedule,
        "grad_norm": stats.grad_norm,
        "gen_s": max(b for _, b in stats.gen) - min(a for a, _ in stats.gen),
        "train_s": train_s,
        "sync_s": sync_s,
        "idle_s": step_s - train_s - sync_s,
        "step_s": step_s,
        **speed_metrics(stats.flops, train_s, cfg),
        "is_weight_mean": w.mean().item(),
        "is_weight_max": w.max().item(),
        "is_clipped": (w >= cfg.is_cap).float().mean().item() if len(joined.is_weights) else 0.0,
        **mismatch_metrics(joined.deltas),
        "intervals": {
            k: [[round(a - t_run, 4), round(b - t_run, 4)] for a, b in getattr(stats, k)]
            for k in ("gen", "train", "sync")
        },
    }
    if evaluation:
        row["eval"] = evaluation  # on the weights this step sampled from
    return row


def sample_metrics(samples, cfg, version):
    """What a step's `samples` say, trained on our weights `version`: rewards, lengths, tool calls,
    the entropy of the sampled tokens, how stale they are."""
    groups = torch.tensor([s.reward for s in samples]).view(-1, cfg.group_size)
    # per sample: the tokens it sampled
    lengths = torch.tensor([sum(s.mask) for s in samples]).float()
    # the server's logprobs of the sampled tokens: minus their mean estimates the entropy
    sampled = torch.tensor([lp for s in samples for lp in s.sampled(s.logprobs)])
    # how many versions behind ours the weights that sampled each completion token are
    staleness = torch.tensor([version - v for s in samples for v in s.sampled(s.versions)])
    return {
        "reward": groups.mean().item(),
        "accuracy": (groups >= cfg.success_threshold).float().mean().item(),
        # of the sampled tokens, estimated by them: mean -log p
        "entropy": -sampled.mean().item(),
        "completion_length": lengths.mean().item(),
        "completion_length_max": int(lengths.max()),
        # the share of samples that --max-tokens cut
        "truncated": torch.tensor([s.truncated for s in samples]).float().mean().item(),
        # the share of samples that called a tool; their tool calls, those that answered an error
        "tool_share": torch.tensor([s.tool_calls > 0 for s in samples]).float().mean().item(),
        "tool_calls": sum(s.tool_calls for s in samples),
        "tool_errors": sum(s.tool_errors for s in samples),
        # TRL's name: the groups skipped by backward, all rewards equal
        "frac_reward_zero_std": (groups == groups[:, :1]).all(1).float().mean().item(),
        "tokens": int(lengths.sum()),
        "staleness": staleness.float().mean().item(),
        "staleness_max": int(staleness.max()),
        # (B, functions): NaN where a function does not apply
        **reward_metrics(Rewards(cfg).names, torch.tensor([s.rewards for s in samples])),
    }


def reward_metrics(names, each_reward):
    """reward/<name>: each reward function's mean over the samples it applies to (TRL's), of
    `each_reward` (samples, functions), NaN where one does not apply; None where none does."""
    means = each_reward.nanmean(dim=0).tolist()
    return {f"reward/{name}": None if math.isnan(m) else m for name, m in zip(names, means)}


# dense bf16 TFLOP/s by CUDA device name (the vendors' figures): the first key the name contains
PEAK_TFLOPS = {"H200": 989, "H100 PCIe": 756, "H100": 989, "A100": 312}


def speed_metrics(flops, train_s, cfg):
    """The training phase's TFLOP/s, computed (padding included) and useful, and its MFU: the
    computed ones' share of the devices' peak (--peak-tflops, else PEAK_TFLOPS's; None on a CPU)."""
    computed, useful = (flops / max(train_s, 1e-9) / 1e12).tolist()
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    peak = cfg.peak_tflops
    if not peak and cfg.device.startswith("cuda"):
        name = torch.cuda.get_device_name(cfg.device)
        peak = next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), 0)
    mfu = computed / (peak * ranks) if peak else None
    return {"tflops": computed, "tflops_useful": useful, "mfu": mfu}


def backward_flops(model, samples, advantages, cfg, measure_all=False):
    """The FLOPs of backward's forwards and backwards of `samples` (one process's: `forwards`),
    computed (each forward's rows padded to its longest) and useful (the sequences' own)."""
    flops = torch.zeros(2, dtype=torch.float64)
    for part, _, grad in forwards(samples, advantages, cfg, measure_all):
        lengths = [len(sample.ids) for sample in part]
        # the output layer runs at the positions that predict a sampled token
        head_tokens = sum(sum(sample.mask[1:]) for sample in part)
        recompute = grad and model.is_gradient_checkpointing
        for i, shape in enumerate(([max(lengths)] * len(lengths), lengths)):
            flops[i] += train_flops(model, shape, head_tokens, grad, recompute)
    return flops


def train_flops(model, lengths, head_tokens, grad=True, recompute=False):
    """The matmul FLOPs of a forward (with `grad` and backward; with `recompute` a second forward)
    of sequences of `lengths` tokens, the output layer at `head_tokens` positions."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # the decoder's matmuls: every 2-D weight but the embeddings (the output layer counts below)
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    n = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings)
    # PaLM's count (appendix B) per token of a sequence of length T and per pass: 2 FLOPs a
    # parameter, 4 * layers * heads * head_dim * T for attention (scores, their sum of values); a
    # forward is 1 pass, backward 2 (6N + 12LHQT for training), a recomputed forward 1 (x 4/3); the
    # output layer, 2 * hidden * vocab a token, is always recomputed (token_logprobs)
    attention = 4 * config.num_hidden_layers * heads * head_dim
    decoder = sum(T * (2 * n + attention * T) for T in lengths) * (1 + (2 + recompute) * grad)
    return decoder + 2 * config.hidden_size * config.vocab_size * head_tokens * (1 + 3 * grad)


def mismatch_metrics(deltas):
    """mismatch_mean, _max and _kl (the k3 estimate of KL(server || trainer)) of `deltas`, trainer
    minus server logprob of each token measured; None when there is none (docs/training.md)."""
    counted = {"mismatch_tokens": len(deltas)}
    if not len(deltas):
        return counted | dict.fromkeys(("mismatch_mean", "mismatch_max", "mismatch_kl"))
    # float64 and expm1: for |d| ~ 1e-6, exp(d) - 1 - d in float32 rounds to a negative KL
    d = deltas.double()
    return counted | {
        "mismatch_mean": d.abs().mean().item(),
        "mismatch_max": d.abs().max().item(),
        "mismatch_kl": (torch.expm1(d) - d).mean().item(),
    }


def warn(row, cfg, first):
    """Loud warnings about a step (`row`'s): at this process's `first` (a resumed run's too), if
    the trainer and the server disagree on the sampled tokens' logprobs by more than
    --mismatch-warning on average, or if --max-tokens cut every completion; at any step, if most of
    its tool calls failed."""
    if first and (row["mismatch_mean"] or 0.0) > cfg.mismatch_warning:
        print(
            f"\nWARNING: the trainer's logprobs of the sampled tokens differ from the server's by "
            f"{row['mismatch_mean']:.3g} on average (max {row['mismatch_max']:.3g}), above "
            f"--mismatch-warning {cfg.mismatch_warning}. Usual causes: another tokenizer or chat "
            f"template on the two sides, the served --dtype, the family's logit post-processing.\n",
            file=sys.stderr,
        )
    if first and row["truncated"] == 1:
        warning = f"every completion of step {row['step']} hit --max-tokens {cfg.max_tokens}"
        print(f"\nWARNING: {warning}: raise it\n", file=sys.stderr)
    if row["tool_errors"] > row["tool_calls"] / 2:
        warning = f"{row['tool_errors']} of the step's {row['tool_calls']} tool calls failed"
        print(f"\nWARNING: {warning}", file=sys.stderr)


def show_progress(bar, row):
    """The step's reward, accuracy, seconds and TFLOP/s (MFU where the peak is known) on the bar,
    or where it is off (stderr is no terminal) in a line."""
    progress = {key: f"{row[key]:.2f}" for key in ("reward", "accuracy", "step_s", "tflops")}
    # several rewards: each one's mean beside the sum
    each = {k: f"{v:.2f}" for k, v in row.items() if k.startswith("reward/") and v is not None}
    progress |= each if len(each) > 1 else {}
    if row["mfu"] is not None:
        progress["mfu"] = f"{row['mfu']:.3f}"
    bar.set_postfix(progress)
    if bar.disable:
        print(f"step {row['step']}: " + " ".join(f"{k} {v}" for k, v in progress.items()))


def finish_run(cfg, client, history):
    """After the last step: close weight sync, and print how reward and accuracy moved."""
    client.close_communicator()
    for key in ("reward", "accuracy"):
        first = mean(h[key] for h in history[:5])
        last = mean(h[key] for h in history[-5:])
        print(f"{key}: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    print(f"outputs in {cfg.out}")


# -- the model: the policy and its optimizer, its weights for the server, the built-in one ---------
def load_policy(cfg):
    """--model to train or evaluate on --device; with --lora-rank wrapped by peft, with the
    adapter of --model if it is one, else a new one (lora_B = 0: the model's own outputs)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = load_model(base_model(cfg.model), cfg.device)
    if not cfg.lora_rank:
        return model
    if adapter_config(cfg.model):
        return PeftModel.from_pretrained(model, cfg.model, is_trainable=True)
    alpha = cfg.lora_alpha or 2 * cfg.lora_rank
    targets = cfg.lora_targets.split(",")
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=alpha, target_modules=targets)
    return get_peft_model(model, config)


def adapter_config(path) -> dict:
    """The adapter_config.json of a LoRA adapter's folder (a --lora-rank run's checkpoint), or
    {}."""
    file = Path(path, "adapter_config.json")
    return json.loads(file.read_text()) if file.exists() else {}


def base_model(path):
    """The model folder (or hub id) `path` is, or that the adapter in `path` was trained on."""
    return adapter_config(path).get("base_model_name_or_path", path)


def load_model(path, device="cpu"):
    """The model to train, in float32. transformers' default attention (sdpa) ignores Gemma-2's
    attention logit soft-capping, which vLLM applies: such a model gets eager attention."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    # On a GPU, PyTorch's attention takes cuDNN's kernel where it can (Hopper), which builds a plan
    # for every new shape, ~2 ms a layer call on the CPU, more than the kernel takes; a run's
    # micro-batches are each of a new length. Off, as vLLM turns it off in every process that
    # imports it (TRL's trainer among them): the other kernels need no plan.
    torch.backends.cuda.enable_cudnn_sdp(False)
    # a training forward needs no KV cache: transformers would copy every layer's keys and values
    # into one (without gradient checkpointing, which turns it off), and torch.compile would guard
    # on each layer's slot of it
    model.config.get_text_config().use_cache = False
    if getattr(model.config.get_text_config(), "attn_logit_softcapping", None):
        model.set_attn_implementation("eager")
    return model


def check_logprobs(model, tok, text, atol=1e-3):
    """Refuse to train unless token_logprobs equals log_softmax of the model's own `forward` on
    `text`, up to `atol` (else it would train on another distribution than the server's).
    Returns the largest difference."""
    batch = make_batch([[]], [tok(text).input_ids], pad_id=0)
    with torch.no_grad():
        ours = token_logprobs(model, batch)
        logits = model(input_ids=batch["input_ids"].to(model.device)).logits[:, :-1].float()
    theirs = logits.cpu().log_softmax(-1).gather(2, batch["input_ids"][:, 1:, None]).squeeze(-1)
    difference = (ours - theirs).abs().max().item()
    # written so that NaN fails too
    if not difference <= atol:
        raise RuntimeError(
            f"train.token_logprobs differs from {type(model).__name__}.forward by up to "
            f"{difference:.3g} (logprob) on a probe: the family {model.config.model_type!r} "
            f"post-processes its logits in a way train.postprocess_logits does not apply, so "
            f"training would follow another distribution than the server's. Teach it there."
        )
    return difference


def builtin_model(cfg):
    """The built-in model: local.tiny_model of --model-size (seeded, nothing downloaded),
    warm-started on --task (warm_start); both built once, in .cache/. Its folder."""
    path = warm_start(*builtin_folders(cfg), cfg)
    # what a warm start on the GPU left in PyTorch's cache, back to the GPU: a server is started
    # there next, and vLLM refuses to start with less free memory than its share
    torch.cuda.empty_cache()
    return path


def builtin_folders(cfg):
    """(the built-in model's folder, built here if absent; its warm start's, maybe not built)."""
    size = "" if cfg.model_size == "tiny" else f"-{cfg.model_size}"
    base = tiny_model(TINY_MODEL_DIR + size, **SHAPES[cfg.model_size])
    return base, f"{base}-{cfg.task}-{cfg.warm_start_steps}"


def warm_start(base, path, cfg, each=None):
    """--warm-start-steps supervised steps of 64 of the task's warm_start_data rows on --device: a
    row's "solution" where it has one (sums), else the answer format with a random number
    (addition); docs/training.md says why. `each(step, model, tok)` after every step
    (bench/warm_start.py's milestones)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model = load_model(base, cfg.device)
    tok = AutoTokenizer.from_pretrained(base)
    chat = replace(cfg, model=base)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3 if cfg.model_size == "tiny" else 3e-4)
    for step in tqdm(range(1, cfg.warm_start_steps + 1), desc=f"warm start on {cfg.task}"):
        rows = TASKS[cfg.task].warm_start_data(64, rng.random())
        # addition: any sum 0..8
        answers = [r.get("solution") or str(rng.randrange(9)) for r in rows]
        batch = warm_start_batch(rows, answers, tok, chat)
        with torch.autocast(model.device.type, torch.bfloat16, enabled=cfg.bf16):
            logprobs = token_logprobs(model, batch)
        loss = -(logprobs * batch["mask"]).sum() / batch["mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if each:
            each(step, model, tok)
    save_model(model.cpu(), tok, path)
    return path


def warm_start_batch(rows, answers, tok, cfg):
    """The warm start's batch of `rows` and their `answers`: each prompt as the server is sent it
    (a conversational row rendered by the chat template of cfg.model), then its answer and
    end-of-text, the answer's tokens the ones trained on."""
    prompt_ids = [tok(rendered_prompt(row, cfg)).input_ids for row in rows]
    answer_ids = [tok(answer).input_ids + [tok.eos_token_id] for answer in answers]
    return make_batch(prompt_ids, answer_ids, tok.pad_token_id)


# -- the data: --dataset's rows, or the task's (tasks.py) ------------------------------------------
def load_data(cfg):
    """(training rows, held-out rows): --eval-dataset's, else the first --eval-prompts distinct
    prompts are held out (when evaluating), and no training row has one of their prompts."""
    data = read_dataset(cfg.dataset, cfg) if cfg.dataset else TASKS[cfg.task].data(10**5, cfg.seed)
    # --eval-only scores every prompt of --dataset, unless --eval-prompts says otherwise
    count = cfg.eval_prompts or (None if cfg.eval_only and cfg.dataset else 8)
    held_out = []
    if cfg.eval_dataset and (cfg.eval_every or cfg.eval_only):
        held_out = read_dataset(cfg.eval_dataset, cfg)[:count]
    elif cfg.eval_every or cfg.eval_only:
        # a prompt by its JSON: a conversational one is a list
        held_out = list({json.dumps(r["prompt"]): r for r in data}.values())[:count]
        prompts = {json.dumps(r["prompt"]) for r in held_out}
        data = [r for r in data if json.dumps(r["prompt"]) not in prompts]
    # a step samples --prompts-per-step distinct rows
    if len(data) < cfg.prompts_per_step and not cfg.eval_only:
        raise ValueError(f"{len(data)} training rows: fewer than --prompts-per-step, a step's")
    return data, held_out


def read_dataset(name, cfg):
    """The rows of --dataset `name` (load_rows), --prompt-column and --answer-column as "prompt" and
    "answer" beside the others, every one checked before anything is generated (check_row).
    Raises ValueError naming the bad rows by index."""
    try:
        loaded = load_rows(name, cfg)
    except Exception as e:
        # a file that does not parse, a hub name not found: what the datasets library says
        raise ValueError(f"{name}: {e.__cause__ or e}") from e
    # a row without a task is of the dataset named
    task = os.path.splitext(os.path.basename(os.path.normpath(name)))[0]
    if loaded and cfg.prompt_column not in loaded[0]:
        raise ValueError(f"{name}: no {cfg.prompt_column!r} in {list(loaded[0])}: --prompt-column")
    rows, errors, rewards = [], [], Rewards(cfg)
    for index, row in enumerate(loaded):
        # whatever the row or the reward raises is that row's error
        try:
            row = row | {"prompt": row[cfg.prompt_column], "task": str(row.get("task") or task)}
            if cfg.answer_column in row:
                row["answer"] = row[cfg.answer_column]
            check_row(row, rewards)
            rows.append(row)
        except Exception as e:
            errors.append(f"row {index}: {type(e).__name__}: {e}")
    if errors or not rows:
        shown = "; ".join(errors[:5]) or "no rows"
        raise ValueError(f"{name}: {len(errors)} bad rows of {len(loaded)}: {shown}")
    return rows


# -- conversational rows: messages rendered by the chat template, on the trainer's side ------------
@functools.cache
def load_tokenizer(model, chat_template=""):
    """--model's tokenizer; its chat template --chat-template's file, if given."""
    tok = AutoTokenizer.from_pretrained(model)
    # padding is masked out wherever it goes: a tokenizer without a pad token (Llama 3's) pads
    # with its end of text
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if chat_template:
        tok.chat_template = Path(chat_template).read_text()
    return tok


def rendered_prompt(row, cfg, tools=None, tokenize=False):
    """The row's prompt as the model sees it: a string as it is; a list of messages (TRL's
    conversational format) rendered by the chat template with `tools` (OpenAI schemas) and the
    assistant's turn opened, --system-prompt first where it has no system message (with it, a
    string is the user's message). With `tokenize`, a rendered one's token ids: the server gets
    those, and samples after exactly the tokens the trainer scores."""
    messages = row["prompt"]
    if isinstance(messages, str) and not cfg.system_prompt:
        return messages
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if cfg.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
    tok = load_tokenizer(cfg.model, cfg.chat_template)
    if not tok.chat_template:
        raise ValueError(f"{cfg.model} has no chat template: give one with --chat-template FILE")
    # tokenised, the template's special tokens (a BOS among them) are the template's alone
    options = dict(tools=tools, tokenize=tokenize, return_dict=False, add_generation_prompt=True)
    return tok.apply_chat_template(messages, **options)


def chat_tools(client, names):
    """The tools `names` (episode_tools) as OpenAI schemas, for the chat template (or None)."""
    return [s for s in client.tools() if s["function"]["name"] in names] if names else None


def tool_message_format(cfg) -> str:
    """What the chat template writes after an assistant turn that calls a tool, up to the next
    assistant turn's start, {} where the tool's answer goes: /rollout's `result_format`."""
    call, answer = "\x00call\x00", "\x00answer\x00"
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": call}]
    messages.append({"role": "tool", "content": answer})
    return rendered_prompt({"prompt": messages}, cfg).rpartition(call)[2].replace(answer, "{}")


# --dataset's files by suffix, and the loader of the datasets library that reads each
LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_rows(name, cfg) -> list[dict]:
    """The rows of a file (LOADERS), a folder of datasets.Dataset.save_to_disk, or a hub dataset
    NAME[:CONFIG] (its --dataset-split), read by the datasets library."""
    import datasets

    if os.path.isdir(name):
        data = datasets.load_from_disk(name)
    elif name.endswith(tuple(LOADERS)):
        data = datasets.load_dataset(LOADERS[Path(name).suffix], data_files=name, split="train")
    else:
        path, _, config = name.partition(":")
        data = datasets.load_dataset(path, config or None, split=cfg.dataset_split)
    # a folder of several splits
    if isinstance(data, datasets.DatasetDict):
        data = data[cfg.dataset_split]
    return data.to_list()


def check_row(row, rewards):
    """Raise ValueError unless the row's "prompt" is a string or a list of {"role", "content"}
    messages (TRL's conversational format), its "answer" (if any) is something, and the rewards
    score it (an empty completion must get a number in [0, 1] or None)."""
    if not (isinstance(row["prompt"], str) or is_conversational(row["prompt"])):
        raise ValueError('"prompt" must be a string or a list of {"role", "content"} messages')
    if "answer" in row and row["answer"] in (None, ""):
        raise ValueError(f'"answer" is {json.dumps(row["answer"])}: nothing to score against')
    rewards("", row)


def is_conversational(prompt):
    """TRL's conversational format: a list of {"role": ..., "content": ...} messages."""
    messages = prompt if isinstance(prompt, list) and prompt else [None]
    return all(
        isinstance(m, dict) and {type(m.get(k)) for k in ("role", "content")} == {str}
        for m in messages
    )


# -- the reward: --reward's functions, or the task's ----------------------------------------------
class Rewards:
    """--reward's functions (module:function, importable from here; a comma list, or the flag given
    again; TRL's batch form too, per_sample), else the task's own, and --reward-weights (TRL's
    reward_funcs, reward_weights): a sample's reward is the weighted sum of those that apply to it
    (a function returns None where it does not: absent from the sum, not 0, TRL's nansum)."""

    def __init__(self, cfg):
        specs = cfg.reward.split(",") if cfg.reward else []
        default = answer_reward if cfg.dataset else TASKS[cfg.task].reward
        self.functions = [per_sample(load_function(s, "--reward")) for s in specs] or [default]
        self.names = [function.__name__ for function in self.functions]
        weights = cfg.reward_weights.split(",") if cfg.reward_weights else [1] * len(self.names)
        if len(weights) != len(self.names):
            raise ValueError(f"--reward-weights {cfg.reward_weights}: a weight for each --reward")
        self.weights = [float(w) for w in weights]

    def __call__(self, completion, row) -> dict:
        """A Sample's reward, the weighted sum, and rewards, each function's (NaN where it does not
        apply)."""
        each = [score(function, completion, row) for function in self.functions]
        total = sum(w * r for w, r in zip(self.weights, each) if not math.isnan(r))
        return {"reward": total, "rewards": each}


def per_sample(function):
    """A reward function in TRL's form, f(completions, prompts, **columns) -> a list, as one of
    ours, f(completion, row) -> a number: a batch of one sample; any other as it is."""
    if "completions" not in inspect.signature(function).parameters:
        return function

    @functools.wraps(function)
    def one(completion, row):
        # TRL hands a conversational row's completions over as messages
        if is_conversational(row["prompt"]):
            completion = [{"role": "assistant", "content": completion}]
        columns = {k: [v] for k, v in row.items() if k != "prompt"}
        return function(completions=[completion], prompts=[row["prompt"]], **columns)[0]

    return one


def score(reward_fn, completion, row) -> float:
    """One function's reward of a completion, checked to be a number in [0, 1] or None (NaN)."""
    try:
        value = reward_fn(completion, row)
    except Exception as e:
        raise RuntimeError(
            f"the reward {reward_fn.__module__}:{reward_fn.__name__} raised {type(e).__name__}: "
            f"{e}, scoring the completion {completion!r} of the row {reprlib.repr(row)}"
        ) from e
    if value is not None and not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise ValueError(f"a reward of {value!r} for {row['prompt']!r}: not a number in [0, 1]")
    return math.nan if value is None else float(value)


# -- evaluation ------------------------------------------------------------------------------------
def pass_at_k(n, c, k):
    """The unbiased estimate of pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n,
    k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(cfg):
    """--pass-k's list of k; by default 1, 2, 4, ... <= --eval-n."""
    if cfg.pass_k:
        return [int(k) for k in cfg.pass_k.split(",")]
    return [2**i for i in range(cfg.eval_n.bit_length())]


def evaluate(client, rows, cfg):
    """--eval-n samples per held-out row on the server's weights, each added to
    --out/eval_samples.jsonl, correct with a reward of at least --success-threshold. Returns
    eval_metrics' pass@k and maj@k, and the seconds it took."""
    t_eval = time.time()
    rewards = Rewards(cfg)
    tools = chat_tools(client, episode_tools(cfg))
    groups = []
    for row, samples in zip(rows, sample_held_out(client, rows, cfg), strict=True):
        group = []
        for sample in samples:
            episode = isinstance(sample, Episode)
            text = sample.turns[-1]["text"] if episode else sample.text
            reward = rewards(text, row)["reward"]
            group.append(
                {
                    # as the model saw it: a conversational row's rendered by the chat template
                    "prompt": rendered_prompt(row, cfg, tools),
                    "task": row.get("task", cfg.task),
                    "completion": text,
                    "reward": reward,
                    "correct": reward >= cfg.success_threshold,
                    "version": sample.turns[0]["version"] if episode else sample.version,
                }
            )
        groups.append(group)
    with open(os.path.join(cfg.out, "eval_samples.jsonl"), "a") as f:
        for group in groups:
            f.writelines(json.dumps(record) + "\n" for record in group)
    return eval_metrics(groups, pass_ks(cfg)) | {"seconds": time.time() - t_eval}


def sample_held_out(client, rows, cfg):
    """--eval-n samples of each row, [row][n], a request per row; a bar counts them in as they
    finish, where stderr is a terminal."""
    # vLLM refuses n > 1 at temperature 0; top_k 1 is the same greedy choice
    greedy = {"temperature": 1.0, "top_k": 1}
    sampling = {"temperature": cfg.temperature} if cfg.temperature > 0 else greedy
    sampling |= {"n": cfg.eval_n, "max_tokens": cfg.max_tokens, "seed": cfg.seed}
    futures = submit_prompts(client, rows, cfg, **sampling)
    completed = client.as_completed(futures)
    # {future: its result}, as they finish
    results = dict(tqdm(completed, desc="held-out", total=len(futures), leave=False, disable=None))
    return [results[future][0] for future in futures]


def eval_metrics(groups, ks):
    """pass@k and maj@k (majority_correct) for each k in `ks` from `groups`, [row][n] samples
    (evaluate's records), over all rows and per task: {"pass@1": ..., "maj@1": ...,
    "addition/pass@1": ...}."""
    scores = collections.defaultdict(list)
    for group in groups:
        correct = sum(record["correct"] for record in group)
        for task in ("", group[0]["task"] + "/"):
            for k in ks:
                scores[f"{task}pass@{k}"].append(pass_at_k(len(group), correct, k))
                scores[f"{task}maj@{k}"].append(majority_correct(group[:k]))
    return {name: mean(values) for name, values in scores.items()}


def majority_correct(samples):
    """maj@k of one prompt's first k `samples` (lighteval's): 1.0 if the most common final answer
    (the last number a completion writes, as reward reads it, else its whole text; a tie goes to
    the answer given first) is correct, as the first sample that gave it is, else 0.0."""
    answers = []
    for record in samples:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", record["completion"])
        answers.append(numbers[-1] if numbers else record["completion"].strip())
    top, _ = collections.Counter(answers).most_common(1)[0]
    return float(samples[answers.index(top)]["correct"])


def final_eval(client, held_out, cfg):
    """Evaluate, print how many prompts and `pass@1=... maj@1=...`, and write eval.json to --out:
    the results, the model and the version of the weights evaluated."""
    result = evaluate(client, held_out, cfg)
    server = client.health()
    print(
        f"held-out: {len(held_out)} prompts x {cfg.eval_n} samples (eval_samples.jsonl), weights "
        f"v{server['version']}: "
        + " ".join(f"{k}={v:.3f}" for k, v in result.items() if "/" not in k)
    )
    record = {"model": cfg.model or server["model"], "version": server["version"], **result}
    Path(cfg.out, "eval.json").write_text(json.dumps(record, indent=1))
    return result


def eval_only(client, cfg, held_out):
    """--eval-only: evaluate --model. A server given by --server-url gets its weights pushed first
    (one that train.py starts loads them, and gets an adapter pushed); without --model, what that
    server holds is evaluated. eval.json and eval_samples.jsonl then hold this evaluation alone."""
    Path(cfg.out, "eval_samples.jsonl").unlink(missing_ok=True)
    if cfg.model and (cfg.server_url or cfg.lora_rank):
        first_push(client, cfg, load_policy(cfg))
        client.close_communicator()
    return final_eval(client, held_out, cfg)


# -- checkpoints: --save-every, --resume -----------------------------------------------------------
def state_path(run):
    return os.path.join(run, "checkpoint", "trainer_state.pt")


def save_checkpoint(cfg, policy, tok, next_step, rng, sampler):
    """Replace --out/checkpoint with the model, the tokenizer and, where `policy` resumes,
    trainer_state.pt: the optimizer, `next_step` and the data order (docs/training.md)."""
    rows = [queued.rows for queued in sampler.queue] + list(sampler.sampled)
    optimizer = policy.opt.state_dict()
    state = {"step": next_step, "optimizer": optimizer, "rng": rng.getstate(), "rows": rows}
    extra = {"trainer_state.pt": state} if policy.resumable else {}
    # a LoRA run's: the adapter (PeftModel.save_pretrained)
    weights = None if cfg.lora_rank else sampler.weights
    save_model(policy.model, tok, os.path.join(cfg.out, "checkpoint"), extra, weights)


def start_run(cfg, opt, rng, data):
    """(the first step, the rows of the steps sampled from it on, the metrics so far): a new run's,
    or with --resume the checkpoint's, its optimizer and RNG restored (docs/training.md)."""
    os.makedirs(cfg.out, exist_ok=True)
    # the run's settings: --resume takes those not given again, a new run may start from them
    with open(os.path.join(cfg.out, "config.yaml"), "w") as f:
        yaml.safe_dump({k: v for k, v in asdict(cfg).items() if k != "resume"}, f, sort_keys=False)
    start, rows, history = 0, [], []
    if cfg.resume:
        state = torch.load(state_path(cfg.resume), weights_only=True)
        opt.load_state_dict(state["optimizer"])
        # the optimizer's state brings back the learning rate it was saved with: --lr decides
        saved_lr = opt.param_groups[0]["lr"]
        for group in opt.param_groups:
            group["lr"] = cfg.lr
        if saved_lr != cfg.lr:
            print(f"--lr {cfg.lr} from here on (the checkpoint's was {saved_lr})", file=sys.stderr)
        rng.setstate(state["rng"])
        with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
            history = [row for row in map(json.loads, f) if row["step"] < state["step"]]
        start, rows = state["step"], state["rows"]
    # steps start..start+K sampled ahead (Sampler.advance); a checkpoint holds them, fewer
    # (one of a run that ended, or of a smaller K), or more (of a larger K: Sampler keeps them)
    while len(rows) <= min(cfg.max_staleness, cfg.steps - 1 - start):
        rows.append(rng.sample(data, cfg.prompts_per_step))
    return start, rows, history


# -- the command line: python train.py, or torchrun ------------------------------------------------
def main(argv=None):
    cfg = parse_config(argv)
    # torchrun: join the trainers' group (--device cuda: NCCL, each rank on GPU LOCAL_RANK; else
    # gloo); rank 0 goes on below, the others follow it
    if "LOCAL_RANK" in os.environ:
        if cfg.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo")
        if dist.get_rank() > 0:
            return follow()
    # a server started here serves calc and --server-args' --tool NAME=...: another tool is refused
    # now, not after the warm start (MCP tools, --mcp's and the power task's, once it answers)
    served = {"calc", *re.findall(r"--tool[ =]([^=\s]+)=", cfg.server_args)}
    unknown = sorted(set(episode_tools(cfg)) - served)
    if unknown and not (cfg.server_url or "--mcp" in cfg.server_args or cfg.task == "power"):
        sys.exit(f"error: --tools: a server started here has no tool {', '.join(unknown)}")
    # before anything else: every row of the data is checked, a file that is not there said
    try:
        data = load_data(cfg)
        # a run is never overwritten
        if not (cfg.eval_only or cfg.resume) and os.path.exists(Path(cfg.out, "metrics.jsonl")):
            raise ValueError(f"{cfg.out} holds a run: continue it with --resume, or another --out")
        # a conversational row without a chat template is refused now, before any server starts
        check_template(cfg, data)
        # a running server next: one that lacks a tool of --tools refuses before the warm start
        client = connect(cfg, cfg.server_url.split(",")) if cfg.server_url else None
        # without --model, --eval-only --server-url evaluates the weights that server holds
        if not cfg.model and not (cfg.eval_only and cfg.server_url):
            cfg.model = builtin_model(cfg)
            check_template(cfg, data)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(json.dumps(asdict(cfg)))
    os.makedirs(cfg.out, exist_ok=True)
    servers = []  # (process, Client) of each server started here, added as it comes up
    try:
        if client is None:
            with ThreadPoolExecutor(cfg.num_servers) as pool:
                list(pool.map(lambda k: servers.append(launch(cfg, k)), range(cfg.num_servers)))
            client = connect(cfg, [c.base_url for _, c in servers])
        result = eval_only(client, cfg, data[1]) if cfg.eval_only else train(cfg, client, data)
        lead("stop")
        return result
    finally:
        for proc, _ in servers:
            stop_server(proc)


def check_template(cfg, data):
    """A ValueError naming --chat-template if --model's tokenizer cannot render the first training
    and held-out rows (a conversational row, no chat template); nothing until --model is known."""
    for row in data[0][:1] + data[1][:1] if cfg.model else []:
        rendered_prompt(row, cfg)


def connect(cfg, urls) -> Client:
    """A Client for one server URL, a Router for several, checked once: they answer (else one line,
    at once), and serve the --dtype asked for, if one was."""
    client = Client(urls[0]) if len(urls) == 1 else Router(urls)
    try:
        health = client.health(timeout=5)
    except (ConnectionError, ServerError) as e:
        sys.exit(f"error: --server-url: {e}")
    served = health["dtype"]
    missing = sorted(set(episode_tools(cfg)) - set(health["tools"]))
    if missing:
        sys.exit(f"error: --tools: the server has no tool {', '.join(missing)}: {health['tools']}")
    if cfg.dtype and cfg.dtype != served:
        sys.exit(f"error: --dtype {cfg.dtype}: the server serves {served} (its --dtype decides)")
    cfg.dtype = served
    return client


def launch(cfg, k):
    """Server k of --num-servers, on the model; on a GPU machine on GPU k."""
    flags = ["--model", base_model(cfg.model), "--dtype", cfg.dtype or "float32"]
    flags += ["--seed", str(cfg.seed), "--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.lora_rank:
        # vLLM's ranks: 1, 8, 16, 32, ...; every version a step in flight may sample stays loaded;
        # an adapter travels in a request's body (0.5B, rank 8: 24 MB of base64)
        rank = next(r for r in (8, 16, 32, 64, 128, 256, 512) if r >= cfg.lora_rank)
        flags += ["--enable-lora", "--max-lora-rank", str(rank)]
        flags += ["--max-loras", str(cfg.max_staleness + 2), "--max-body-mb", "1024"]
    if cfg.task == "power":
        # its MCP server
        mcp_arith = Path(__file__).resolve().parent / "examples" / "mcp_arith.py"
        flags += ["--mcp", f"arith={sys.executable} {mcp_arith}"]
    gpu = {"CUDA_VISIBLE_DEVICES": str(k)} if cfg.num_servers > 1 else {}
    log = os.path.join(cfg.out, f"server{k}.log")
    return launch_server(*flags, *shlex.split(cfg.server_args), log_path=log, env=os.environ | gpu)


# -- torchrun: FSDP2 over several ranks; rank 0 talks to the servers, evaluates and logs -----------
def lead(*message):
    """Rank 0 under torchrun: have the other ranks (waiting in follow()) do what we do next."""
    if dist.is_initialized() and dist.get_rank() == 0:
        dist.broadcast_object_list([message], src=0)


def follow():
    """Ranks > 0 under torchrun: hold a shard of the model, and call each method of it that rank 0
    calls of its own (lead): train on our share of each micro-batch, step with it, and gather the
    full weights with it once at the start and after each step (rank 0 then pushes them)."""
    # the first command is "start" (cfg), or "stop" when rank 0 only evaluates
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        command, *args = box[0]
        if command == "stop":
            return
        if command == "start":
            policy = ShardedPolicy(*args)
        else:
            # by name: backward, step, zero_grad, weights
            getattr(policy, command)(*args)


class ShardedPolicy(Policy):
    """The Policy sharded over the torchrun ranks with FSDP2: each decoder layer a unit, gathered
    just before it runs, the rest (embeddings, final norm, head) the root. Rank 0 calls each
    method and has the other ranks (in follow()) call it too."""

    resumable = False

    def __init__(self, cfg, probe=None):
        """Rank 0 checks `probe` before the model is sharded."""
        lead("start", cfg)
        self.ranks = dist.get_world_size()
        super().__init__(cfg, probe)

    def shard(self):
        """On the model's device (a CPU trainer on a GPU machine shards on the CPU)."""
        shard(self.model)

    def backward(self, samples, advantages, version, pad_id, measure_all):
        """backward() of this rank's share of the micro-batch: whole groups (a group never
        straddles two ranks; its advantages were computed before the split). Returns what
        Policy.backward does, of the whole micro-batch: every rank's statistics."""
        lead("backward", samples, advantages, version, pad_id, measure_all)
        rank = dist.get_rank()
        # a micro-batch's prompts divide among the ranks (Config), so each share holds whole groups
        share = slice(rank * len(samples) // self.ranks, (rank + 1) * len(samples) // self.ranks)
        mine = (samples[share], advantages[share], version, self.cfg, pad_id, measure_all)
        # every rank's statistics; skip off: every rank runs as many forward/backward passes as the
        # others (see forwards)
        shares = [None] * self.ranks
        dist.all_gather_object(shares, backward(self.model, *mine, skip=False))
        return Backward.joined(shares)

    def step(self, divisor):
        lead("step", divisor)
        return super().step(divisor)

    def zero_grad(self):
        lead("zero_grad")
        super().zero_grad()

    def weights(self, dtype=""):
        """Every rank calls this at the start and after each step: each parameter in turn is
        gathered from the ranks' shards, and only rank 0 keeps it, in `dtype` (client.DTYPES;
        "": as trained): no rank holds the full float32 weights, only one parameter at a time."""
        lead("weights", dtype)
        return full_weights(self.model, dtype)


def shard(model):
    """Shard the model over the torchrun ranks with FSDP2, on its device."""
    mesh = init_device_mesh(model.device.type, (dist.get_world_size(),))
    # the decoder layers: what transformers keeps whole when it splits a model over devices
    for layer in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_weights(model, dtype=""):
    """{name: tensor} gathered from the ranks' shards, rank 0's alone (ShardedPolicy.weights; no
    LoRA under torchrun: Config refuses it)."""
    weights = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if dist.get_rank() == 0:
            weights[name] = full.to(DTYPES.get(dtype, full.dtype))
    return weights


if __name__ == "__main__":
    # a scheduler's SIGTERM (Slurm's, Kubernetes', `timeout`'s) stops the run as Ctrl-C does: what
    # was done is saved, and the servers it started are stopped instead of left holding a GPU
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt as e:
        # Ctrl-C or SIGTERM: what was done is saved; one line says where, not a traceback
        print(*getattr(e, "__notes__", ["stopped"]), file=sys.stderr)
        sys.exit(130)
    finally:
        # under torchrun: leave the group, or gloo's threads abort the process as it exits
        if dist.is_initialized():
            dist.destroy_process_group()
    if "LOCAL_RANK" in os.environ:
        # a torchrun rank that finished skips Python's finalization: FSDP2's DTensor caches keep
        # the group alive even so, and a gloo thread of it that still drops the last broadcast's
        # tensors then cannot take the GIL and is killed mid-destructor (SIGABRT, "terminate
        # called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
