"""Checkpoints and resumes: a run's config.yaml, --resume and --config, a run stopped by a
raising reward or by Ctrl-C and resumed, and saves that a Ctrl-C cannot leave half-written.

Run: .venv/bin/python -m pytest tests/test_resume.py
"""

import dataclasses
import functools
import importlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from test_train import tiny_run
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from local import save_model


def saved_run(folder, run):
    """A checkpoint's trainer_state.pt (nothing in it) and the run's config.yaml, in `folder`."""
    os.makedirs(folder / "checkpoint")
    torch.save({}, train.state_path(str(folder)))
    (folder / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(run)))


def test_resume_takes_every_flag_not_given_from_the_runs_config_and_refuses_a_new_data_order(
    model_path, tmp_path, capsys
):
    data = tmp_path / "my.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    run = tiny_run(model_path, tmp_path, dataset=str(data), reward="tests.my_rewards:boxed")
    run.save_every, run.lr = 20, 1e-5
    saved_run(tmp_path, run)
    cfg = train.parse_config(["--resume", str(tmp_path), "--steps", "200", "--group-size", "2"])
    assert (cfg.dataset, cfg.reward, cfg.save_every, cfg.lr) == (run.dataset, run.reward, 20, 1e-5)
    assert cfg.steps == 200 and cfg.model == str(tmp_path / "checkpoint")
    # each flag that changes is said; one given as it was is not
    said = capsys.readouterr().err.splitlines()
    assert "--steps 200 from here on (the run's: 120)" in said
    assert not [line for line in said if "group-size" in line]
    for changed in (["--group-size", "4"], ["--task", "sums"], ["--reward", "x:y"]):
        with pytest.raises(SystemExit):
            train.parse_config(["--resume", str(tmp_path), *changed])
        assert f"--resume: {changed[0]} {changed[1]} is not the run's" in capsys.readouterr().err


def test_a_resume_says_each_restored_flag_that_names_code_on_its_own_line(
    model_path, tmp_path, capsys
):
    """A tampered config.yaml: its reward and the server's tools run as code."""
    run = tiny_run(model_path, tmp_path, reward="builtins:exec", server_args="--tool sh=os:system")
    saved_run(tmp_path, run)
    train.parse_config(["--resume", str(tmp_path)])
    said = capsys.readouterr().err.splitlines()
    assert "--reward builtins:exec (the checkpoint's)" in said
    assert "--server-args --tool sh=os:system (the checkpoint's)" in said
    assert f"--model {tmp_path / 'checkpoint'} (the checkpoint's)" in said


def test_a_config_file_sets_flags_by_name_and_the_command_line_wins(tmp_path):
    settings = {"max_staleness": 1, "lr": 1e-5, "bf16": True, "checkpoint": False}
    settings["reward"] = ["tests.my_rewards:zero", "tasks:format_reward"]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(settings))
    cfg = train.parse_config(
        ["--config", str(tmp_path / "run.yaml"), "--model", "m", "--lr", "0.5"]
    )
    assert (cfg.max_staleness, cfg.lr, cfg.bf16, cfg.checkpoint) == (1, 0.5, True, False)
    assert cfg.reward == "tests.my_rewards:zero,tasks:format_reward"
    # --reward again adds functions
    again = [
        "--model",
        "m",
        "--reward",
        "tasks:math_reward",
        "--reward",
        "tasks:gsm8k_reward,tasks:format_reward",
    ]
    assert (
        train.parse_config(again).reward
        == "tasks:math_reward,tasks:gsm8k_reward,tasks:format_reward"
    )


def test_an_unknown_key_of_a_config_file_is_refused_naming_the_nearest_flag(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("max_stalenes: 1\n")
    with pytest.raises(SystemExit):
        train.parse_config(["--config", str(tmp_path / "run.yaml"), "--model", "m"])
    assert "max_stalenes is no flag (the nearest: max_staleness" in capsys.readouterr().err


def test_a_config_file_missing_or_not_a_mapping_is_one_line_and_an_empty_value_the_default(
    tmp_path, capsys
):
    path = tmp_path / "run.yaml"
    for text, said in [(None, "No such file"), ("- lr: 1\n", "not a mapping"), ("lr: [\n", "line")]:
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit):
            train.parse_config(["--config", str(path), "--model", "m"])
        err = capsys.readouterr().err
        # one line or YAML's own few, naming the file
        assert "error: " in err and str(path) in err and said in err and len(err.splitlines()) < 9
    # `eval_dataset:` with nothing after it leaves the flag unset, not the word "None"
    path.write_text("eval_dataset:\nlr: 0.5\n")
    cfg = train.parse_config(["--config", str(path), "--model", "m"])
    assert (cfg.eval_dataset, cfg.lr) == ("", 0.5)


