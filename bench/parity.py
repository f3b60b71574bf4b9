"""Parity: does asynchronous training learn as the synchronous loop does, and does it get there
sooner? Held-out exact accuracy of every schedule over seeds, against steps and against seconds.

    # CPU, seconds: the tiny model on addition, 2 seeds, 3 schedules, 6 steps
    .venv/bin/python bench/parity.py --smoke
    # CPU: the tiny model on addition, 3 seeds, every schedule, 120 steps (minutes)
    .venv/bin/python bench/parity.py
    # one GPU: server and trainer on GPU 0 (weights over CUDA IPC), the 0.5B shape on chat-sums:
    # sync-batch, overlap, in-flight K=1, 3 seeds, 100 steps
    python3 bench/parity.py --device cuda
    # the same in pieces of at most ~10 min: each call trains the runs not finished yet (seed by
    # seed, starting none that would end after --stop-after s), and the one that finishes the
    # last reports
    python3 bench/parity.py --device cuda --reuse --stop-after 480
    # a seed a GPU session: each session trains its seed's runs (the warm start gives the same
    # weights on every card of one kind, not across kinds: docs/results.md#warm_start); their
    # folders, copied into one --out, are reported by a --reuse call on any machine
    python3 bench/parity.py --device cuda --seeds 2 --first-seed 1    # seed 1's runs only
    python3 bench/parity.py --device cuda --seeds 3 --reuse --out runs/all-seeds
    # the H100 runs behind docs/results.md, as the report reads them (docs/data/: a seed a file)
    mkdir -p runs/h100 && for f in docs/data/parity-h100-seed[012].tgz; do
        tar xzf $f -C runs/h100 --strip-components=1; done
    .venv/bin/python bench/parity.py --device cuda --warm-start-steps 350 --reuse --out runs/h100 \
        --seeds 3
    # TRL colocate's seconds per step on the same workload beside ours (bench/trl_gpu.py's output;
    # docs/data/trl-gpu-chat-sums-h100.tgz holds an H100's runs: their --out folders)
    python3 bench/trl_gpu.py --task chat-sums --warm-start-steps 350 --layouts trl-colocate \
        --prompts-per-step 8 --max-tokens 384 --lr 1e-5 > trl.log
    python3 bench/parity.py --device cuda --reuse --trl-log trl.log

Each schedule of bench/overlap.py (sync-batch, overlap, drain K=1, in-flight K=1, in-flight K=2,
named and set up as there) runs train.train once per seed 0..--seeds-1, all on one server (or
--server-url's), each from the same warm-started built-in model (train.builtin_model of --task
and --model-size, cached in .cache/), pushed first. At seed s every schedule trains on the same
prompts and holds out the same ones (train.py's --seed s), its requests seeded from its prompts
(--seed-requests: at K = 0 overlap and sync-batch so take the same samples, the fingerprint test
in tests/test_train.py). train.py evaluates the held-out prompts every --eval-every steps and at
the end (--eval-prompts x 8 samples, eval_samples.jsonl): an answer is exact when its reward is 1
(pass@1), and its reward is the task's. On a GPU the server takes every sample of an evaluation
up to 1024 at once (--max-num-seqs).

Per schedule, at each evaluation: the median and band (min-max over seeds) of held-out exact
accuracy and reward, and the seconds of training up to it: the sum of train.py's step_s before it
less each evaluation's own seconds (train.py evaluates at a step's start), so that a long evaluation
does not blur the schedules' difference; the evaluations' seconds are printed apart. Then each
schedule's seconds per step (evaluations not counted) and its speed-up per step over sync-batch, and
where a step went (training, waiting for samples, the weight sync; generation's wall time beside
them); how far off-policy each schedule's steps were (staleness, importance weights, the sampler's
mismatch: medians over steps); with --trl-log, TRL colocate's seconds per step on the same workload
beside our one step stale. Then the steps and seconds to --target (by default sync-batch's accuracy
at step 0 plus --gain: the first evaluation whose median is at or above it; "not reached"
otherwise), and a line per schedule: its median accuracy at the last step inside or outside the
sync-batch band there (the on-policy band), how many seeds reach --target and their seconds to it
(each at its own first evaluation at or above it: median and band), the median curve's speed-up
to --target (sync-batch's seconds over its own), and the speed-up seed by seed (each over sync-batch
at the same seed: a seed's runs share one machine, and machines of one kind may differ in speed, so
seeds trained in different sessions compare safely only this way). It draws
--plot-dir/parity-cpu.png (or -gpu.png): accuracy and reward against steps and against seconds,
each schedule's median and band; and parity-cpu-seconds.png (or -gpu-): accuracy against seconds
alone, each schedule's speed-up to --target in its legend (the README's figure).

A run that trained nothing (no group of any step with an advantage: every reward of each group
equal; bench/runs.py) stops the benchmark as it ends (exit 1): no parity is reported from it. One
that learns may skip most groups late (every answer right): bench/overlap.py's stricter refusal,
for timing, would stop it.

On the CPU (addition: 25 distinct sums, 8 held out and never trained on) the tiny model's held-out
accuracy moves, but unsteadily (docs/results.md): the CPU run shows the machinery, not parity.
On the GPU the workload is one like a user's: chat-sums (tasks.py: one-digit numbers to add up,
asked in a chat message rendered by the model's chat template, worked a line a step; completions
of 50-320 tokens, 181 at the median, so that generation is most of a synchronous step), the
built-in 0.5B shape warm-started (--warm-start-steps; bench/warm_start.py finds where) to where
held-out exact accuracy can move: a model that never answers exactly, or always does, shows no
parity whatever the schedule. 350 warm-start steps put it at 25% on an H100, from where sync-batch
gained 16 points by step 75 (docs/results.md); the weights depend on the kind of card (325 steps
gave 15% on an H200), so pass the card's count: the first milestone of `bench/warm_start.py
--reference --stop-at 0.2`. 8 prompts x 8 x <= 384 tokens a step at lr 1e-5 (at 8e-5 every
schedule diverged within 10 steps: completions ran to the limit; at 2e-5 and 4e-5 held-out
accuracy fell, docs/results.md), 100 steps, 256 held-out prompts x 8 every 20 steps.
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from overlap import (  # noqa: E402
    RUNS,
    add_device_flag,
    device_setup,
    print_setup,
    schedule_config,
    serving,
)
from runs import refuse_untrained, spread  # noqa: E402

import tasks  # noqa: E402
import train  # noqa: E402
from local import SHAPES  # noqa: E402

# the defaults that depend on --device: (CPU, GPU); --smoke's replace the CPU's
DEFAULTS = {
    "model_size": ("tiny", "0.5b"),
    "task": ("addition", "chat-sums"),
    "warm_start_steps": (100, 350),
    "steps": (120, 100),
    "eval_every": (10, 20),
    "eval_prompts": (8, 256),
    "prompts_per_step": (32, 8),
    "max_tokens": (4, 384),
    "lr": (1e-3, 1e-5),
    "seeds": (3, 3),
    "schedules": (",".join(RUNS), "sync-batch,overlap,in-flight K=1"),
    "gain": (0.15, 0.15),
}
SMOKE = {
    "warm_start_steps": 20,
    "steps": 6,
    "eval_every": 2,
    "prompts_per_step": 8,
    "seeds": 2,
    "schedules": "sync-batch,overlap,in-flight K=1",
    "gain": 0.05,
}


def default(name):
    """--help's line for a flag whose default depends on --device."""
    on_cpu, on_gpu = DEFAULTS[name]
    return f"default: {on_cpu} CPU, {on_gpu} GPU"


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_device_flag(p)
    p.add_argument("--smoke", action="store_true", help="CPU, seconds: " + json.dumps(SMOKE))
    p.add_argument("--model-size", choices=list(SHAPES), help=default("model_size"))
    p.add_argument("--task", choices=list(tasks.TASKS), help=default("task"))
    p.add_argument("--warm-start-steps", type=int, help=default("warm_start_steps"))
    p.add_argument("--steps", type=int, help="optimizer steps per run: " + default("steps"))
    p.add_argument(
        "--eval-every", type=int, help="steps between evaluations: " + default("eval_every")
    )
    p.add_argument("--eval-prompts", type=int, help="held-out prompts: " + default("eval_prompts"))
    p.add_argument("--prompts-per-step", type=int, help=default("prompts_per_step"))
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument(
        "--max-tokens", type=int, help="completion length limit: " + default("max_tokens")
    )
    p.add_argument("--lr", type=float, help=default("lr"))
    p.add_argument("--reward", default="", help="train.py's --reward (default: the task's)")
    p.add_argument("--seeds", type=int, help="runs per schedule, seeds 0.. (default: 3)")
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="train seeds from this one to --seeds-1 only: the earlier seeds' runs come from "
        "another call (a GPU session each), and a --reuse over their merged --out reports all",
    )
    p.add_argument("--schedules", help="sync-batch first, then any of bench/overlap.py's RUNS")
    p.add_argument(
        "--target", type=float, help="held-out exact accuracy to reach (default: by --gain)"
    )
    p.add_argument(
        "--gain",
        type=float,
        help="the target: sync-batch's step-0 accuracy + this; " + default("gain"),
    )
    p.add_argument("--server-url", default="", help="a running server on the model (default: one)")
    p.add_argument(
        "--out", default=os.path.join(ROOT, "runs", "bench-parity"), help="the runs, server.log"
    )
    p.add_argument("--plot-dir", default=os.path.join(ROOT, "docs"), help="for parity-*.png")
    p.add_argument(
        "--trl-log",
        default="",
        help="bench/trl_gpu.py's output on the same workload (or its --out's trl-colocate.log): "
        "TRL colocate's seconds per step beside ours",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="take the finished runs in --out (those with an eval.json) instead of training them "
        "again: a long benchmark in pieces, the last call reporting every run",
    )
    p.add_argument(
        "--stop-after",
        type=float,
        default=0,
        help="start no run that would end after this many seconds, judged by the longest run so "
        "far (0: no limit); the runs left wait for a later --reuse call, which reports once every "
        "run is finished",
    )
    args = p.parse_args()
    gpu = args.device != "cpu"
    if args.smoke and gpu:
        p.error("--smoke runs on the CPU")
    for name, (on_cpu, on_gpu) in DEFAULTS.items():
        if getattr(args, name) is None:
            smoke = SMOKE.get(name, on_cpu) if args.smoke else on_cpu
            setattr(args, name, on_gpu if gpu else smoke)
    if not 0 <= args.first_seed < args.seeds:
        p.error(f"--first-seed {args.first_seed}: one of the seeds 0..{args.seeds - 1}")
    names = args.schedules.split(",")
    if names[0] != "sync-batch" or not set(names) <= set(RUNS):
        p.error(f"--schedules: sync-batch first, then any of {', '.join(RUNS)}")
    return p, args


