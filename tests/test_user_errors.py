"""A user's mistake or a broken environment ends a script with one last stderr line that names the thing and the way
on, exit status 1 and no traceback; a bug keeps its traceback, and ``--debug_mode 1`` shows the traceback of both
(trainer/infra/errors.py). The scripts run as a user runs them: a subprocess, the bundled default where it fits."""

import errno
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from trainer.infra.errors import InputError, ServerError, run_script, user_message

QUICK = [
    "--max_steps",
    "1",
    "--eval_interval",
    "0",
    "--reward_model_path",
    "none",
    "--batch_size",
    "2",
    "--max_gen_len",
    "8",
]


def run(script, flags, cwd=ROOT):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "trainer", script)] + flags,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_ends_with_user_error(result, script, *parts):
    """Exit 1, no traceback, and a last stderr line ``{script}: error: ...`` holding every one of ``parts``."""
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: "), last
    for part in parts:
        assert part in last, (part, last)


TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--from_weight", "tiny"]


def test_saving_over_the_start_weights_names_both_flags(tiny_weights):
    save_dir, _ = tiny_weights
    result = run("train_grpo.py", TINY + ["--save_weight", "tiny", "--save_dir", save_dir] + QUICK)
    assert_ends_with_user_error(
        result,
        "train_grpo.py",
        "--from_weight tiny is",
        os.path.join(save_dir, "tiny_64.pth"),
        "give this run another --save_weight",
    )


def test_start_weights_that_do_not_exist_are_named_with_what_the_folder_holds(tiny_weights):
    save_dir, _ = tiny_weights
    result = run("train_ppo.py", TINY[:4] + ["--from_weight", "no_such_weights", "--save_dir", save_dir] + QUICK)
    assert_ends_with_user_error(
        result,
        "train_ppo.py",
        "--from_weight no_such_weights: weights not found: ",
        "no_such_weights_64.pth",
        f"(in {save_dir}: ['tiny_64.pth'])",
    )


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py", "train_full_sft.py"])
def test_a_broken_data_row_is_named_by_file_and_line(script, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"conversations": [{"role": "user", "content": "1+1"}]}\n{"conversations": [\n')
    result = run(
        script,
        ["--data_path", str(data), "--save_dir", str(tmp_path)] + (QUICK if script != "train_full_sft.py" else []),
    )
    assert_ends_with_user_error(result, script, f"{data}:2: invalid JSON")


def test_an_agent_row_without_tools_is_named_by_file_and_line(tmp_path):
    data = tmp_path / "agent.jsonl"
    data.write_text('{"conversations": [{"role": "user", "content": "1+1"}], "gt": ["2"]}\n')
    result = run("train_agent.py", ["--data_path", str(data), "--save_dir", str(tmp_path)] + QUICK)
    assert_ends_with_user_error(result, "train_agent.py", f"{data}:1: no system turn with 'tools'")


def test_a_full_disk_names_the_file_and_the_way_on(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink("/dev/full", run_dir / "metrics.jsonl")  # the kernel answers every write with ENOSPC
    result = run(
        "train_grpo.py", QUICK + ["--num_generations", "2", "--save_dir", str(tmp_path), "--run_dir", str(run_dir)]
    )
    assert_ends_with_user_error(
        result,
        "train_grpo.py",
        f"metrics row of step 1 to {run_dir / 'metrics.jsonl'}",
        "the disk is full",
        "free space",
    )


def test_debug_mode_shows_the_traceback_of_a_user_error(tiny_weights):
    save_dir, _ = tiny_weights
    result = run("train_grpo.py", TINY + ["--save_weight", "tiny", "--save_dir", save_dir, "--debug_mode", "1"] + QUICK)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "InputError: --from_weight tiny is" in result.stderr


def test_run_script_sorts_user_errors_from_bugs(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train_x.py", "--seed", "1"])

    def user_mistake():
        raise InputError("--data_path d.jsonl: found 0 prompts,\n  need at least 4")

    with pytest.raises(SystemExit) as stopped:
        run_script(user_mistake)
    assert stopped.value.code == 1
    assert capsys.readouterr().err == "train_x.py: error: --data_path d.jsonl: found 0 prompts, need at least 4\n"

    def bug():
        return {}["missing"]

    with pytest.raises(KeyError):  # a bug propagates: Python prints its traceback
        run_script(bug)
    with pytest.raises(InputError):  # --debug_mode re-raises the user's error too
        run_script(user_mistake, ["--debug_mode", "1"])
    with pytest.raises(SystemExit):
        run_script(user_mistake, ["--debug_mode", "0"])
    assert run_script(lambda: 7) == 7


def test_an_os_error_on_a_path_gets_its_path_and_a_way_on():
    message = user_message(OSError(errno.ENOSPC, "No space left on device", "/data/out/grpo_256.pth"))
    assert message == (
        "No space left on device: /data/out/grpo_256.pth (free space on that disk or pass a "
        "--save_dir / --run_dir on another one)"
    )
    assert user_message(PermissionError(errno.EACCES, "Permission denied", "/out")).startswith(
        "Permission denied: /out (make that path writable"
    )
    assert (
        user_message(ServerError("SGLang http://h:1/generate answered HTTP 500"))
        == "SGLang http://h:1/generate answered HTTP 500"
    )
    assert user_message(ZeroDivisionError("division by zero")) is None
    assert user_message(ValueError("a plain ValueError is a bug")) is None
