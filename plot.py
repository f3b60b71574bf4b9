"""What a run of train.py shows while it runs: RunLog writes each step's metrics to --out as
metrics.jsonl and TensorBoard events (and to W&B with --wandb), and redraws plot.png.

    tensorboard --logdir runs/      # every run under runs/, live
"""

import json
import os
import time
from dataclasses import asdict

# plot.png is drawn every PLOT_EVERY steps, at least PLOT_SECONDS apart (a drawing takes ~1 s of
# CPU: the CPU demo's steps take 0.15 s), and when the run stops
PLOT_EVERY = 10
PLOT_SECONDS = 30


class RunLog:
    """The records of a run in --out, added to as each step ends (log): a row of metrics.jsonl,
    its numbers as TensorBoard scalars (and W&B's with --wandb), and plot.png every PLOT_EVERY
    steps, PLOT_SECONDS apart at least. close() draws the plot and closes the files: train() calls
    it however the run stops (contextlib.closing): at its end, on an error, on Ctrl-C. `history`:
    the rows so far (a resumed run's), added to."""

    def __init__(self, cfg, history):
        from torch.utils.tensorboard import SummaryWriter

        self.out = cfg.out
        self.history = history
        # time.monotonic() of the last drawing
        self.drawn = float("-inf")
        # (step, result) of each held-out evaluation
        self.evals = [(row["step"], row["eval"]) for row in history if "eval" in row]
        self.jsonl = open(os.path.join(cfg.out, "metrics.jsonl"), "w")
        # a resumed run's rows so far: the steps before its checkpoint
        self.jsonl.writelines(json.dumps(row) + "\n" for row in history)
        # a resumed run's: the events of the steps from its checkpoint on, logged before it
        # stopped, are dropped (TensorBoard's purge_step), so that no step shows twice
        self.tensorboard = SummaryWriter(cfg.out, purge_step=len(history))
        self.wandb = None
        if cfg.wandb:
            import wandb

            # offline unless the user's WANDB_MODE says otherwise: `wandb sync` uploads it
            mode = os.environ.get("WANDB_MODE", "offline")
            self.wandb = wandb.init(project=cfg.wandb, dir=cfg.out, config=asdict(cfg), mode=mode)

    def log(self, row):
        """Record a step's metrics (step_metrics' row)."""
        self.history.append(row)
        print(json.dumps(row), file=self.jsonl, flush=True)
        if "eval" in row:
            self.evals.append((row["step"], row["eval"]))
        self.write_scalars(row["step"], scalars(row))
        if len(self.history) % PLOT_EVERY == 0 and time.monotonic() - self.drawn > PLOT_SECONDS:
            self.plot()

    def log_eval(self, step, result):
        """Record a held-out evaluation that is no step's (the final weights'), as of `step`."""
        self.evals.append((step, result))
        self.write_scalars(step, scalars({"eval": result}))

    def write_scalars(self, step, values):
        for name, value in values.items():
            self.tensorboard.add_scalar(name, value, step)
        if self.wandb:
            self.wandb.log(values, step=step)

    def plot(self):
        if self.history:
            plot(self.history, os.path.join(self.out, "plot.png"), self.evals)
            self.drawn = time.monotonic()

    def close(self):
        self.plot()
        self.tensorboard.close()
        self.jsonl.close()
        if self.wandb:
            self.wandb.finish()