def main():
    start = time.monotonic()
    p, args = parse_args()
    workload = {"task": args.task, "model_size": args.model_size, "reward": args.reward}
    os.makedirs(args.out, exist_ok=True)
    names = args.schedules.split(",")
    # seed by seed: a benchmark stopped by --stop-after has had every schedule at its first seeds
    runs = [(name, seed) for seed in range(args.first_seed, args.seeds) for name in names]
    left = [(name, seed) for name, seed in runs if not (args.reuse and finished(args, name, seed))]
    with contextlib.ExitStack() as stack:
        client = None
        # the longest run so far: a run it says would end after --stop-after s is not started
        longest = 0.0
        for i, (name, seed) in enumerate(left):
            if args.stop_after and time.monotonic() - start + longest > args.stop_after:
                print(f"\n--stop-after {args.stop_after} s: {len(left) - i} runs left", flush=True)
                break
            # the device, the model and a server only where a run trains: a --reuse of finished
            # runs reports on any machine
            if client is None:
                server_flags, trainer = device_setup(p, args)
                if server_flags:
                    # a held-out evaluation's samples at once, up to 1024 (vLLM's max_num_seqs;
                    # its default token budget a step, 2048, must hold a decode step of them all)
                    evaluation = min(args.eval_prompts * 8, 1024)
                    at_once = max(evaluation, 3 * args.prompts_per_step * args.group_size)
                    server_flags += ("--max-num-seqs", str(at_once))
                config = train.Config(**workload, **trainer, warm_start_steps=args.warm_start_steps)
                model = train.builtin_model(config)
                print_setup(args.device, model)
                client = stack.enter_context(serving(args, model, server_flags))
            began = time.monotonic()
            train_run(args, client, model, name, seed, trainer | workload)
            longest = max(longest, time.monotonic() - began)
    missing = [(name, seed) for seed in range(args.seeds) for name in names]
    missing = [f"{name} seed {seed}" for name, seed in missing if not finished(args, name, seed)]
    if missing:
        print(f"\nnot in --out yet, so no report: {', '.join(missing)}", flush=True)
        return
    # each run's metrics.jsonl, read once: its evaluations and the workload line come from it
    histories = {name: [metrics(args, name, seed) for seed in range(args.seeds)] for name in names}
    curves = {
        name: [evaluations(args, name, seed, history) for seed, history in enumerate(runs)]
        for name, runs in histories.items()
    }
    report(args, curves, histories)


