"""The benchmarks' CPU smoke runs: each trains on train.py's workload, and refuses to report a
speed-up (or parity) where a side trained nothing (given a reward that is always 0,
tests/my_rewards.py).
bench/trl_gpu.py runs train.py's side only: TRL is not installed here.
bench/scale.py's smoke run with two servers is in tests/test_scale.py, on that file's servers.

Run: .venv/bin/python -m pytest tests/test_bench.py   (against the session server: the
benchmarks take --server-url, and push their model's weights there first)
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tarfile

import pytest

from conftest import run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# few warm-start steps: the smoke runs time nothing; the model only has to write sums
SMOKE = ("--warm-start-steps", "20")


def bench(script, *flags, smoke=SMOKE):
    """`python bench/SCRIPT FLAGS`, in this process (conftest.run_in_process)."""
    return run_in_process(os.path.join(ROOT, "bench", script), *smoke, *flags)


def overlap(server, tmp_path, *flags):
    flags = ("--server-url", server.base_url, "--out", str(tmp_path), *flags)
    return bench("overlap.py", "--steps", "3", "--warmup", "1", "--prompts-per-step", "8", *flags)


def test_the_overlap_bench_reports_speedups_of_runs_that_trained(server, tmp_path, restore_weights):
    run = overlap(server, tmp_path, "--runs", "sync-batch,drain K=1")
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("sync-batch", "drain K=1"):
        assert f"{name}: frac_reward_zero_std=" in run.stdout
    assert "drain_K1_speedup=" in run.stdout and "bound=" in run.stdout


def test_the_overlap_bench_refuses_a_speedup_where_a_side_trained_nothing(
    server, tmp_path, restore_weights
):
    run = overlap(
        server, tmp_path, "--runs", "sync-batch,overlap", "--reward", "tests.my_rewards:zero"
    )
    assert run.returncode == 1
    assert (
        "no speed-up reported" in run.stderr and "100% of its groups had no advantage" in run.stderr
    )
    assert "_speedup=" not in run.stdout
    # stopped at the first such run: overlap was not started
    assert "sync-batch: frac_reward_zero_std=" in run.stdout and "overlap:" not in run.stdout


def test_the_scale_bench_refuses_a_speedup_where_a_side_trained_nothing(
    server, tmp_path, restore_weights
):
    # the one-rank side runs first, on the first server, and stops the bench
    urls = f"{server.base_url},http://127.0.0.1:1"
    flags = ("--server-urls", urls, "--out", str(tmp_path), "--steps", "2")
    run = bench("scale.py", *flags, "--reward", "tests.my_rewards:zero")
    assert run.returncode == 1
    assert "no speed-up reported" in run.stderr and "1 rank: 100% of its groups" in run.stderr
    assert "training, 2 rank(s)" not in run.stdout and "_speedup=" not in run.stdout


def parity(server, tmp_path, *flags):
    """bench/parity.py --smoke: 6 steps of 8 prompts x 8 a run, 2 seeds, evaluations every 2."""
    folders = ("--out", str(tmp_path / "runs"), "--plot-dir", str(tmp_path))
    return bench("parity.py", "--smoke", "--server-url", server.base_url, *folders, *flags)


def test_the_parity_report_of_the_h100_runs_gives_each_seeds_speed_up_over_its_own_sync_batch(
    tmp_path,
):
    """bench/parity.py --reuse on the chat-sums runs in docs/data (seeds 0-2, each on its own H100):
    the report needs no server, and each seed's speed-up to the target is over sync-batch at that
    seed, derived here again from the runs' metrics.jsonl and eval.json."""
    runs = tmp_path / "runs"
    for seed in (0, 1, 2):
        with tarfile.open(os.path.join(ROOT, "docs", "data", f"parity-h100-seed{seed}.tgz")) as tar:
            for member in tar.getmembers():
                # slim/NAME-seedS/FILE -> runs/NAME-seedS/FILE
                member.name = member.name.partition("/")[2]
                if member.name:
                    tar.extract(member, runs, filter="data")
    flags = ("--device", "cuda", "--warm-start-steps", "350", "--reuse", "--seeds", "3")
    run = bench("parity.py", *flags, "--out", str(runs), "--plot-dir", str(tmp_path), smoke=())
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    [title] = [x for x in lines if x.startswith("to held-out exact accuracy ")]
    target = float(title.removeprefix("to held-out exact accuracy ").rstrip(":"))

    def seconds_to_target(name, seed):
        """The seconds of training before the run's first evaluation at or above the target."""
        folder = runs / f"{name}-seed{seed}"
        rows = [json.loads(x) for x in open(folder / "metrics.jsonl")]
        points = [(r["step"], r["eval"]["pass@1"]) for r in rows if "eval" in r]
        points.append((len(rows), json.load(open(folder / "eval.json"))["pass@1"]))
        step = next(step for step, accuracy in points if accuracy >= target)
        return sum(r["step_s"] - r.get("eval", {}).get("seconds", 0) for r in rows[:step])

    for name, label in (("overlap", "overlap"), ("in-flight-K=1", "in-flight K=1")):
        ratios = [
            seconds_to_target("sync-batch", s) / seconds_to_target(name, s) for s in (0, 1, 2)
        ]
        [line] = [x for x in lines if x.startswith(f"{label}: step 100 accuracy ")]
        each = ", ".join(f"{ratio:.2f}x" for ratio in ratios)
        assert line.endswith(f"seed by seed {each}"), (line, ratios)


