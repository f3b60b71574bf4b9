"""The path a forker takes: a trainer machine without vLLM, one's own reward and data, --eval-only
on one's own model, checkpoints and --resume.

Run: .venv/bin/python -m pytest tests/test_forking.py
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import tasks
import train
from client import Episode
from local import save_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# imported first by every Python process that has this folder on PYTHONPATH: `import vllm` then
# raises ImportError, as on a trainer machine where vLLM is not installed
NO_VLLM = 'import sys\nsys.modules["vllm"] = None\n'
# a reward module of one's own: --reward rewards:<name>; `crash_after` simulates a trainer that
# dies mid-run (the reward raises once it has scored that many samples)
REWARDS = """
scored, crash_after = 0, None


def half(completion, row):
    return 0.5


def letters(completion, row):
    global scored
    scored += 1
    if crash_after is not None and scored > crash_after:
        raise RuntimeError("the trainer died")
    return sum(c.isalpha() for c in completion) / max(len(completion), 1)
"""


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("rewards", None)
    yield
    sys.modules.pop("rewards", None)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def eval_only(server, model_path, out, *args):
    """train.py --eval-only against the session server, 4 held-out prompts x 2 samples."""
    return train.main(
        ["--eval-only", "--server-url", server.base_url, "--model", model_path, "--out", str(out)]
        + ["--eval-prompts", "4", "--eval-n", "2", *args]
    )


# -- a trainer machine without vLLM ----------------------------------------------------------------
def test_train_py_runs_against_a_server_where_vllm_cannot_be_imported(
    server, model_path, tmp_path, restore_weights
):
    (tmp_path / "sitecustomize.py").write_text(NO_VLLM)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    check = [sys.executable, "-c", "import vllm"]
    assert subprocess.run(check, env=env, capture_output=True).returncode != 0
    steps = ["--steps", "2", "--prompts-per-step", "4", "--micro-batches", "1", "--group-size", "2"]
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--server-url", server.base_url]
        + ["--model", model_path, "--out", str(tmp_path / "run"), *steps],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


# -- your reward, your data ------------------------------------------------------------------------
def test_sequence_given_no_episode_says_what_is_wrong():
    with pytest.raises(ValueError, match="no episode"):
        train.to_sample({"prompt": "p", "answer": "3"}, None, tasks.answer_reward)


def test_the_documented_reward_signature_is_the_one_called(monkeypatch):
    """The README: the reward is tasks.reward(completion, answer); replace it, and the rest
    follows."""
    monkeypatch.setattr(tasks, "reward", lambda completion, answer: float(answer in completion))
    episode = Episode(
        token_ids=[5, 6, 7],
        loss_mask=[0, 1, 1],
        logprobs=[None, -0.1, -0.2],
        turns=[{"text": "is 42", "version": 0}],
    )
    assert (
        train.to_sample(
            {"prompt": "p", "answer": "42"},
            episode,
            train.Rewards(train.Config(model="m", reward="tasks:answer_reward")),
        ).reward
        == 1.0
    )


def test_a_reward_of_ones_own_passes_at_the_stated_threshold(server, model_path, tmp_path, rewards):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}+1="} for i in range(6)])
    common = ["--dataset", data, "--reward", "rewards:half", "--success-threshold"]
    assert eval_only(server, model_path, tmp_path, *common, "0.5")["pass@1"] == 1.0
    assert eval_only(server, model_path, tmp_path, *common, "0.6")["pass@1"] == 0.0


def test_every_dataset_row_is_checked_before_anything_is_generated(model_path, tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}, {"prompt": 3, "answer": "3"}]
    rows += [{"prompt": [{"role": "user"}], "answer": "4"}]
    # nothing listens there: generating anything would fail differently
    argv = ["--server-url", "http://127.0.0.1:9", "--model", model_path, "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        train.main([*argv, "--dataset", write_jsonl(tmp_path / "d.jsonl", rows)])
    message = str(e.value.code)
    assert 'row 1: ValueError: "answer" is null' in message and "row 0:" not in message
    assert 'row 2: ValueError: "prompt" must be' in message and "row 3: ValueError" in message
    # a line that is no JSON: the file, with the datasets library's words
    with pytest.raises(SystemExit) as e:
        train.main([*argv, "--dataset", write_jsonl(tmp_path / "bad.jsonl", [rows[0], "{"])])
    assert "bad.jsonl: " in str(e.value.code) and "JSON" in str(e.value.code)


# the same rows in each form --dataset reads; GSM8K's column names
GSM8K_ROWS = [{"question": f"{i}+1=", "answer": f"so #### {i + 1}", "n": i} for i in range(3)]


def dataset_forms(folder):
    """GSM8K_ROWS as a .jsonl, .json, .csv and .parquet file and a save_to_disk folder."""
    import datasets

    data = datasets.Dataset.from_list(GSM8K_ROWS)
    paths = [write_jsonl(folder / "d.jsonl", GSM8K_ROWS), str(folder / "d.json")]
    data.to_json(paths[1], lines=False)
    for path, write in [("d.csv", data.to_csv), ("d.parquet", data.to_parquet)]:
        write(str(folder / path))
        paths.append(str(folder / path))
    # a folder of two splits: --dataset-split picks one
    datasets.DatasetDict({"train": data, "test": data.select([0])}).save_to_disk(folder / "saved")
    return paths + [str(folder / "saved")]


def test_each_form_of_dataset_gives_the_rows_with_prompt_and_answer_beside_their_columns(tmp_path):
    cfg = train.Config(model="m", prompt_column="question", reward="tasks:gsm8k_reward")
    gsm8k = train.Rewards(cfg)
    for path in dataset_forms(tmp_path):
        rows = train.read_dataset(path, cfg)
        assert [r["prompt"] for r in rows] == ["0+1=", "1+1=", "2+1="], path
        assert [(r["question"], r["answer"], r["n"]) for r in rows] == [
            (r["question"], r["answer"], r["n"]) for r in GSM8K_ROWS
        ], path
        assert gsm8k("1", rows[0]) == {"reward": 1.0, "rewards": [1.0]}
    cfg.dataset_split = "test"
    assert len(train.read_dataset(str(tmp_path / "saved"), cfg)) == 1


def test_a_hub_name_and_its_config_go_to_load_dataset_with_the_split(tmp_path, monkeypatch):
    """The hub cannot be reached here: datasets.load_dataset is replaced by one that records its
    arguments and answers local rows."""
    import datasets

    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list(GSM8K_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = train.Config(
        model="m", prompt_column="question", dataset_split="test", reward="tasks:gsm8k_reward"
    )
    for name in ("openai/gsm8k:main", "openai/gsm8k"):
        rows = train.read_dataset(name, cfg)
        assert len(rows) == 3 and rows[0]["prompt"] == "0+1="
    assert calls == [
        (("openai/gsm8k", "main"), {"split": "test"}),
        (("openai/gsm8k", None), {"split": "test"}),
    ]


def test_conversational_prompts_are_taken_as_messages():
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
    row = {"prompt": messages, "answer": "2", "task": "t"}
    rewards = train.Rewards(train.Config(model="m"))
    train.check_row(row, rewards)
    for bad in ([], [{"role": "user"}], ["1+1="], [{"role": "user", "content": 2}]):
        with pytest.raises(ValueError, match="a list of"):
            train.check_row(row | {"prompt": bad}, rewards)


def test_eval_dataset_gives_the_held_out_prompts(tmp_path):
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": f"{i}+1=", "answer": "1"} for i in range(9)]
    )
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "9+9=", "answer": "18"}])
    cfg = train.Config(model="m", dataset=data, eval_dataset=held, eval_every=1, prompts_per_step=8)
    rows, held_out = train.load_data(cfg)
    assert len(rows) == 9 and [r["prompt"] for r in held_out] == ["9+9="]
    assert held_out[0]["task"] == "held"


def test_data_too_small_for_a_step_or_without_its_prompt_column_is_refused_before_a_server(
    tmp_path,
):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    cfg = train.Config(model="m", dataset=write_jsonl(tmp_path / "d.jsonl", rows))
    with pytest.raises(ValueError, match="6 training rows: fewer than --prompts-per-step"):
        train.load_data(cfg)
    assert (
        len(train.load_data(dataclasses.replace(cfg, prompts_per_step=6, micro_batches=2))[0]) == 6
    )
    # held-out prompts leave fewer
    with pytest.raises(ValueError, match="4 training rows"):
        train.load_data(
            dataclasses.replace(
                cfg, prompts_per_step=6, micro_batches=2, eval_every=5, eval_prompts=2
            )
        )
    columns = [{"question": "1+1=", "answer": "2"}]
    with pytest.raises(ValueError, match=r"no 'prompt' in \['question', 'answer'\]: --prompt-c"):
        train.read_dataset(write_jsonl(tmp_path / "q.jsonl", columns), cfg)


def test_a_reward_module_in_the_current_folder_is_found_and_one_that_raises_is_named(
    tmp_path, monkeypatch
):
    (tmp_path / "folder_rewards.py").write_text("def broken(completion, row):\n    return 1 / 0\n")
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "1"}])
    cfg = train.Config(model="m", dataset=data, reward="folder_rewards:broken")
    # the row check says which reward raised, and what
    with pytest.raises(ValueError, match="the reward folder_rewards:broken raised ZeroDivision"):
        train.read_dataset(data, cfg)


def test_a_reward_in_trls_form_scores_one_sample_as_a_batch_of_one_plain_or_conversational():
    cfg = train.Config(model="m", reward="tests.my_rewards:trl_correct,tasks:answer_reward")
    rewards = train.Rewards(cfg)
    assert rewards.names == ["trl_correct", "answer_reward"]
    chat = [{"role": "user", "content": "1+1="}]
    for prompt in ("1+1=", chat):
        assert rewards("2", {"prompt": prompt, "answer": "2"})["rewards"] == [1.0, 1.0]
        assert rewards(" 3", {"prompt": prompt, "answer": "2"})["rewards"][0] == 0.0


def test_a_reward_outside_0_1_is_refused_with_its_prompt(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p"}])
    cfg = train.Config(model="m", dataset=data, reward="tests.my_rewards:two")
    with pytest.raises(ValueError, match="2 for 'p'"):
        train.score(lambda completion, row: 2, "", {"prompt": "p"})
    with pytest.raises(ValueError, match="row 0"):
        train.read_dataset(cfg.dataset, cfg)


def test_evaluation_labels_a_dataset_by_its_rows_tasks_or_its_file(server, model_path, tmp_path):
    rows = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(4)]
    rows[0]["task"] = "zero"
    data = write_jsonl(tmp_path / "sums.jsonl", rows)
    result = eval_only(server, model_path, tmp_path, "--dataset", data)
    assert {k.split("/")[0] for k in result if "/" in k} == {"zero", "sums"}


# -- --eval-only evaluates what it is asked to -----------------------------------------------------
def test_eval_only_pushes_the_model_it_evaluates_and_records_its_version(
    server, model_path, tmp_path, restore_weights
):
    v0 = server.health()["version"]
    result = eval_only(server, model_path, tmp_path)
    record = json.loads((tmp_path / "eval.json").read_text())
    assert server.health()["version"] == v0 + 1
    assert record == {"model": model_path, "version": v0 + 1, **result}


def test_eval_only_of_a_model_folder_that_does_not_exist_is_an_error(server, tmp_path):
    with pytest.raises(SystemExit):
        eval_only(server, str(tmp_path / "no-such-model"), tmp_path)
    assert not (tmp_path / "eval.json").exists()


# -- checkpoints and --resume ----------------------------------------------------------------------
def parameters(run):
    return load_file(os.path.join(run, "checkpoint", "model.safetensors"))


def test_a_run_resumed_from_its_checkpoint_ends_where_an_unbroken_run_does(
    server, model_path, tmp_path, rewards, restore_weights
):
    """6 steps straight against a run that saves every 3 steps, dies in step 4 and is resumed:
    the same parameters (seeded requests, sync-batch). Tolerance: exactly equal (max |diff| 0)."""
    import rewards as module

    settings = dict(model=model_path, steps=6, prompts_per_step=4, micro_batches=2, group_size=4)
    settings |= dict(
        max_tokens=6, schedule="sync-batch", seed_requests=True, reward="rewards:letters"
    )
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    train.train(train.Config(**settings, out=straight), server)
    # 16 samples a step: it dies scoring step 4's, after step 3's metrics, and saves step 4
    module.scored, module.crash_after = 0, 4 * 16
    with pytest.raises(RuntimeError, match="died"):
        train.train(train.Config(**settings, out=broken, save_every=3), server)
    steps = [json.loads(line)["step"] for line in open(os.path.join(broken, "metrics.jsonl"))]
    assert steps == [0, 1, 2, 3]
    module.crash_after = None
    train.train(train.Config(**settings, resume=broken), server)
    steps = [json.loads(line)["step"] for line in open(os.path.join(broken, "metrics.jsonl"))]
    assert steps == [0, 1, 2, 3, 4, 5]
    ours, theirs = parameters(broken), parameters(straight)
    initial = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    assert any(not torch.equal(theirs[k], initial[k]) for k in theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in theirs) == 0


def test_a_resumed_run_takes_its_new_lr_and_its_queued_step_is_fresher(
    server, model_path, tmp_path, rewards, restore_weights, capsys
):
    """With --max-staleness 1, the step queued at the checkpoint is generated anew on the
    checkpoint's weights (staleness 0, where an unbroken run's is 1), as the README says; the
    optimizer's saved learning rate gives way to --lr, and the run says so. The checkpoint is the
    one the run saved as it stopped, of step 3."""
    import rewards as module

    settings = dict(model=model_path, steps=4, prompts_per_step=4, micro_batches=2, group_size=4)
    settings |= dict(max_tokens=6, max_staleness=1, reward="rewards:letters")
    run = str(tmp_path / "run")
    # dies scoring step 3's samples, and saves the checkpoint of step 3
    module.scored, module.crash_after = 0, 3 * 16
    with pytest.raises(RuntimeError, match="died"):
        train.train(train.Config(**settings, out=run, save_every=2), server)
    module.crash_after = None
    capsys.readouterr()
    train.train(train.Config(**settings, resume=run, lr=5e-4), server)
    assert "--lr 0.0005" in capsys.readouterr().err
    staleness = [json.loads(line)["staleness"] for line in open(os.path.join(run, "metrics.jsonl"))]
    assert staleness == [0, 1, 1, 0]
    state = torch.load(train.state_path(run), weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [5e-4]


def test_a_run_resumed_with_more_staleness_than_its_checkpoint_reaches_it(
    server, model_path, tmp_path, rewards, restore_weights
):
    """An on-policy checkpoint holds one queued step; resumed with --max-staleness 1, the run
    samples the missing step ahead and trains one step stale from then on."""
    settings = dict(model=model_path, prompts_per_step=4, micro_batches=2, group_size=4)
    settings |= dict(max_tokens=6, reward="rewards:letters")
    run = str(tmp_path / "run")
    train.train(train.Config(**settings, steps=2, out=run), server)
    train.train(train.Config(**settings, steps=5, max_staleness=1, resume=run), server)
    staleness = [json.loads(line)["staleness"] for line in open(os.path.join(run, "metrics.jsonl"))]
    assert staleness == [0, 0, 0, 1, 1]


def test_the_first_step_measures_the_mismatch_on_every_sample_even_when_none_trains(
    server, model_path, tmp_path, rewards, capsys
):
    """A reward that is always 0.5: every group is skipped, and yet the first step measures the
    mismatch on all its sampled tokens, and warns above --mismatch-warning (here any difference at
    all); the steps after it measure the tokens trained on: none."""
    settings = dict(model=model_path, steps=2, prompts_per_step=4, micro_batches=2, group_size=4)
    settings |= dict(max_tokens=6, reward="rewards:half", mismatch_warning=0.0)
    out = tmp_path / "run"
    train.train(train.Config(**settings, out=str(out)), server)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["frac_reward_zero_std"] for row in rows] == [1.0] * 2
    # step 0: every completion token (each ends in a sampled token, not in the prompt)
    assert [row["mismatch_tokens"] for row in rows] == [rows[0]["tokens"], 0]
    assert rows[0]["mismatch_mean"] > 0 and rows[1]["mismatch_mean"] is None
    assert "WARNING" in capsys.readouterr().err


def test_a_checkpoint_is_never_missing_whenever_saving_stops(model_path, tmp_path, monkeypatch):
    """save_model swaps the checkpoint in one rename: a save that dies at that rename leaves the
    old checkpoint whole."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    path = str(tmp_path / "checkpoint")
    save_model(model, tok, path, extra={"note.pt": 1})
    first = os.path.realpath(path)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)

    def dies(*args):
        raise KeyboardInterrupt("the process died")

    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(KeyboardInterrupt):
        save_model(model, tok, path, extra={"note.pt": 2})
    monkeypatch.undo()
    assert torch.load(os.path.join(path, "note.pt")) == 1
    assert AutoModelForCausalLM.from_pretrained(path).model.norm.weight.max() < 1.5
    save_model(model, tok, path, extra={"note.pt": 3})
    assert torch.load(os.path.join(path, "note.pt")) == 3
    # the folder it pointed at before is gone
    assert not os.path.exists(first)


def test_an_out_holding_a_run_is_never_overwritten(model_path, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    argv = ["--server-url", "http://127.0.0.1:9", "--model", model_path, "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert "--resume" in str(e.value.code)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_the_tiny_models_text_tokenises_back_into_the_tokens_it_sampled(server, model_path):
    """What an OpenAI session relies on: the agent sends the text back, and its tokens must be the
    sampled ones (spaces, tabs and newlines included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    [samples] = server.generate(["Count: 1 2\n"], n=16, max_tokens=64, seed=3)
    for c in samples:
        sampled = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        assert tok.encode(c.text, add_special_tokens=False) == sampled, c.text
    assert any(" " in c.text or "\n" in c.text for c in samples)