@dataclass
class Evaluation:
    """A held-out evaluation of a run: after `step` updates, `seconds` of training in (evaluations
    not counted); exact accuracy (pass@1), the mean reward of its samples, and its own seconds."""

    step: int
    seconds: float
    accuracy: float
    reward: float
    evaluation_s: float = 0.0


def folder(args, name, seed):
    return os.path.join(args.out, f"{name.replace(' ', '-')}-seed{seed}")


# what the report reads of a run: one that lacks any of them is not finished, and --reuse trains it
RUN_FILES = ("metrics.jsonl", "eval.json", "eval_samples.jsonl")


def finished(args, name, seed):
    out = folder(args, name, seed)
    return all(os.path.exists(os.path.join(out, file)) for file in RUN_FILES)


def train_run(args, client, model, name, seed, settings):
    """train.train of schedule `name` (RUNS') at `seed`, from `model`'s weights, into its folder.
    A run that trained nothing stops the benchmark here."""
    out = folder(args, name, seed)
    print(f"\n{name}, seed {seed}: {out}", flush=True)
    # train.py adds to eval_samples.jsonl: an old run's would be read as this one's
    shutil.rmtree(out, ignore_errors=True)
    cfg = schedule_config(
        args,
        model,
        name,
        out,
        seed=seed,
        seed_requests=True,
        eval_every=args.eval_every,
        eval_prompts=args.eval_prompts,
        **settings,
    )
    refuse_untrained({f"{name} seed {seed}": train.train(cfg, client)})