def test_the_parity_bench_reports_each_schedules_band_against_on_policy_and_its_time_to_target(
    server, tmp_path, restore_weights
):
    # TRL's side, as bench/trl_gpu.py logs it (TRL is not installed here): its flags, then its
    # result, the steps of its --warmup left out
    trl = {"side": "TRL", "layout": "1 GPU", "name": "TRL colocate", "step_s": [9, 2.0, 2.2, 2.6]}
    log = json.dumps({"warmup": 1}) + "\nTRL colocate ...\nRESULT " + json.dumps(trl) + "\n"
    (tmp_path / "trl.log").write_text(log)
    flags = ("--schedules", "sync-batch,in-flight K=1", "--trl-log", str(tmp_path / "trl.log"))
    run = parity(server, tmp_path, *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    # accuracy, reward and seconds at each evaluation: median (min-max) over the seeds, a column
    # per schedule
    band = r"\d+\.\d+ \(\d+\.\d+-\d+\.\d+\)"
    for title in ("held-out exact accuracy (pass@1)", "held-out reward", "seconds of training"):
        at = lines.index(f"{title}, median (min-max) over 2 seeds")
        assert lines[at + 1].split() == ["step", "sync-batch", "in-flight", "K=1"]
        for row, step in zip(lines[at + 2 : at + 6], (0, 2, 4, 6)):
            assert re.fullmatch(rf" +{step} +{band} +{band}", row), row
    # whether the workload can show parity: where sync-batch starts, its gain, its samples' spread
    [workload] = [x for x in lines if x.startswith("workload: ")]
    assert re.fullmatch(
        r"workload: sync-batch starts at held-out exact accuracy \d\.\d{3} \((inside|outside) "
        r"the 10-40% window\) and gains [+-]\d\.\d{3} by step 6; completions \d+\.\d tokens on "
        r"average, the longest \d+; rewards differ inside \d+% of groups",
        workload,
    ), workload
    # the seconds of training leave the evaluations out: each step's step_s less its evaluation's
    rows = {
        (name, seed): [
            json.loads(x) for x in open(tmp_path / "runs" / f"{name}-seed{seed}" / "metrics.jsonl")
        ]
        for name in ("sync-batch", "in-flight-K=1")
        for seed in (0, 1)
    }
    assert all(
        row["eval"]["seconds"] > 0
        for run_rows in rows.values()
        for row in run_rows
        if "eval" in row
    )
    trained = {
        key: [row["step_s"] - row.get("eval", {}).get("seconds", 0) for row in run_rows]
        for key, run_rows in rows.items()
    }
    at = lines.index("seconds of training, median (min-max) over 2 seeds")
    sync_batch = statistics.median(sum(trained["sync-batch", seed]) for seed in (0, 1))
    assert float(lines[at + 5].split()[1]) == pytest.approx(sync_batch, abs=0.051)
    # per step, evaluations apart; TRL's seconds per step beside our one step stale
    [per_step] = [x for x in lines if re.match(r"  in-flight K=1: \d", x)]
    assert re.fullmatch(rf"  in-flight K=1: {band}, \d+\.\d\dx sync-batch's", per_step), per_step
    # where its steps went: train.py's own split, medians over the steps without an evaluation
    split = lines[lines.index(per_step) + 1]
    number = r"(\d+\.\d{3})"
    parts = (
        rf"    a step: training {number} s, waiting for samples {number}, weight sync {number}; "
    )
    match = re.fullmatch(parts + rf"generation {number} beside them", split)
    assert match, split
    steps = [row for seed in (0, 1) for row in rows["in-flight-K=1", seed] if "eval" not in row]
    assert float(match[1]) == pytest.approx(
        statistics.median(r["train_s"] for r in steps), abs=6e-4
    )
    assert float(match[2]) == pytest.approx(statistics.median(r["idle_s"] for r in steps), abs=6e-4)
    assert any(
        re.fullmatch(rf"held-out evaluations, apart from the above: {band} s each", x)
        for x in lines
    )
    # how far off-policy: one step stale's staleness and importance weights, sync-batch's none
    [off] = [x for x in lines if x.startswith("  in-flight K=1: staleness ")]
    staleness = [row["staleness"] for seed in (0, 1) for row in rows["in-flight-K=1", seed]]
    assert off.startswith(f"  in-flight K=1: staleness {statistics.median(staleness):.2f}; ")
    assert re.search(r"importance weights mean \d\.\d{3}, max \d\.\d\d, \d+\.\d\d% at the cap", off)
    assert (
        "  sync-batch: staleness 0.00; importance weights mean 1.000, max 1.00, 0.00%"
        in lines[lines.index(off) - 1]
    )
    ours = statistics.median(trained["in-flight-K=1", 0] + trained["in-flight-K=1", 1])
    [against] = [x for x in lines if x.startswith("TRL colocate on this workload")]
    assert "2.200 (2.000-2.600) s per step" in against, against
    assert against.endswith(f"{2.2 / ours:.2f}x TRL's"), against
    [stale] = [x for x in lines if x.startswith("in-flight K=1: step 6 accuracy ")]
    assert re.search(r"(inside|outside) the on-policy band \d", stale), stale
    assert stale.endswith(("target not reached", "x", "-", "sync-batch did not reach it")), stale
    # with a speed-up, one seed by seed as well: over sync-batch at the same seed, "-" where either
    # run did not reach the target
    if ", speed-up " in stale:
        seeds = re.search(r"; seed by seed (.*)$", stale)[1].split(", ")
        assert len(seeds) == 2 and all(re.fullmatch(r"\d+\.\d\dx|-", x) for x in seeds), stale
        reached = int(re.search(r"(\d) of 2 seeds reach the target", stale)[1])
        assert sum(x != "-" for x in seeds) <= reached, stale
    assert (tmp_path / "parity-cpu.png").stat().st_size > 10_000
    # the README's figure: accuracy against seconds alone
    assert (tmp_path / "parity-cpu-seconds.png").stat().st_size > 10_000
    # a run is kept for its metrics: no checkpoint (--no-checkpoint)
    assert (tmp_path / "runs" / "sync-batch-seed0" / "eval.json").exists()
    assert not (tmp_path / "runs" / "sync-batch-seed0" / "checkpoint").exists()
    # in pieces: a third seed's runs are left at --stop-after (1 ns: past before the first run
    # however fast the machine, where 1 ms was not), and a --reuse of finished runs reports them
    # without a server (none listens on port 1)
    flags = (*flags, "--reuse")
    cut = parity(server, tmp_path, *flags, "--seeds", "4", "--stop-after", "1e-9")
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert "--stop-after 1e-09 s: 4 runs left" in cut.stdout and "on-policy band" not in cut.stdout
    # seed 3 from another call (--first-seed 3 trains only its runs): until every seed's runs are in
    # --out, no report
    later = parity(
        server, tmp_path, *flags, "--seeds", "4", "--first-seed", "3", "--stop-after", "1e-9"
    )
    assert later.returncode == 0, later.stderr[-3000:]
    assert "--stop-after 1e-09 s: 2 runs left" in later.stdout
    runs = "sync-batch seed 2, in-flight K=1 seed 2, sync-batch seed 3, in-flight K=1 seed 3"
    assert f"no report: {runs}" in later.stdout
    again = parity(server, tmp_path, *flags, "--server-url", "http://127.0.0.1:1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[-6:] == lines[-6:]
    # the target: sync-batch's step-0 median accuracy + --gain, unless --target names one
    title = lines.index("held-out exact accuracy (pass@1), median (min-max) over 2 seeds")
    start = float(lines[title + 2].split()[1])  # sync-batch's, at step 0
    for extra, target in ((("--gain", "0.25"), start + 0.25), (("--target", "0.5"), 0.5)):
        run = parity(server, tmp_path, *flags, "--server-url", "http://127.0.0.1:1", *extra)
        [line] = [x for x in run.stdout.splitlines() if x.startswith("to held-out exact accuracy")]
        assert float(line.split()[-1].rstrip(":")) == pytest.approx(target, abs=0.0011), line
    # each seed's seconds to the target, at its own first evaluation at or above it: a target
    # that in-flight K=1's seed 0 reaches, at its best evaluation after step 0
    points = {}
    for seed in (0, 1):
        folder = tmp_path / "runs" / f"in-flight-K=1-seed{seed}"
        final = json.loads((folder / "eval.json").read_text())["pass@1"]
        evals = [
            (r["step"], r["eval"]["pass@1"]) for r in rows["in-flight-K=1", seed] if "eval" in r
        ]
        points[seed] = [*evals, (6, final)]
    target = max(accuracy for step, accuracy in points[0] if step > 0)
    each = []
    for seed in (0, 1):
        hit = [step for step, accuracy in points[seed] if accuracy >= target]
        if hit:
            each.append(sum(trained["in-flight-K=1", seed][: hit[0]]))
    run = parity(
        server, tmp_path, *flags, "--server-url", "http://127.0.0.1:1", "--target", str(target)
    )
    [stale] = [
        x for x in run.stdout.splitlines() if x.startswith("in-flight K=1: step 6 accuracy ")
    ]
    seconds = f"{statistics.median(each):.1f} ({min(each):.1f}-{max(each):.1f}) s"
    assert f"; {len(each)} of 2 seeds reach the target in {seconds}" in stale, stale


def test_the_parity_bench_refuses_a_side_that_trained_nothing(server, tmp_path, restore_weights):
    # the first run trained on nothing: the benchmark stops there
    run = parity(server, tmp_path, "--steps", "1", "--reward", "tests.my_rewards:zero")
    assert run.returncode == 1
    assert "no parity reported" in run.stderr
    assert "sync-batch seed 0: 100% of its groups had no advantage" in run.stderr
    assert "seed 1" not in run.stdout and "on-policy band" not in run.stdout


def trl_gpu(server, tmp_path, *flags):
    """bench/trl_gpu.py --smoke, train.py's side alone (TRL is not installed here), 3 steps of 4
    prompts x 8."""
    folders = ("--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"))
    flags = ("--server-url", server.base_url, *folders, *flags)
    return bench("trl_gpu.py", "--smoke", "--layouts", "ours", *flags)


def test_the_trl_bench_shows_that_ours_trained(server, tmp_path, restore_weights):
    # the packed variant: train.py's loop, its logprobs from bench/packing.py's packed forward
    run = trl_gpu(server, tmp_path, "--ours-variants", "sync-batch packed")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ours CPU sync-batch packed: frac_reward_zero_std=" in run.stdout
    assert "speed-up of ours CPU sync-batch packed" in run.stdout
    # each side's result as a JSON line of the output: bench/parity.py --trl-log reads it there
    [result] = [json.loads(x[7:]) for x in run.stdout.splitlines() if x.startswith("RESULT {")]
    assert result["name"] == "sync-batch packed" and len(result["step_s"]) == 3, result
    # its training per step, and per 1k completion tokens (the sides' completions differ in length)
    [speed] = [x for x in run.stdout.splitlines() if " s per 1k tokens (" in x]
    assert speed.startswith("  ours CPU sync-batch packed: ") and " tokens a step)" in speed, speed


def test_the_trl_bench_refuses_a_speedup_where_a_side_trained_nothing(
    server, tmp_path, restore_weights
):
    zero = "zero:reward=tests.my_rewards:zero"
    run = trl_gpu(server, tmp_path, "--ours-variants", "", "--ours-variant", zero)
    assert run.returncode == 1
    assert "ours CPU zero: 100% of its groups had no advantage" in run.stderr
    assert "speed-up of ours" not in run.stdout


def test_the_generation_bench_prints_a_levers_speed_and_its_share_of_the_bandwidth_bound(
    monkeypatch,
):
    """bench/generation.py's smoke run, one lever (an engine each): the settings vLLM resolved,
    then tokens/s as a fraction of the bound, whose arithmetic is checked by hand."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    from generation import bound

    # two sequences of a 10-token prompt, one at a time, 4 tokens each: a wave reads the weights
    # (100 bytes) 4 times and 10+0 ... 10+3 tokens of KV (1 byte a token); 1 byte/s
    assert bound([10], 2, 4, 1, weights=100, kv=1, bandwidth=1) == 8 / (2 * (400 + 46))
    command = [sys.executable, os.path.join(ROOT, "bench", "generation.py"), "--prompts", "4"]
    levers = "max-num-seqs 256,no logprobs + no detokenize"
    command += ["--n", "2", "--max-tokens", "16", "--rounds", "2", "--levers", levers]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    request = "seed None, logprobs 0, detokenize True"
    assert re.search(rf"^max-num-seqs 256: max_num_seqs 256, .*{request}$", run.stdout, re.M)
    # sampling levers: what each request asks for (here through vLLM's AsyncLLM itself)
    lever = re.escape("no logprobs + no detokenize: ")
    request = "seed None, logprobs None, detokenize False"
    assert re.search(rf"^{lever}max_num_seqs \d+, .*{request}$", run.stdout, re.M)
    assert any(x.startswith("no logprobs + no detokenize: ") and "tok/s" in x for x in lines)
    # where the host's time went: each process's CPU time per completion token, this one's and
    # the engine core's at least
    [host] = [x for x in lines if x.startswith("max-num-seqs 256: CPU us per completion token: ")]
    per_token = [float(v) for v in re.findall(r" ([\d.]+)(?:,|$)", host)]
    assert len(per_token) >= 2 and sum(per_token) > 0, host
    [speed] = [x for x in lines if x.startswith("max-num-seqs 256: ") and "tok/s" in x]
    found = re.fullmatch(
        r"max-num-seqs 256: (\d+) \((\d+)-(\d+)\) tok/s, ([\d.e+-]+) of the bound \(\d+ tok/s\)",
        speed,
    )
    assert found and int(found[2]) <= int(found[1]) <= int(found[3]), speed
    # the tiny model's bytes at 4.2 TB/s: far beyond a CPU
    assert 0 < float(found[4]) < 1, speed


def test_the_trainer_step_bench_checks_every_side_gives_one_gradient_then_times_them():
    command = [sys.executable, os.path.join(ROOT, "bench", "trainer_step.py"), "--seqs", "8"]
    run = subprocess.run(
        [*command, "--rounds", "1", "--vary", "--profile", "--compile"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [gap] = [line for line in run.stdout.splitlines() if line.startswith("the two gradients")]
    assert float(gap.split()[5]) < 1e-4, gap
    assert "ours_vs_trl=" in run.stdout
    # the compiled side: the same gradient, from graphs torch.compile made
    prefix = "the gradients of train.py and compiled differ by "
    [gap] = [x for x in run.stdout.splitlines() if x.startswith(prefix)]
    assert float(gap.removeprefix(prefix).split()[0]) < 1e-4, gap
    assert "compiled_vs_eager=" in run.stdout
    [graphs] = [x for x in run.stdout.splitlines() if x.startswith("compiled_graphs=")]
    assert int(graphs.split("=")[1]) > 0, graphs
    # train.py's speed; no MFU on a CPU, whose peak is not known
    lines = run.stdout.splitlines()
    tflops = dict(line.split("=") for line in lines if line.startswith("tflops"))
    assert 0 < float(tflops["tflops_useful"]) <= float(tflops["tflops"])
    assert "mfu=None" in run.stdout.splitlines()
    # one profiled round of each recipe, with the operators that took the most CPU time
    profiles = [line for line in run.stdout.splitlines() if line.startswith("profile ")]
    assert [line.split(":")[0] for line in profiles] == [
        "profile train.py",
        "profile TRL",
        "profile compiled",
    ]
    assert "aten::mm" in run.stdout


def test_the_trainer_step_bench_packs_sequences_to_the_same_gradient_with_no_flop_wasted():
    """--pack: bench/packing.py's packed forward (sdpa per sequence on a CPU), on a whole step of
    chat-sums in train.py's token budget. Apart from the compiled side: both together would
    compile a second time (the GPU runs them together)."""
    command = [sys.executable, os.path.join(ROOT, "bench", "trainer_step.py"), "--seqs", "8"]
    step = ("--step", "24", "--micro-tokens", "1600", "--task", "chat-sums", "--max-tokens", "96")
    run = subprocess.run(
        [*command, *step, "--rounds", "1", "--pack"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # the step's 24 sequences in forwards of at most 1,600 padded tokens; TRL's 8 at a time, the
    # same gradient
    [plan] = [x for x in run.stdout.splitlines() if x.startswith("a step: ")]
    sizes = json.loads(plan.split(" of ")[1].split(" sequences")[0])
    assert sum(sizes) == 24 and len(sizes) > 1, plan
    assert plan.endswith("TRL's of 8"), plan
    [gap] = [line for line in run.stdout.splitlines() if line.startswith("the two gradients")]
    assert float(gap.split()[5]) < 1e-4, gap
    prefix = "the gradients of train.py and packed differ by "
    [gap] = [x for x in run.stdout.splitlines() if x.startswith(prefix)]
    assert float(gap.removeprefix(prefix).split()[0]) < 1e-4, gap
    assert "packed_vs_padded=" in run.stdout
    [packed] = [x for x in run.stdout.splitlines() if x.startswith("packed: ")]
    speed = dict(pair.split("=") for pair in packed.removeprefix("packed: ").split())
    assert float(speed["tflops"]) == float(speed["tflops_useful"]) > 0, packed


def warm_start_bench(*flags):
    return bench("warm_start.py", *flags, smoke=())


def test_a_warm_start_milestone_is_the_shorter_warm_start(tmp_path):
    """bench/warm_start.py saves its milestones where train.builtin_model looks for them: the one at
    step 3 of a 6-step warm start must be the 3-step warm start itself, step for step."""
    import torch
    from safetensors.torch import load_file

    import train
    from local import tiny_model

    base = tiny_model()
    for steps in (3, 6):
        # the link and the folder it points at
        link = f"{base}-addition-{steps}"
        subprocess.run(["rm", "-rf", os.path.realpath(link), link], check=True)
    run = warm_start_bench("--steps", "6", "--every", "3")
    assert run.returncode == 0, run.stderr[-3000:]
    found = re.findall(r"warm start (\d+): pass@1=([\d.]+) greedy=([\d.]+)", run.stdout)
    assert [step for step, _, _ in found] == ["3", "6"]
    assert all(0 <= float(value) <= 1 for _, *values in found for value in values)
    # the same warm start, stopped at 3 steps, built apart from the milestones
    direct = train.warm_start(base, str(tmp_path / "direct"), train.Config(warm_start_steps=3))
    weights = load_file(f"{direct}/model.safetensors")
    milestone = load_file(f"{base}-addition-3/model.safetensors")
    assert milestone.keys() == weights.keys()
    assert all(torch.equal(milestone[name], weights[name]) for name in weights)
    # built already: measured again only once removed
    again = warm_start_bench("--steps", "6", "--every", "3")
    assert again.returncode == 1 and "is built already" in again.stderr