def scalars(row):
    """The numbers of a metrics row by their TensorBoard names: "reward", ..., "eval/pass@1", ...
    (not the intervals, the schedule's name, or a measure with nothing measured: None)."""
    values = {}
    for key, value in row.items():
        if key == "eval":
            values.update({f"eval/{name}": v for name, v in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            values[key] = value
    return values


def plot(history, path, evals=()):
    """A figure of the run: reward and held-out evaluation, the loss and entropy, completion
    lengths, the time each step spent, importance weights, the trainer-server mismatch, and a
    timeline of a few steps (draw_timeline). `evals`: RunLog's (step, result) pairs."""
    import matplotlib.pyplot as plt

    plt.switch_backend("agg")
    fig = plt.figure(figsize=(14, 13))
    grid = fig.add_gridspec(4, 2, height_ratios=[3, 2, 2, 2])
    steps = [h["step"] for h in history]
    draw_reward(fig.add_subplot(grid[0, 0]), steps, history, evals)
    lines(fig.add_subplot(grid[0, 1]), steps, history, "loss", "entropy")
    draw_times(fig.add_subplot(grid[1, 0]), steps, history)
    ax = lines(fig.add_subplot(grid[1, 1]), steps, history, "completion_length")
    lines(ax, steps, history, "completion_length_max", ylabel="sampled tokens")
    lines(ax.twinx(), steps, history, "truncated", ylabel="share cut at --max-tokens", style=":")
    ax = lines(fig.add_subplot(grid[2, 0]), steps, history, "mismatch_mean", "mismatch_max")
    lines(ax, steps, history, "mismatch_kl", ylabel="trainer vs server logprobs")
    ax.set_yscale("log")
    ax = lines(fig.add_subplot(grid[2, 1]), steps, history, "is_weight_mean", "is_weight_max")
    ax.set_ylabel("importance weights (stale tokens)")
    lines(ax.twinx(), steps, history, "is_clipped", ylabel="share clipped at --is-cap", style=":")
    draw_timeline(fig.add_subplot(grid[3, :]), history)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def lines(ax, steps, history, *keys, ylabel=None, style="-"):
    """A line per metric `keys` against the steps on `ax` (a metric not measured at a step, None,
    leaves a gap), with a legend; `ax`. Dotted lines (a second axis's) are grey."""
    color = {"color": "grey"} if style != "-" else {}
    for key in keys:
        values = [float("nan") if h.get(key) is None else h[key] for h in history]
        ax.plot(steps, values, style, marker=".", label=key.replace("_", " "), **color)
    ax.legend(loc="upper left" if style == "-" else "upper right", fontsize=8)
    ax.set(xlabel="optimizer step", ylabel=ylabel)
    return ax


def draw_reward(ax, steps, history, evals):
    """Reward and exact answers per step, and the held-out pass@1 and maj@1 of each evaluation."""
    ax.plot(steps, [h["reward"] for h in history], marker=".", label="reward")
    ax.plot(steps, [h["accuracy"] for h in history], marker=".", label="exact answers")
    for key in ("pass@1", "maj@1"):
        shown = [(step, result[key]) for step, result in evals if key in result]
        if shown:
            ax.plot(*zip(*shown), "o--", label=f"held-out {key}")
    ax.legend(loc="lower right", fontsize=8)
    staleness = max(h["staleness"] for h in history)
    title = f"GRPO, {history[0]['schedule']} schedule, max staleness {staleness:.0f}"
    ax.set(xlabel="optimizer step", ylabel="per sample", title=title)


def draw_times(ax, steps, history):
    """The trainer's time per step, stacked: training, idle (waiting for samples), the weight push;
    and the server's generation time."""
    bottom = [0.0] * len(steps)
    for key, color in [("train_s", "tab:blue"), ("idle_s", "tab:red"), ("sync_s", "tab:green")]:
        values = [h[key] for h in history]
        ax.bar(steps, values, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(steps, [h["gen_s"] for h in history], "k.-", label="gen_s (server)")
    ax.set(xlabel="optimizer step", ylabel="seconds")
    ax.legend(loc="upper right", fontsize=8)


def draw_timeline(ax, history, steps=4):
    """A few steps from the middle of a run, from metrics.jsonl's intervals: when the server
    generated each micro-batch, when the trainer trained on it, when it pushed the weights."""
    shown = history[len(history) // 2 :][:steps]
    t0 = min(a for h in shown for a, _ in h["intervals"]["gen"] + h["intervals"]["train"])
    lanes = [("sync", "tab:green"), ("train", "tab:blue"), ("gen", "black")]
    for lane, (key, color) in enumerate(lanes):
        bars = [(a - t0, b - a) for h in shown for a, b in h["intervals"][key]]
        ax.broken_barh(bars, (lane - 0.4, 0.8), color=color, alpha=0.5)
    ax.set_yticks([0, 1, 2], ["trainer: sync", "trainer: train", "server: generate"])
    ax.set_xlabel(f"seconds, steps {shown[0]['step']}-{shown[-1]['step']}: a bar per micro-batch")
