"""train.py's runs as the benchmarks read them (rows of its metrics.jsonl): figures with their
spread, and the refusal of a run that trained on too little to be timed, or on nothing."""

import statistics
import sys

# groups whose rewards are all equal have no advantage and are skipped (train.backward): a run that
# skipped more than this share of its groups, or had a zero gradient at a step, did not do the work
# its time stands for
MAX_ZERO_ADVANTAGE = 0.5


def spread(values):
    """'median (min-max)' of `values`."""
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def hollow(name, rows):
    """Print the run's share of zero-advantage groups and its gradient norms; return why it trained
    on too little to be timed, or ''."""
    zero = statistics.mean(r["frac_reward_zero_std"] for r in rows)
    norms = [r["grad_norm"] for r in rows]
    print(f"{name}: frac_reward_zero_std={zero:.2f} grad_norm={spread(norms)}", flush=True)
    if zero > MAX_ZERO_ADVANTAGE:
        return f"{name}: {zero:.0%} of its groups had no advantage (every reward equal)"
    if min(norms) == 0:
        return f"{name}: a step had a zero gradient"
    return ""


def refuse_hollow(runs):
    """Exit non-zero, saying why, if any run of {name: rows} trained on too little: no speed-up is
    reported from a side that skipped its training."""
    reasons = [reason for name, rows in runs.items() if (reason := hollow(name, rows))]
    if reasons:
        sys.exit("no speed-up reported: a side skipped its training\n" + "\n".join(reasons))


def refuse_untrained(runs):
    """Exit non-zero, saying why, if any run of {name: rows} trained on nothing: no group of any
    step had an advantage. (A run that learns may skip most groups late: every answer right.)"""
    reasons = []
    for name, rows in runs.items():
        zero = statistics.mean(r["frac_reward_zero_std"] for r in rows)
        print(f"{name}: frac_reward_zero_std={zero:.2f}", flush=True)
        if zero == 1:
            reasons.append(f"{name}: 100% of its groups had no advantage (every reward equal)")
    if reasons:
        sys.exit("no parity reported: a side trained nothing\n" + "\n".join(reasons))
