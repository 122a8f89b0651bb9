"""A user's runs are never silently overwritten, mixed or misattributed (docs/troubleshooting.md, "Runs and their
files"): one run per checkpoint files, an unfinished run kept, changed flags applied or refused, damaged weights
named, a stop during the evaluation honoured, data quirks handled."""

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from in_process import run_main
from model.model_minimind import MiniMindForCausalLM
from trainer import train_grpo
from trainer import evaluation
from trainer.infra.checkpoints import changed_flags, claim_save_dir, save_checkpoint
from trainer.infra.weights import build_config, load_weights

TINY = [
    "--hidden_size",
    "64",
    "--num_hidden_layers",
    "2",
    "--from_weight",
    "tiny",
    "--max_gen_len",
    "8",
    "--eval_interval",
    "0",
    "--reward_model_path",
    "none",
]
GRPO = TINY + ["--batch_size", "2", "--num_generations", "2", "--max_steps", "4", "--save_interval", "1"]


def run(args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def harness(harness_flags, script_flags):
    """tests/support/run_patched.py grpo (kills at a checkpoint, traces the prompts of every step)."""
    return run(
        [os.path.join("tests", "support", "run_patched.py"), "grpo", "--text_reward"]
        + harness_flags
        + ["--"]
        + script_flags
    )


def folder_with_weights(tmp_path, tiny_weights, name="run"):
    folder = tmp_path / name
    folder.mkdir()
    for file_name in ("tiny_64.pth", "tiny_64.tokenizer.json"):
        shutil.copy(os.path.join(tiny_weights[0], file_name), folder / file_name)
    return folder


def read_jsonl(path):
    return [json.loads(line) for line in open(path).read().splitlines()]


# ----------------------------------------------------------------------------- an unfinished run is kept
def test_a_fresh_run_refuses_to_replace_an_unfinished_run_and_replaces_a_finished_one(
    tmp_path, tiny_weights, small_data
):
    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + ["--save_dir", str(folder), "--data_path", small_data]
    killed = harness(["--kill_after_save", "1"], flags)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resume_file = folder / "grpo_64_resume.pth"
    before = resume_file.read_bytes()
    fresh = run_main("train_grpo", flags)
    assert fresh.returncode != 0
    assert f"{resume_file} holds an unfinished run (step 1 of 4)" in fresh.stderr
    assert "--from_resume 1" in fresh.stderr and "step 1/" not in fresh.stdout
    assert resume_file.read_bytes() == before  # nothing replaced
    resumed = run_main("train_grpo", flags + ["--from_resume", "1"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = run_main("train_grpo", flags)  # the run is finished: its files may be replaced
    assert again.returncode == 0, again.stderr[-2000:]
    assert "saved step 4" in again.stdout


def test_a_fresh_run_refuses_a_run_dir_holding_another_runs_metrics(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + [
        "--save_dir",
        str(folder),
        "--data_path",
        small_data,
        "--max_steps",
        "1",
        "--run_dir",
        str(tmp_path / "curves"),
    ]
    first = run_main("train_grpo", flags)
    assert first.returncode == 0, first.stderr[-2000:]
    metrics_file = tmp_path / "curves" / "metrics.jsonl"
    before = metrics_file.read_bytes()
    second = run_main("train_grpo", flags + ["--seed", "1"])
    assert second.returncode != 0
    assert f"--run_dir {tmp_path / 'curves'} already holds another run's metrics ({metrics_file})" in second.stderr
    assert "loaded weights" not in second.stdout and metrics_file.read_bytes() == before  # refused at start-up


def test_two_runs_on_the_same_checkpoint_files_the_second_is_refused(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + ["--save_dir", str(folder), "--data_path", small_data]
    lock = claim_save_dir(train_grpo.parse_args(flags), "grpo", total_steps=4)  # this process: the first run
    try:
        second = run(["trainer/train_grpo.py"] + flags)
        assert second.returncode != 0
        assert f"{folder} is in use by another run writing grpo checkpoints (PID {os.getpid()}" in second.stderr
        assert not (folder / "grpo_64_resume.pth").exists()
        other_name = run(["trainer/train_grpo.py"] + flags + ["--save_weight", "other", "--max_steps", "1"])
        assert other_name.returncode == 0, other_name.stderr[-2000:]  # other checkpoint files in the same folder
    finally:
        lock.close()
    after = run(["trainer/train_grpo.py"] + flags + ["--max_steps", "1"])  # the lock went with its holder
    assert after.returncode == 0, after.stderr[-2000:]


# ----------------------------------------------------------------------------- changed flags on resume
def test_a_changed_learning_rate_and_batch_size_are_applied_on_resume(tmp_path, tiny_weights, small_data):
    straight = folder_with_weights(tmp_path, tiny_weights, "straight")
    flags = GRPO + ["--data_path", small_data]
    done = harness(["--trace_dir", str(straight / "trace")], flags + ["--save_dir", str(straight)])
    assert done.returncode == 0, done.stderr[-2000:]
    order = [i for batch in read_jsonl(straight / "trace" / "indices_rank0.jsonl") for i in batch]  # epoch 0's order

    folder = folder_with_weights(tmp_path, tiny_weights, "changed")
    common = ["--save_dir", str(folder), "--run_dir", str(folder / "run")]
    killed = harness(["--kill_after_save", "2"], flags + common)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = harness(
        ["--trace_dir", str(folder / "trace")],
        flags + common + ["--from_resume", "1", "--learning_rate", "1e-4", "--batch_size", "4"],
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "--learning_rate 2e-05 -> 0.0001: the learning-rate schedule is rebuilt" in resumed.stdout
    assert "--batch_size 2 -> 4: the data position is kept in prompts" in resumed.stdout
    # 2 steps of 2 prompts = 4 prompts seen = 1 step of 4: the resumed run continues with prompts 4..7 of the order
    first = read_jsonl(folder / "trace" / "indices_rank0.jsonl")[0]
    assert first == order[4:8]
    rows = [r for r in read_jsonl(folder / "run" / "metrics.jsonl") if "learning_rate" in r]
    step_2_of_4 = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 1 / 4))  # cosine at update 1 of 4 (step rescaled 2 -> 1)
    assert rows[2]["step"] == 2 and rows[2]["learning_rate"] == pytest.approx(1e-4 * step_2_of_4, rel=1e-6)


def test_a_flag_a_resume_cannot_take_is_refused_before_any_model_is_built(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + ["--data_path", small_data, "--save_dir", str(folder)]
    killed = harness(["--kill_after_save", "1"], flags)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    refused = run_main("train_grpo", flags + ["--from_resume", "1", "--seed", "7"])
    assert refused.returncode != 0
    assert "was saved with --seed 42 but this run has --seed 7, which a resume cannot take" in refused.stderr
    assert "pass --seed 42 to resume" in refused.stderr and "loaded weights" not in refused.stdout


def test_changed_flags_say_how_each_applies():
    args = train_grpo.parse_args(["--learning_rate", "1e-4", "--beta", "0.2", "--use_wandb", "1"])
    saved = dict(vars(train_grpo.parse_args([])), use_wandb=0)
    lines = changed_flags(saved, args)
    assert lines == [
        "resuming with a changed flag: --beta 0.1 -> 0.2: applies from the first resumed step",
        "resuming with a changed flag: --learning_rate 2e-05 -> 0.0001: the learning-rate schedule is "
        "rebuilt from this run's flags at the resumed update",
    ]


# ----------------------------------------------------------------------------- metrics of a resumed run
def test_a_copied_run_resumes_into_its_own_metrics(tmp_path, tiny_weights, small_data):
    original = folder_with_weights(tmp_path, tiny_weights, "original")
    flags = GRPO + ["--data_path", small_data]
    killed = harness(["--kill_after_save", "2"], flags + ["--save_dir", str(original)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    (original_metrics,) = (original / "runs").glob("*/metrics.jsonl")
    lines_before = original_metrics.read_text()
    resumed = run_main("train_grpo", flags + ["--save_dir", str(copy), "--from_resume", "1"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert original_metrics.read_text() == lines_before  # the original run is untouched
    copied_metrics = copy / original_metrics.relative_to(original)
    assert [r["step"] for r in read_jsonl(copied_metrics)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- damaged weights, full disk
def test_damaged_weights_are_refused_naming_the_file_and_the_tensor(tmp_path):
    model = MiniMindForCausalLM(build_config(64, 1, 0))
    state_dict = {k: v.clone() for k, v in model.state_dict().items()}
    state_dict["model.layers.0.mlp.up_proj.weight"][3, :5] = float("nan")
    damaged = tmp_path / "damaged.pth"
    torch.save(state_dict, damaged)
    with pytest.raises(
        ValueError,
        match=r"refusing to load .*damaged\.pth .*: model\.layers\.0\.mlp\.up_proj\.weight "
        r"holds 5 NaN or inf values",
    ):
        load_weights(MiniMindForCausalLM(build_config(64, 1, 0)), str(damaged))
    truncated = tmp_path / "truncated.pth"
    torch.save(model.state_dict(), truncated)
    truncated.write_bytes(truncated.read_bytes()[:20000])
    with pytest.raises(ValueError, match=r"truncated\.pth cannot be read as MiniMind weights .*copy it again"):
        load_weights(MiniMindForCausalLM(build_config(64, 1, 0)), str(truncated))


def test_weights_and_resume_file_are_replaced_together_or_not_at_all(tmp_path, monkeypatch):
    model = MiniMindForCausalLM(build_config(64, 1, 0))
    args = train_grpo.parse_args(
        [
            "--save_dir",
            str(tmp_path),
            "--save_weight",
            "pair",
            "--hidden_size",
            "64",
            "--num_hidden_layers",
            "1",
            "--reward_model_path",
            "none",
        ]
    )
    progress = {
        "step": 1,
        "total_steps": 4,
        "epoch": 0,
        "batch_in_epoch": 1,
        "lr_schedule_step": 1,
        "run_dir": None,
        "wandb_id": None,
        "bad_steps_in_a_row": 0,
    }
    save_checkpoint(args, "grpo", model.config, {"model": model}, progress, {"pair": model})
    before = {name: (tmp_path / name).read_bytes() for name in ("pair_64.pth", "pair_64_resume.pth")}
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    real_save = torch.save

    def full_disk_for_the_resume_file(obj, path):
        if "_resume.pth" in str(path):
            raise OSError(28, "No space left on device")
        return real_save(obj, path)

    monkeypatch.setattr(torch, "save", full_disk_for_the_resume_file)
    with pytest.raises(OSError, match=r"could not write .*pair_64_resume\.pth: the disk is full"):
        save_checkpoint(args, "grpo", model.config, {"model": model}, dict(progress, step=2), {"pair": model})
    monkeypatch.setattr(torch, "save", real_save)
    after = {name: (tmp_path / name).read_bytes() for name in before}
    assert after == before  # the weights written first were not put in place either


# ----------------------------------------------------------------------------- a stop during the evaluation
def test_sigterm_during_the_step_0_evaluation_stops_before_the_first_step(
    tiny_weights, small_data, tmp_path, monkeypatch, capsys, restore_signals
):
    calls = {"n": 0}
    real_rewards = evaluation.calculate_rewards

    def rewards_then_sigterm(*args, **kwargs):  # a SIGTERM arrives while the first evaluation batch is scored
        calls["n"] += 1
        os.kill(os.getpid(), signal.SIGTERM)
        return real_rewards(*args, **kwargs)

    monkeypatch.setattr(evaluation, "calculate_rewards", rewards_then_sigterm)
    eval_flags = ["--eval_interval", "2", "--eval_num_prompts", "200", "--eval_data_path", small_data]
    train_grpo.main(
        GRPO
        + eval_flags
        + ["--save_dir", tiny_weights[0], "--data_path", small_data, "--run_dir", str(tmp_path / "run")]
    )
    out = capsys.readouterr().out
    assert calls["n"] == 1  # the evaluation stopped at its next batch (48 prompts in 1 batch: sampled pass only)
    assert "eval step 0 | stopped by a stop request before its end; no result recorded" in out
    assert "stopped by SIGTERM at step 0; resume with:" in out
    assert "step 1/" not in out and not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- data and tokenizers
def test_a_byte_order_mark_is_read_and_thinking_markers_in_a_user_turn_stay_text(tokenizer, tmp_path):
    from dataset.lm_dataset import RLAIFDataset

    think_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")}
    counts = []
    for name, question in (("marked", "what is </think> 2+2? <think>"), ("plain", "what is 2+2?")):
        data = tmp_path / f"{name}.jsonl"
        row = {"conversations": [{"role": "user", "content": question}, {"role": "assistant", "content": "4"}]}
        data.write_bytes(b"\xef\xbb\xbf" + json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")  # Notepad's BOM
        dataset = RLAIFDataset(str(data), tokenizer, thinking_ratio=1.0)
        assert dataset[0]["answer"] == "4"
        ids = tokenizer(dataset[0]["prompt"], add_special_tokens=False)["input_ids"]
        counts.append(sum(i in think_ids for i in ids))
    assert counts[0] == counts[1] == 1  # only the template's own <think> that opens the answer's thinking


def test_rows_without_a_reference_answer_are_named(tokenizer, tmp_path, capsys):
    from dataset.lm_dataset import RLAIFDataset, check_prompt_count

    data = tmp_path / "mixed.jsonl"
    rows = [
        {"conversations": [{"role": "user", "content": f"{i} + 1 = ?"}, {"role": "assistant", "content": a}]}
        for i, a in enumerate(["1", "", "3", " "])
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    check_prompt_count(RLAIFDataset(str(data), tokenizer), str(data), 2, 1, 256, answer_reward_weight=2.0)
    out = capsys.readouterr().out
    assert "2 of 4 rows have no reference answer (lines 2, 4)" in out and "--answer_reward_weight 0" in out


def test_a_checkpoint_without_its_tokenizer_record_trusts_a_named_tokenizer(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    os.remove(folder / "tiny_64.tokenizer.json")  # copied without the record, as upstream users copy a .pth
    flags = GRPO + ["--data_path", small_data, "--save_dir", str(folder), "--max_steps", "1"]
    unnamed = run_main("train_grpo", flags)
    assert unnamed.returncode != 0
    assert "Copy the record beside the weights, or name the tokenizer" in unnamed.stderr
    named = run_main("train_grpo", flags + ["--tokenizer_path", "model"])
    assert named.returncode == 0, named.stderr[-2000:]
    assert "trusting --tokenizer_path model as named (441 tokens for an embedding of 6400 rows)" in named.stdout


def test_an_atomic_pair_write_names_the_full_disk(tmp_path, monkeypatch):
    from trainer.infra import files

    monkeypatch.setattr(files.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(OSError, match=r"could not write .*b\.pth: the disk is full \(0\.0 MiB free"):
        files.atomic_write(
            {
                str(tmp_path / "a.pth"): functools.partial(torch.save, {"w": torch.ones(2)}),
                str(tmp_path / "b.pth"): lambda path: (_ for _ in ()).throw(OSError(5, "I/O error")),
            }
        )
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- metrics after a crash, full disk
def test_rows_past_the_checkpoint_are_moved_aside_on_resume(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + [
        "--save_dir",
        str(folder),
        "--data_path",
        small_data,
        "--save_interval",
        "2",
        "--run_dir",
        str(folder / "run"),
    ]
    killed = harness(["--kill_before_step", "4"], flags)  # steps 1-3 logged, the checkpoint is step 2's
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    metrics_file = folder / "run" / "metrics.jsonl"
    row_3 = metrics_file.read_text().splitlines()[2]
    assert json.loads(row_3)["step"] == 3
    resumed = harness([], flags + ["--from_resume", "1"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(metrics_file)] == [1, 2, 3, 4]  # step 3 once: the resumed run's
    kept_aside = folder / "run" / "metrics.jsonl.dropped-after-step-2"
    assert kept_aside.read_text() == row_3 + "\n"
    assert f"{metrics_file}: 1 rows after the checkpoint's step 2 (steps 3) moved to {kept_aside}" in resumed.stdout


def test_a_full_disk_names_the_metrics_file_and_a_cut_row_is_not_appended_to(tmp_path):
    from types import SimpleNamespace
    from trainer.infra.metrics import MetricsWriter, open_metrics

    full = tmp_path / "full"
    full.mkdir()
    os.symlink("/dev/full", full / "metrics.jsonl")  # the kernel answers every write with ENOSPC
    with pytest.raises(OSError, match=rf"metrics row of step 7 to {full / 'metrics.jsonl'}: the disk is full"):
        MetricsWriter(str(full)).log({"step": 7, "reward": 0.5})

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cut = b'{"step": 3, "rew'  # what a process killed mid-row (or a full disk) leaves
    (run_dir / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2}\n' + cut)
    args = SimpleNamespace(
        run_dir=str(run_dir),
        save_dir=str(tmp_path),
        save_weight="grpo",
        use_wandb=0,
        wandb_project="p",
        tracker="wandb",
    )
    _, writer = open_metrics(args, {"step": 2, "saved_step": 2})
    writer.log({"step": 3, "reward": 0.25})
    assert (run_dir / "metrics.jsonl").read_bytes() == b'{"step": 1}\n{"step": 2}\n{"step": 3, "reward": 0.25}\n'
    assert (run_dir / "metrics.jsonl.dropped-after-step-2").read_bytes() == cut


def test_two_runs_started_in_the_same_second_get_their_own_metrics_folders(tmp_path, monkeypatch):
    import time
    from types import SimpleNamespace
    from trainer.infra.metrics import open_metrics

    monkeypatch.setattr(time, "strftime", lambda fmt: "20260101-120000")  # both runs read the same clock
    args = SimpleNamespace(
        run_dir="", save_dir=str(tmp_path), save_weight="grpo", use_wandb=0, wandb_project="p", tracker="wandb"
    )
    first_dir, first = open_metrics(args, {"step": 0})
    second_dir, second = open_metrics(args, {"step": 0})
    assert first_dir == str(tmp_path / "runs" / "grpo-20260101-120000")
    assert second_dir == str(tmp_path / "runs" / "grpo-20260101-120000-2")
    first.log({"step": 1, "hidden": 64})
    second.log({"step": 1, "hidden": 128})
    assert read_jsonl(os.path.join(first_dir, "metrics.jsonl")) == [{"step": 1, "hidden": 64}]
    assert read_jsonl(os.path.join(second_dir, "metrics.jsonl")) == [{"step": 1, "hidden": 128}]


# ----------------------------------------------------------------------------- resume names and folders
def test_a_resume_refuses_another_runs_run_dir(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    other = tmp_path / "other_run"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')  # another run's curves
    flags = GRPO + ["--save_dir", str(folder), "--data_path", small_data]
    killed = harness(["--kill_after_save", "1"], flags + ["--run_dir", str(folder / "own")])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    refused = run_main("train_grpo", flags + ["--from_resume", "1", "--run_dir", str(other)])
    assert refused.returncode != 0
    assert (
        f"--run_dir {other} holds another run's metrics ({other / 'metrics.jsonl'}); the run saved in "
        f"{folder / 'grpo_64_resume.pth'} writes its metrics to {folder / 'own'}"
    ) in refused.stderr
    assert "loaded weights" not in refused.stdout
    assert (other / "metrics.jsonl").read_text() == '{"step": 1, "reward": 0.5}\n'


def test_a_run_whose_save_weight_is_its_from_weight_is_refused_before_it_writes(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    before = (folder / "tiny_64.pth").read_bytes()
    result = run_main(
        "train_grpo", GRPO + ["--save_dir", str(folder), "--data_path", small_data, "--save_weight", "tiny"]
    )
    assert result.returncode != 0
    assert (
        f"--from_weight tiny is {folder / 'tiny_64.pth'}, the file this run saves its policy to (--save_weight tiny)"
    ) in result.stderr
    assert "loaded weights" not in result.stdout and (folder / "tiny_64.pth").read_bytes() == before


def test_from_resume_without_this_runs_file_names_the_resume_files_beside_it(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + ["--save_dir", str(folder), "--data_path", small_data]
    killed = harness(["--kill_after_save", "1"], flags)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    typo = run_main("train_grpo", flags + ["--save_weight", "gpro", "--from_resume", "1"])
    assert typo.returncode != 0
    assert (
        f"--from_resume 1: there is no {folder / 'gpro_64_resume.pth'}, but {folder} holds grpo_64_resume.pth "
        f"(--save_weight grpo --hidden_size 64)"
    ) in typo.stderr
    assert "--from_resume 0 to start this run at step 0" in typo.stderr and "loaded weights" not in typo.stdout


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--save_weight", "../x", "--save_weight must be a plain name"),
        ("--save_weight", "sub/x", "--save_weight must be a plain name"),
        ("--run_dir", "a_file", "exists and is not a folder"),
        ("--run_dir", "loop", "exists and is not a folder"),
    ],
)
def test_names_that_are_paths_and_run_dirs_that_are_no_folders_are_refused_at_start_up(
    tmp_path, capsys, flag, value, message
):
    (tmp_path / "a_file").write_text("x")
    os.symlink(tmp_path / "loop", tmp_path / "loop")  # a symlink to itself
    argument = value if flag == "--save_weight" else str(tmp_path / value)
    with pytest.raises(SystemExit) as exit_info:
        train_grpo.parse_args(["--save_dir", str(tmp_path / "out"), "--reward_model_path", "none", flag, argument])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and argument in err
    assert not os.path.exists(tmp_path / "x_256.pth") and not os.path.exists(tmp_path / "out" / "sub")


def test_a_resume_with_nothing_left_to_do_is_refused(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + ["--save_dir", str(folder), "--data_path", small_data]
    killed = harness(["--kill_after_save", "2"], flags)  # step 2 of 4 at 2 prompts per step
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resume_file = folder / "grpo_64_resume.pth"
    halved = run_main("train_grpo", flags + ["--from_resume", "1", "--batch_size", "1"])
    assert halved.returncode != 0  # 2 steps x 2 prompts = step 4 at 1 prompt per step: the run's end
    assert (
        f"nothing to resume: {resume_file} is at step 2 of 2 prompts per step, which is step 4 at this run's 1 "
        f"(--batch_size 1 x 1 processes) and this run has 4 steps"
    ) in halved.stderr
    shorter = run_main("train_grpo", flags + ["--from_resume", "1", "--max_steps", "2"])
    assert shorter.returncode != 0
    assert f"nothing to resume: {resume_file} is at step 2 and this run has 2 steps" in shorter.stderr
    assert "pass a --max_steps above 2" in shorter.stderr and "loaded weights" not in shorter.stdout


def test_a_changed_num_iterations_is_refused_on_resume(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + ["--save_dir", str(folder), "--data_path", small_data]
    killed = harness(["--kill_after_save", "1"], flags)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    refused = run_main("train_grpo", flags + ["--from_resume", "1", "--num_iterations", "2"])
    assert refused.returncode != 0
    assert (
        "was saved with --num_iterations 1 but this run has --num_iterations 2, which a resume cannot take (the "
        "schedule counts that many updates per rollout): pass --num_iterations 1"
    ) in refused.stderr


def test_a_changed_data_file_is_refused_on_resume_unless_allowed(tmp_path, tiny_weights, small_data):
    import hashlib

    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + ["--save_dir", str(folder), "--data_path", small_data]
    killed = harness(["--kill_after_save", "1"], flags)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    original = open(small_data, "rb").read()
    recorded = torch.load(folder / "grpo_64_resume.pth", weights_only=True)["data"]
    assert recorded == {"size": len(original), "sha256": hashlib.sha256(original).hexdigest()}
    lines = original.splitlines(keepends=True)
    open(small_data, "wb").write(b"".join([lines[1], lines[0]] + lines[2:]))  # same size, two prompts swapped
    refused = run_main("train_grpo", flags + ["--from_resume", "1"])
    assert refused.returncode != 0
    assert (
        f"--data_path {small_data} changed since {folder / 'grpo_64_resume.pth'} was saved (same size, sha256 "
        f"{hashlib.sha256(original).hexdigest()[:12]}..."
    ) in refused.stderr
    assert "--allow_data_change 1" in refused.stderr and "loaded weights" not in refused.stdout
    allowed = run_main("train_grpo", flags + ["--from_resume", "1", "--allow_data_change", "1"])
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "--allow_data_change 1: the run continues at the saved position" in allowed.stdout
    assert "resumed from" in allowed.stdout and "saved step 4" in allowed.stdout


def test_each_run_gets_its_own_sglang_weights_folder_and_one_run_per_folder(tmp_path, tiny_weights, small_data):
    from trainer.infra.files import atomic_write
    from trainer.infra.flags import rollout_engine_kwargs

    folder = folder_with_weights(tmp_path, tiny_weights)
    flags = GRPO + ["--save_dir", str(folder), "--data_path", small_data, "--rollout_engine", "sglang"]
    assert rollout_engine_kwargs(train_grpo.parse_args(flags + ["--save_weight", "a"]))["shared_path"] == str(
        folder / "sglang_a_64"
    )
    assert rollout_engine_kwargs(train_grpo.parse_args(flags + ["--save_weight", "b"]))["shared_path"] == str(
        folder / "sglang_b_64"
    )
    shared = ["--sglang_shared_path", str(tmp_path / "shared")]
    lock = claim_save_dir(train_grpo.parse_args(flags + shared + ["--save_weight", "a"]), "grpo", total_steps=4)
    try:
        second = run(["trainer/train_grpo.py"] + flags + shared + ["--save_weight", "b"])
        assert second.returncode != 0
        assert (
            f"--sglang_shared_path {tmp_path / 'shared'} is in use by another run (PID {os.getpid()}" in second.stderr
        )
    finally:
        lock.close()
    # a clean-up of stale temporaries removes a dead writer's, never a live one's
    dead_pid = int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )
    target = tmp_path / "shared" / "policy_v1"
    live = tmp_path / "shared" / f"policy_v1.tmp{os.getppid()}-0000abcd"
    dead = tmp_path / "shared" / f"policy_v1.tmp{dead_pid}-0000abcd"
    live.mkdir(parents=True)
    dead.mkdir()
    atomic_write({str(target): os.makedirs})
    assert target.is_dir() and live.is_dir() and not dead.exists()


class RunsCode:  # a pickle that would call print when unpickled
    def __reduce__(self):
        return (print, ("unpickling ran code",))


def test_a_from_weight_file_with_pickled_objects_is_named_and_never_run(tmp_path, tiny_weights, small_data):
    folder = folder_with_weights(tmp_path, tiny_weights)
    state_dict = torch.load(folder / "tiny_64.pth", weights_only=True)
    torch.save(dict(state_dict, extra=RunsCode()), folder / "pickled_64.pth")
    shutil.copy(folder / "tiny_64.tokenizer.json", folder / "pickled_64.tokenizer.json")
    result = run_main(
        "train_grpo", GRPO + ["--save_dir", str(folder), "--data_path", small_data, "--from_weight", "pickled"]
    )
    assert result.returncode != 0
    assert (
        f"{folder / 'pickled_64.pth'} holds Python objects besides tensors (Unsupported global: GLOBAL "
        f"print); it is not loaded"
    ) in result.stderr
    assert "torch.load(weights_only=False)" in result.stderr and "unpickling ran code" not in result.stdout