def test_a_runs_config_yaml_holds_its_settings_and_starts_a_run_of_its_own(model_path, tmp_path):
    run = tiny_run(model_path, tmp_path / "a", max_staleness=1, reward="tasks:format_reward")
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    train.start_run(run, opt, random.Random(0), [{"prompt": "p"}] * 4)
    config = str(tmp_path / "a" / "config.yaml")
    cfg = train.parse_config(["--config", config, "--out", str(tmp_path / "b")])
    assert dataclasses.asdict(cfg) == dataclasses.asdict(run) | {"out": str(tmp_path / "b")}


def test_a_resume_at_a_smaller_max_staleness_trains_at_it_from_its_first_step(
    server, model_path, tmp_path, restore_weights, monkeypatch
):
    """A run at K = 2 stops at step 3 (its reward raises), with steps 3-5 queued in its checkpoint;
    resumed at K = 0, every step samples the weights it trains, the queued rows in their order."""
    rewards = importlib.import_module("tests.my_rewards")
    monkeypatch.setattr(rewards, "calls_left", 3 * 8)
    settings = {"steps": 6, "reward": "tests.my_rewards:flaky"}
    with pytest.raises(RuntimeError, match="raised KeyError"):
        train.train(tiny_run(model_path, tmp_path, max_staleness=2, **settings), server)
    queued = torch.load(train.state_path(str(tmp_path)))["rows"]
    assert len(queued) == 3
    monkeypatch.setattr(rewards, "calls_left", math.inf)
    resumed = tiny_run(model_path, tmp_path, max_staleness=0, resume=str(tmp_path), **settings)
    history = train.train(resumed, server)
    assert [h["step"] for h in history] == list(range(6))
    assert [h["staleness_max"] for h in history[3:]] == [0, 0, 0]


@pytest.mark.parametrize("update_mode", ["drain", "in-flight"])
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_a_resumed_stale_run_samples_each_step_on_the_weights_its_schedule_promises(
    server, model_path, tmp_path, restore_weights, max_staleness, update_mode
):
    """A run at K = 1 or 2 stops after 2 steps; resumed, its K + 1 queued steps are submitted at
    once on the resumed weights and train back to back (every reward 0: no backward, as fast as a
    step goes), while the steps after them are submitted. Every step completes, its samples K
    versions behind the weights it trains (fewer for the queued steps): exactly so under drain
    updates, at most so in flight, where a push may move a request on to newer weights."""
    settings = {"max_staleness": max_staleness, "update_mode": update_mode}
    settings |= {"reward": "tests.my_rewards:zero", "prompts_per_step": 32}
    train.train(tiny_run(model_path, tmp_path, steps=2, **settings), server)
    steps = 2 + max_staleness + 3
    resumed = tiny_run(model_path, tmp_path, steps=steps, resume=str(tmp_path), **settings)
    history = train.train(resumed, server)
    assert [h["step"] for h in history] == list(range(steps))
    promised = [min(i, max_staleness) for i in range(steps - 2)]
    if update_mode == "drain":
        # every token of the step: its mean and its largest staleness are the promised one
        assert [(h["staleness"], h["staleness_max"]) for h in history[2:]] == [
            (behind, behind) for behind in promised
        ]
    assert all(h["staleness_max"] <= behind for h, behind in zip(history[2:], promised))