def evaluations(args, name, seed, history):
    """The evaluations of schedule `name` at `seed`, in order: those of its steps (`history`, its
    metrics.jsonl rows, "eval") and the final one (eval.json), each with the mean reward of its
    samples in eval_samples.jsonl. A run that trained nothing stops the benchmark here."""
    out = folder(args, name, seed)
    refuse_untrained({f"{name} seed {seed}": history})
    results = [(row["step"], row["eval"]) for row in history if "eval" in row]
    with open(os.path.join(out, "eval.json")) as f:
        results.append((len(history), json.load(f)))
    with open(os.path.join(out, "eval_samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    # each evaluation wrote as many samples, one after the other
    size = len(samples) // len(results)
    points = []
    for i, (step, result) in enumerate(results):
        rewards = [sample["reward"] for sample in samples[i * size : (i + 1) * size]]
        seconds = sum(training_seconds(row) for row in history[:step])
        evaluation_s = result.get("seconds", 0.0)
        points.append(
            Evaluation(step, seconds, result["pass@1"], statistics.mean(rewards), evaluation_s)
        )
    return points


def training_seconds(row):
    """A step's seconds less its held-out evaluation's (train.py evaluates at the step's start)."""
    return row["step_s"] - row.get("eval", {}).get("seconds", 0.0)


def metrics(args, name, seed):
    """The rows of metrics.jsonl of schedule `name` at `seed`, one a step."""
    with open(os.path.join(folder(args, name, seed), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@dataclass
class Band:
    """One measure of a schedule's runs at one evaluation: the median and the band over seeds."""

    median: float
    low: float
    high: float

    def show(self, digits=3):
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"


def band(runs, i, measure):
    """The Band of `measure` ("accuracy", "reward", "seconds") at evaluation i of `runs`."""
    values = [getattr(points[i], measure) for points in runs]
    return Band(statistics.median(values), min(values), max(values))


def to_target(runs, target):
    """(steps, seconds) at the first evaluation whose median accuracy is at least `target`, or
    None."""
    for i, point in enumerate(runs[0]):
        if band(runs, i, "accuracy").median >= target:
            return point.step, band(runs, i, "seconds").median
    return None


def report(args, curves, histories):
    steps = set()
    for runs in curves.values():
        steps |= {tuple(point.step for point in points) for points in runs}
    if len(steps) > 1:
        sys.exit(f"the runs were evaluated at different steps (--reuse of other flags?): {steps}")
    seeds = f"median (min-max) over {args.seeds} seeds"
    print(
        f"\nheld-out: {args.eval_prompts} prompts x 8 samples an evaluation; "
        f"training: {args.prompts_per_step} prompts x {args.group_size} a step"
    )
    for measure, title, digits in (
        ("accuracy", "held-out exact accuracy (pass@1)", 3),
        ("reward", "held-out reward", 3),
        ("seconds", "seconds of training", 1),
    ):
        print(f"\n{title}, {seeds}")
        print(f"{'step':>5} " + " ".join(f"{name:>22}" for name in curves))
        for i, point in enumerate(curves["sync-batch"][0]):
            cells = [band(runs, i, measure).show(digits) for runs in curves.values()]
            print(f"{point.step:>5} " + " ".join(f"{cell:>22}" for cell in cells))
    print(workload(curves["sync-batch"], histories["sync-batch"]))
    print(step_times(curves, histories))
    print(off_policy(histories))
    if args.trl_log:
        print(against_trl(args.trl_log, histories))
    if args.target is None:
        args.target = round(band(curves["sync-batch"], 0, "accuracy").median + args.gain, 3)
    print(f"\nto held-out exact accuracy {args.target}:")
    reached = {name: to_target(runs, args.target) for name, runs in curves.items()}
    on_policy = band(curves["sync-batch"], -1, "accuracy")
    # each seed's own (step, seconds) at the target: its runs share a machine, whose speed may not
    # be the other seeds'
    each = {
        name: [to_target([points], args.target) for points in runs] for name, runs in curves.items()
    }
    bases = reached["sync-batch"], each["sync-batch"]
    for name, runs in curves.items():
        print(verdict(name, runs, on_policy, (reached[name], each[name]), bases))
    draw(curves, args)
    draw_headline(curves, args, reached)


def workload(runs, histories):
    """Whether the workload can show parity, from sync-batch's runs (their evaluations and their
    metrics.jsonl rows): where held-out accuracy starts (a window of 10-40%: room to move either
    way), how far it rises, and whether its samples vary (completion lengths; rewards inside
    groups, without which GRPO has no signal)."""
    first = band(runs, 0, "accuracy").median
    last = band(runs, -1, "accuracy").median
    where = "inside" if 0.1 <= first <= 0.4 else "outside"
    rows = [row for history in histories for row in history]
    mean_length = statistics.mean(row["completion_length"] for row in rows)
    longest = max(row["completion_length_max"] for row in rows)
    varied = 1 - statistics.mean(row["frac_reward_zero_std"] for row in rows)
    return (
        f"\nworkload: sync-batch starts at held-out exact accuracy {first:.3f} ({where} the "
        f"10-40% window) and gains {last - first:+.3f} by step {runs[0][-1].step}; completions "
        f"{mean_length:.1f} tokens on average, the longest {longest}; rewards differ inside "
        f"{varied:.0%} of groups"
    )


def step_times(curves, histories):
    """Each schedule's seconds per step (evaluations not counted), median and min-max over every
    step of its runs, its speed-up per step over sync-batch's; and the evaluations' seconds."""
    lines = ["\nseconds per step, evaluations not counted: median (min-max) over every step"]
    per_step = {}
    for name, runs in histories.items():
        seconds = [training_seconds(row) for history in runs for row in history]
        per_step[name] = statistics.median(seconds)
        line = f"  {name}: {spread(seconds)}"
        if name != "sync-batch":
            line += f", {per_step['sync-batch'] / per_step[name]:.2f}x sync-batch's"
        lines += [line, time_split(runs)]
    evaluation_s = [p.evaluation_s for runs in curves.values() for points in runs for p in points]
    lines.append(f"held-out evaluations, apart from the above: {spread(evaluation_s)} s each")
    return "\n".join(lines)


def time_split(runs):
    """Where a schedule's steps went, medians over its steps without an evaluation: training,
    waiting for samples, the weight sync; and generation's wall time, which runs beside them."""
    rows = [row for history in runs for row in history if "eval" not in row]
    if not rows:
        # --eval-every 1: every step's waiting holds an evaluation
        return "    a step: no step without an evaluation to split"
    keys = ("train_s", "idle_s", "sync_s", "gen_s")
    train, idle, sync, gen = (statistics.median(row[key] for row in rows) for key in keys)
    return (
        f"    a step: training {train:.3f} s, waiting for samples {idle:.3f}, weight sync "
        f"{sync:.3f}; generation {gen:.3f} beside them"
    )


def off_policy(histories):
    """How far each schedule's samples were from the policy it trained: per step (every seed's),
    the median of staleness, of the stale tokens' importance weights (mean and max), of the share
    at --is-cap, and of the sampler's mismatch (train.py's metrics; docs/training.md)."""
    lines = ["\nhow far off-policy, median over every step of every seed"]
    keys = ("staleness", "is_weight_mean", "is_weight_max", "is_clipped", "mismatch_mean")
    for name, runs in histories.items():
        rows = [row for history in runs for row in history]
        # mismatch is measured on the steps that sampled it (None otherwise)
        values = [[row[key] for row in rows if row.get(key) is not None] for key in keys]
        stale, mean, most, capped, mismatch = (statistics.median(v) if v else 0.0 for v in values)
        lines.append(
            f"  {name}: staleness {stale:.2f}; importance weights mean {mean:.3f}, max "
            f"{most:.2f}, {capped:.2%} at the cap; mismatch {mismatch:.4f}"
        )
    return "\n".join(lines)


def against_trl(path, histories):
    """TRL colocate's seconds per step on the same workload (bench/trl_gpu.py's log at `path`,
    after its --warmup steps) beside our one step stale (in-flight K=1) seconds per step."""
    with open(path) as f:
        lines = f.readlines()
    results = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("RESULT {")]
    trl = next((r for r in results if r["name"] == "TRL colocate"), None)
    if trl is None:
        return f"\nno TRL colocate result in {path}"
    # the run's flags, a JSON line of its log; its --warmup (default 2) first steps left out
    flags = next((json.loads(line) for line in lines if line.startswith('{"')), {})
    theirs = trl["step_s"][flags.get("warmup", 2) :]
    ours = [training_seconds(row) for run in histories.get("in-flight K=1", []) for row in run]
    line = f"\nTRL colocate on this workload ({path}): {spread(theirs)} s per step"
    if not ours:
        return line
    ratio = statistics.median(theirs) / statistics.median(ours)
    return line + f"; ours one step stale (in-flight K=1) {spread(ours)}: {ratio:.2f}x TRL's"


def verdict(name, runs, on_policy, at_target, bases):
    """The schedule's line: its last accuracy against the on-policy band, each seed's seconds to
    the target (at its own first evaluation at or above it), the median curve's speed-up to the
    target over sync-batch's, and each seed's over the same seed's sync-batch. `at_target` and
    `bases` (sync-batch's): the median curve's (step, seconds) at the target and each seed's, None
    where not reached."""
    (reached, each), (base, own) = at_target, bases
    last = band(runs, -1, "accuracy")
    line = f"{name}: step {runs[0][-1].step} accuracy {last.show()}"
    if name != "sync-batch":
        inside = on_policy.low <= last.median <= on_policy.high
        where = "inside" if inside else "outside"
        line += f", {where} the on-policy band {on_policy.low:.3f}-{on_policy.high:.3f}"
    hit = [seconds for _, seconds in filter(None, each)]
    line += f"; {len(hit)} of {len(each)} seeds reach the target"
    if hit:
        line += f" in {Band(statistics.median(hit), min(hit), max(hit)).show(1)} s"
    if not reached:
        return line + "; the median, target not reached"
    line += f"; the median at step {reached[0]}, {reached[1]:.1f} s"
    if name == "sync-batch":
        return line
    if not base:
        return line + ", sync-batch did not reach it"
    # seed by seed against sync-batch at that seed: a run's seconds are its machine's
    ratios = [f"{b[1] / e[1]:.2f}x" if b and e else "-" for b, e in zip(own, each)]
    return line + f", speed-up {base[1] / reached[1]:.2f}x; seed by seed {', '.join(ratios)}"


# a dash pattern a schedule, the same in both figures: overlap's curve lies on sync-batch's (the
# same samples, K = 0)
STYLES = ("-", "--", "-.", ":", (0, (6, 2)))


def draw(curves, args):
    """Held-out exact accuracy and reward against steps and against seconds: each schedule's
    median, its band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="col", sharey="row")
    for row, measure in zip(axes, ("accuracy", "reward")):
        for (name, runs), style in zip(curves.items(), STYLES):
            draw_bands(row, runs, measure, name, style)
    for ax in axes[0]:
        ax.axhline(args.target, color="grey", linestyle=":", linewidth=1)
    axes[0][0].set_ylabel("held-out exact accuracy (pass@1)")
    axes[1][0].set_ylabel("held-out reward")
    axes[1][0].set_xlabel("optimizer steps")
    axes[1][1].set_xlabel("seconds of training (median over seeds)")
    axes[0][0].legend()
    fig.suptitle(
        f"--task {args.task}, {args.model_size}: median and min-max over {args.seeds} seeds",
        fontsize=10,
    )
    save(fig, args, "")


def draw_headline(curves, args, reached):
    """The README's figure: held-out exact accuracy against seconds of training alone, each
    schedule's median and band, the target, and each schedule's speed-up to it in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    base = reached["sync-batch"]
    for (name, runs), style in zip(curves.items(), STYLES):
        label = name
        if name != "sync-batch" and base and reached[name]:
            label += f": the target {base[1] / reached[name][1]:.2f}x sooner"
        draw_bands([None, ax], runs, "accuracy", label, style)
    ax.axhline(args.target, color="grey", linestyle=":", linewidth=1)
    ax.annotate(
        f"target {args.target}",
        (0, args.target),
        textcoords="offset points",
        xytext=(2, 3),
        fontsize=8,
        color="grey",
    )
    ax.set_xlabel("seconds of training (median over seeds; evaluations not counted)")
    ax.set_ylabel("held-out exact accuracy (pass@1)")
    ax.legend(loc="lower right")
    ax.set_title(
        f"--task {args.task}, {args.model_size}, {args.prompts_per_step} prompts x "
        f"{args.group_size} a step: median and min-max over {args.seeds} seeds",
        fontsize=10,
    )
    save(fig, args, "-seconds")


def save(fig, args, suffix):
    """Write `fig` as --plot-dir/parity-cpu{suffix}.png (or -gpu)."""
    fig.tight_layout()
    os.makedirs(args.plot_dir, exist_ok=True)
    device = "cpu" if args.device == "cpu" else "gpu"
    path = os.path.join(args.plot_dir, f"parity-{device}{suffix}.png")
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def draw_bands(axes, runs, measure, name, style):
    """One schedule's median and band of `measure` against steps (axes[0]) and seconds (axes[1])."""
    bands = [band(runs, i, measure) for i in range(len(runs[0]))]
    steps = [point.step for point in runs[0]]
    seconds = [band(runs, i, "seconds").median for i in range(len(runs[0]))]
    for ax, x in zip(axes, (steps, seconds)):
        if ax is None:
            continue
        [line] = ax.plot(x, [b.median for b in bands], linestyle=style, label=name)
        low, high = [b.low for b in bands], [b.high for b in bands]
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)


if __name__ == "__main__":
    main()
