"""Every ```python and ```bash block of README.md runs as a user would paste it, unless the line
right before its fence is `<!-- not run: REASON -->` (the test then shows as skipped, with REASON).

- python blocks: each in a fresh `python -c` process, from the repository root;
- bash blocks: `bash -euo pipefail` from the repository root, with .venv/bin first on PATH;
- each with a timeout. A block that talks to "a server on port 8000" (http://127.0.0.1:8000 or
  localhost:8000, as the README writes it) talks to the test session's server, on whatever port
  that has: the README stays as a user types it.

Run: .venv/bin/python -m pytest tests/test_readme.py
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(python|bash)\n(.*?)^```$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (.*) -->")
PORT_8000 = re.compile(r"(?:127\.0\.0\.1|localhost):8000")


def readme_blocks():
    """A pytest.param (language, code) per block, named README.md:LINE, skipped if marked."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    for block in FENCE.finditer(text):
        line = text.count("\n", 0, block.start()) + 1
        before = text[: block.start()].rstrip("\n").rpartition("\n")[2]
        reason = NOT_RUN.fullmatch(before.strip())
        marks = pytest.mark.skip(reason=reason[1]) if reason else ()
        yield pytest.param(*block.groups(), id=f"README.md:{line}", marks=marks)


@pytest.mark.parametrize("language,code", readme_blocks())
def test_readme_block_runs(language, code, server):
    host_port = server.base_url.removeprefix("http://")
    code = PORT_8000.sub(host_port, code)
    env = {
        **os.environ,
        "PATH": os.path.join(ROOT, ".venv", "bin") + os.pathsep + os.environ["PATH"],
    }
    command = (
        [sys.executable, "-c", code]
        if language == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"


def test_the_readme_resume_example_goes_on_with_the_runs_settings(
    server, model_path, tmp_path, restore_weights
):
    """The README's run of one's own data and reward, then its --resume, as written, with flags
    appended that make it a tiny run on the session server: the resumed run trains on the same
    data, reward and settings, and says what it changed."""
    with open(os.path.join(ROOT, "README.md")) as f:
        commands = [
            line for line in f if line.startswith("python train.py") and "runs/mine" in line
        ]
    first, resume = (shlex.split(line)[2:] for line in commands[:2])
    assert "--resume" in resume
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "my.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tiny = ["--server-url", server.base_url, "--model", model_path, "--steps", "2"]
    tiny += ["--prompts-per-step", "4", "--micro-batches", "2", "--group-size", "2"]
    # tests/my_rewards.py is the README's my_rewards.py
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")}
    runs = []
    # the server too is the run's
    for flags in (first + tiny, resume + ["--steps", "3"]):
        command = [sys.executable, os.path.join(ROOT, "train.py"), *flags]
        run = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-3000:]
        runs.append(run)
    # train.py prints its settings first
    settings = [json.loads(run.stdout.splitlines()[0]) for run in runs]
    kept = ("dataset", "reward", "save_every", "lr", "prompts_per_step", "group_size", "task")
    assert [settings[1][k] for k in kept] == [settings[0][k] for k in kept]
    assert settings[1]["reward"] == "my_rewards:boxed" and settings[1]["save_every"] == 20
    assert "--steps 3 from here on (the run's: 2)" in runs[1].stderr
    metrics = [json.loads(line) for line in open(tmp_path / "runs" / "mine" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1, 2]


def test_the_readme_run_yaml_trains_on_conversational_rows_with_two_rewards(
    server, model_path, tmp_path, restore_weights
):
    """examples/run.yaml, the README's GPU setup, with what this machine lacks given again on the
    command line (the flags win): the built-in model with a chat template, a local GSM8K-style
    file, the session server. Its conversations are rendered, both rewards are logged apart."""
    rows = [{"question": f"{a}+{a}=", "answer": f"{a} and {a}\n#### {2 * a}"} for a in range(12)]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--config", os.path.join(ROOT, "examples", "run.yaml"), "--model", model_path]
    flags += ["--chat-template", os.path.join(ROOT, "tests", "chat_template.jinja")]
    flags += ["--dataset", "gsm8k.jsonl", "--server-url", server.base_url, "--dtype", "float32"]
    flags += ["--device", "cpu", "--no-bf16", "--steps", "3", "--max-tokens", "8", "--lr", "1e-5"]
    flags += ["--prompts-per-step", "4", "--group-size", "2", "--eval-every", "2"]
    flags += ["--eval-prompts", "2", "--eval-n", "2", "--out", "gsm8k"]
    command = [sys.executable, os.path.join(ROOT, "train.py"), *flags]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = [json.loads(line) for line in open(tmp_path / "gsm8k" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all("reward/gsm8k_reward" in m and "reward/format_reward" in m for m in metrics)
    # the prompt as the model saw it: the system prompt first, the question the user's message
    sample = json.loads(open(tmp_path / "gsm8k" / "eval_samples.jsonl").readline())
    assert "Think inside <think></think>" in sample["prompt"] and "0+0=" in sample["prompt"]