def test_a_reward_that_raises_names_the_row_and_the_completion_and_leaves_the_run_resumable(
    server, model_path, tmp_path, restore_weights
):
    """train.py stops at step 2, where its reward raises; resumed, the run goes on to its end."""
    out = str(tmp_path / "run")
    flags = ["--server-url", server.base_url, "--model", model_path, "--out", out, "--steps", "4"]
    flags += ["--prompts-per-step", "4", "--micro-batches", "2", "--group-size", "2"]
    flags += ["--reward", "tests.my_rewards:flaky"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # step 2's first sample raises
    env = {**os.environ, "FLAKY_CALLS": str(2 * 8)}
    command = [sys.executable, os.path.join(root, "train.py"), *flags]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert run.returncode == 1
    [message] = [line for line in run.stderr.splitlines() if line.startswith("RuntimeError: ")]
    assert "the reward tests.my_rewards:flaky raised KeyError: 'solution'" in message
    # the completion's repr: in double quotes where it holds a single one
    # the row by reprlib (keys sorted, long values cut)
    assert "scoring the completion " in message and "of the row {'answer': '" in message
    assert "'prompt': '" in message
    # the checkpoint of step 2, the plot of steps 0 and 1, and nothing half-saved beside them
    assert torch.load(train.state_path(out))["step"] == 2
    assert os.path.getsize(os.path.join(out, "plot.png")) > 10_000
    checkpoint = os.readlink(os.path.join(out, "checkpoint"))
    files = [f for f in os.listdir(out) if not f.startswith("events.out.tfevents.")]
    assert sorted(files) == sorted(
        ["checkpoint", checkpoint, "config.yaml", "metrics.jsonl", "plot.png"]
    )
    history = train.main(["--resume", out, "--server-url", server.base_url])
    assert [h["step"] for h in history] == [0, 1, 2, 3]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_run_stopped_by_ctrl_c_or_sigterm_says_in_one_line_where_it_goes_on_and_goes_on_there(
    server, model_path, tmp_path, restore_weights, stop
):
    """train.py, Ctrl-C (SIGINT) or a scheduler's SIGTERM once two steps are logged: the run saves
    its checkpoint and plot and says so in one line (no traceback, no leak reports of nanobind's);
    resumed, it goes on from the step that line names."""
    out = tmp_path / "run"
    flags = ["--server-url", server.base_url, "--model", model_path, "--out", str(out)]
    flags += ["--steps", "1000", "--prompts-per-step", "4", "--micro-batches", "2"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        # -X faulthandler: a run that does not stop prints every thread's stack on SIGABRT
        script = os.path.join(root, "train.py")
        command = [sys.executable, "-X", "faulthandler", script, *flags, "--group-size", "2"]
        # an xdist worker ignores SIGINT, and a child that starts with it ignored keeps it so
        # (Python then installs no KeyboardInterrupt): the child's is the default, as in a shell
        default = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
        run = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=err, cwd=root, preexec_fn=default
        )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert run.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
        time.sleep(0.05)
    run.send_signal(stop)
    try:
        code = run.wait(timeout=120)
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGABRT)
        run.wait(timeout=30)
        pytest.fail(f"still running 120 s after {stop.name}: {stderr.read_text()[-6000:]}")
    assert code == 130
    step = torch.load(train.state_path(str(out)))["step"]
    said = stderr.read_text()
    assert said.splitlines()[-1] == (
        f"stopped at step {step}; checkpoint in {out}; go on with: python train.py --resume {out}"
    )
    assert "Traceback" not in said and "nanobind" not in said, said[-3000:]
    logged = [json.loads(line)["step"] for line in open(metrics)]
    # the steps logged, and one more if the Ctrl-C came during a step's push or its log
    assert step >= 2 and logged == list(range(len(logged))) and step - len(logged) in (0, 1)
    assert os.path.getsize(out / "plot.png") > 10_000
    resumed = tiny_run(model_path, out, steps=step + 1, resume=str(out))
    assert train.train(resumed, server)[-1]["step"] == step


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_during_the_optimizers_step_waits_for_the_step_and_its_queue(stop):
    """A Ctrl-C or SIGTERM that lands while Sampler.advance steps the optimizer and moves the
    queue (stops_deferred's block) stops the run once both are done, with the checkpoint of the
    next step to leave; the handlers are the run's own again afterwards."""
    stops = (signal.SIGINT, signal.SIGTERM)
    # as __main__ sets them: both a KeyboardInterrupt
    before = [signal.signal(s, signal.default_int_handler) for s in stops]
    done = []
    try:
        with pytest.raises(KeyboardInterrupt), train.stops_deferred():
            os.kill(os.getpid(), stop)
            time.sleep(0.1)  # the handler has run by now, and held the stop
            done.append("the block's rest")
        assert done == ["the block's rest"]
        assert signal.getsignal(stop) is signal.default_int_handler
    finally:
        for s, handler in zip(stops, before):
            signal.signal(s, handler)


def test_rows_whose_answer_is_null_or_empty_are_refused_with_their_index(tmp_path):
    data = tmp_path / "my.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "a", "answer": None}]
    rows += [{"prompt": "b", "answer": ""}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError) as refused:
        train.read_dataset(str(data), train.Config(model="m"))
    assert 'row 1: ValueError: "answer" is null' in str(refused.value)
    assert 'row 2: ValueError: "answer" is ""' in str(refused.value)


def test_a_save_stopped_by_ctrl_c_leaves_no_partial_folder(model_path, tmp_path):
    """A tokenizer whose save is interrupted stands for a Ctrl-C that lands mid-save (a real one
    cannot be timed to land there)."""

    class Interrupted:
        def save_pretrained(self, folder):
            raise KeyboardInterrupt

    model = AutoModelForCausalLM.from_pretrained(model_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    path = str(tmp_path / "checkpoint")
    save_model(model, tok, path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        save_model(model, Interrupted(), path)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_checkpoint_saved_as_a_plain_folder_is_replaced_by_the_next_save(model_path, tmp_path):
    """Checkpoints saved before the swap by a symbolic link are plain folders."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    path = str(tmp_path / "checkpoint")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    save_model(model, tok, path, extra={"note.pt": 1})
    assert os.path.islink(path) and torch.load(os.path.join(path, "note.pt")) == 1
    # the plain folder is gone: the link and the folder it names
    assert sorted(os.listdir(tmp_path)) == sorted(["checkpoint", os.readlink(path)])
