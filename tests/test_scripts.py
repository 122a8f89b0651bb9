"""Smoke runs of every script on a tiny config, in subprocesses (as a user runs them); the flag and weight checks
run ``main`` in this process (tests/support/in_process.py), one bad flag per script on the command line."""

import json
import os
import subprocess
import sys

import pytest

from conftest import MINIMIND_TOKENIZER, ROOT
from in_process import run_main


def run_script(args, cwd=ROOT, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    return subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


TINY = ["--hidden_size", "64", "--num_hidden_layers", "2"]


def test_grpo_two_steps(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    run_dir = tmp_path / "run"
    result = run_script(
        [
            "trainer/train_grpo.py",
            "--max_steps",
            "2",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--batch_size",
            "2",
            "--num_generations",
            "3",
            "--max_gen_len",
            "8",
            "--run_dir",
            str(run_dir),
            "--debug_mode",
            "--debug_interval",
            "1",
        ]
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2/2" in result.stdout and "[debug] answer 2" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the held-out evaluation before training
    for key in [
        "reward",
        "kl_ref",
        "advantages_mean",
        "advantages_std",
        "policy_loss",
        "response_len",
        "learning_rate",
        "rule_reward",
        "answer_reward",
        "final_norm_gain",
    ]:
        assert key in rows[1]
    # the held-out evaluation at step 0 and at the last step (--eval_interval 50 > 2), never in between
    for row in (rows[0], rows[2]):
        assert 0.0 <= row["eval/accuracy_sampled"] <= 1.0 and 0.0 <= row["eval/accuracy_greedy"] <= 1.0
    assert "eval/accuracy_sampled" not in rows[1]
    assert "held-out accuracy on 200 prompts" in result.stdout
    assert os.path.isfile(os.path.join(save_dir, "grpo_64.pth"))


def test_grpo_loss_type_grpo_from_another_folder(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    result = run_script(
        [
            os.path.join(ROOT, "trainer", "train_grpo.py"),
            "--max_steps",
            "1",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--batch_size",
            "1",
            "--num_generations",
            "2",
            "--max_gen_len",
            "4",
            "--loss_type",
            "grpo",
            "--run_dir",
            str(tmp_path / "r"),
        ]
        + TINY,
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num_generations", "1"], "--num_generations must be >= 2"),
        (["--epsilon_high", "1.0"], "--epsilon_high is CISPO's clamp of the ratio weight and must be > 1"),
        (["--loss_type", "dpo"], "--loss_type 'dpo' is unknown; valid: cispo, grpo"),
        (["--batch_size", "0"], "--batch_size must be >= 1"),
        (["--rollout_engine", "vllm"], "--rollout_engine 'vllm' is unknown"),
        (["--data_path", "missing.jsonl"], "--data_path missing.jsonl does not exist"),
        (["--grad_clip", "0"], "--grad_clip must be > 0"),
        (["--top_k", "-1"], "--top_k must be >= 0"),
        (["--use_moe", "1", "--shared_prefix", "1"], "--shared_prefix 1 is for dense models"),
    ],
)
def test_grpo_bad_flags_fail_at_start(flags, message):
    result = run_main("train_grpo", flags)
    assert result.returncode == 2
    assert message in result.stderr


def test_grpo_missing_weight_lists_existing(tiny_weights, tmp_path):
    save_dir, _ = tiny_weights
    result = run_main("train_grpo", ["--save_dir", save_dir, "--from_weight", "nope", "--max_steps", "1"] + TINY)
    assert result.returncode != 0
    assert "nope_64.pth" in result.stderr and "tiny_64.pth" in result.stderr


def test_grpo_shape_mismatch_names_flag(tiny_weights):
    save_dir, name = tiny_weights
    result = run_main(
        "train_grpo",
        [
            "--save_dir",
            save_dir,
            "--from_weight",
            os.path.join(save_dir, "tiny_64.pth"),
            "--max_steps",
            "1",
            "--hidden_size",
            "128",
            "--num_hidden_layers",
            "2",
        ],
    )
    assert result.returncode != 0
    assert "--hidden_size" in result.stderr and "(6400, 64)" in result.stderr


def test_sft_then_eval(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    result = run_script(
        [
            "trainer/train_full_sft.py",
            "--max_steps",
            "2",
            "--batch_size",
            "2",
            "--save_dir",
            save_dir,
            "--save_weight",
            "sft_tiny",
            "--log_interval",
            "1",
        ]
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isfile(os.path.join(save_dir, "sft_tiny_64.pth"))
    table = tmp_path / "eval.json"
    result = run_script(
        [
            "scripts/eval_policy.py",
            "--weights",
            name,
            "sft_tiny",
            "--save_dir",
            save_dir,
            "--num_prompts",
            "4",
            "--batch_size",
            "2",
            "--max_gen_len",
            "6",
            "--json_out",
            str(table),
        ]
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads(table.read_text())
    assert set(scores) == {name, "sft_tiny"}
    assert 0.0 <= scores[name]["accuracy"] <= 1.0


def test_sft_saves_into_its_save_dir_when_out_holds_the_same_name(tmp_path):
    """--save_weight full_sft --save_dir elsewhere writes elsewhere; the bundled out/full_sft_256.pth is untouched."""
    import hashlib

    bundled = os.path.join(ROOT, "out", "full_sft_256.pth")
    digest = hashlib.sha256(open(bundled, "rb").read()).hexdigest()
    result = run_script(
        [
            "trainer/train_full_sft.py",
            "--max_steps",
            "1",
            "--batch_size",
            "1",
            "--max_seq_len",
            "64",
            "--save_dir",
            str(tmp_path),
            "--save_weight",
            "full_sft",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isfile(tmp_path / "full_sft_256.pth")
    assert hashlib.sha256(open(bundled, "rb").read()).hexdigest() == digest


def test_ppo_two_steps(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    run_dir = tmp_path / "run"
    result = run_script(
        [
            "trainer/train_ppo.py",
            "--max_steps",
            "2",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--batch_size",
            "4",
            "--mini_batch_size",
            "2",
            "--max_gen_len",
            "8",
            "--reward_norm",
            "1",
            "--run_dir",
            str(run_dir),
        ]
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2/2" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for key in [
        "reward",
        "kl_ref",
        "approx_kl",
        "clipfrac",
        "value_loss",
        "explained_variance",
        "response_len",
        "learning_rate",
        "critic_learning_rate",
        "policy_loss",
        "advantages_std",
    ]:
        assert key in rows[-1], key
    assert os.path.isfile(os.path.join(save_dir, "ppo_64.pth"))
    assert os.path.isfile(os.path.join(save_dir, "ppo_critic_64.pth"))


@pytest.mark.parametrize(
    "script, extra",
    [
        ("trainer/train_grpo.py", ["--num_generations", "2"]),
        ("trainer/train_ppo.py", ["--mini_batch_size", "2"]),
    ],
)
def test_bf16_autocast_run(tiny_weights, tmp_path, script, extra):
    """--dtype bfloat16 trains on the CPU (autocast); the logged numbers stay finite."""
    save_dir, name = tiny_weights
    run_dir = tmp_path / "run"
    result = run_script(
        [
            script,
            "--max_steps",
            "2",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--dtype",
            "bfloat16",
            "--batch_size",
            "2",
            "--max_gen_len",
            "6",
            "--run_dir",
            str(run_dir),
            "--eval_interval",
            "0",
        ]
        + extra
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(
        isinstance(v, float) and abs(v) < 1e6
        for r in rows
        for k, v in r.items()
        if k in ("reward", "kl_ref", "policy_loss", "grad_norm", "value_loss")
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gamma", "1.5"], "--gamma must be in [0, 1]"),
        (["--lam", "-0.1"], "--lam must be in [0, 1]"),
        (["--mini_batch_size", "0"], "--mini_batch_size must be >= 1"),
        (["--clip_epsilon", "0"], "--clip_epsilon must be > 0"),
        (["--max_gen_len", "0"], "--max_gen_len must be >= 1"),
        (["--early_stop_kl", "0"], "--early_stop_kl must be > 0"),
    ],
)
def test_ppo_bad_flags_fail_at_start(flags, message):
    result = run_main("train_ppo", flags)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(
    "script, flag",
    [("train_grpo.py", "--num_generations"), ("train_ppo.py", "--gamma"), ("train_tokenizer.py", "--vocab_size")],
)
def test_a_bad_flag_on_the_command_line_exits_2_with_argparse_usage(script, flag):
    result = run_script([os.path.join("trainer", script), flag, "-3"], timeout=120)
    assert result.returncode == 2 and "usage: " in result.stderr
    assert f"{script}: error: {flag} must be" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "script, extra",
    [
        ("trainer/train_grpo.py", ["--num_generations", "2"]),
        ("trainer/train_ppo.py", ["--mini_batch_size", "1"]),
    ],
)
def test_rl_scripts_with_upstream_minimind_tokenizer(tiny_weights, tmp_path, script, extra):
    from trainer.infra.weights import write_tokenizer_record

    save_dir, name = tiny_weights
    write_tokenizer_record(os.path.join(save_dir, f"{name}_64.pth"), MINIMIND_TOKENIZER)  # trained with that one
    result = run_script(
        [
            script,
            "--max_steps",
            "1",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--tokenizer_path",
            MINIMIND_TOKENIZER,
            "--batch_size",
            "2",
            "--max_gen_len",
            "6",
            "--run_dir",
            str(tmp_path / "run"),
        ]
        + extra
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 1/1" in result.stdout


def test_too_few_prompts_is_an_error(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    data = tmp_path / "three.jsonl"
    row = json.dumps({"conversations": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]})
    data.write_text((row + "\n") * 3)
    result = run_script(
        [
            "trainer/train_grpo.py",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--data_path",
            str(data),
            "--batch_size",
            "4",
        ]
        + TINY,
        timeout=120,
    )
    assert result.returncode != 0
    assert "found 3 prompts, need at least 4 (--batch_size 4 x 1 processes)" in result.stderr


def test_random_init_reference_equals_policy(tmp_path):
    """--from_weight none: the reference is a copy of the (random) policy, so the first KL is 0."""
    run_dir = tmp_path / "run"
    result = run_script(
        [
            "trainer/train_grpo.py",
            "--from_weight",
            "none",
            "--max_steps",
            "1",
            "--batch_size",
            "1",
            "--num_generations",
            "2",
            "--max_gen_len",
            "4",
            "--save_dir",
            str(tmp_path),
            "--run_dir",
            str(run_dir),
            "--eval_interval",
            "0",
        ]
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["kl_ref"] == 0.0


def test_check_gpu_step_zero_ratio_is_one_in_fp32_on_the_cpu():
    # the GPU check's first figure, on the CPU in fp32: the rollout's own log-probs and a fresh forward agree
    from scripts.check_gpu import step_zero_ratio

    result = step_zero_ratio("cpu", "float32", num_prompts=2, num_generations=2, max_gen_len=8)
    assert result["tokens"] > 0
    assert result["max_abs_diff"] < 1e-4
    assert abs(result["ratio_mean"] - 1.0) < 1e-4


def test_check_gpu_refuses_cuda_without_a_gpu(capsys):
    import torch

    from scripts.check_gpu import parse_args

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_sft_resumed_from_its_resume_file_ends_as_a_straight_run(tiny_weights, tmp_path):
    """train_full_sft.py --from_resume 1 continues from the state written at --save_interval (step 4: one batch into
    the second epoch) and saves the same weights as the uninterrupted run; changed flags are refused by name."""
    import shutil
    import torch

    save_dir, name = tiny_weights
    data = tmp_path / "sft6.jsonl"
    data.write_text(
        "".join(open(os.path.join(ROOT, "dataset", "sft_data.jsonl"), encoding="utf-8").readlines()[:6]),
        encoding="utf-8",
    )
    common = [
        "trainer/train_full_sft.py",
        "--data_path",
        str(data),
        "--from_weight",
        os.path.join(save_dir, "tiny_64.pth"),
        "--batch_size",
        "2",
        "--max_steps",
        "5",
        "--max_seq_len",
        "64",
        "--save_weight",
        "sft_r",
        "--log_interval",
        "1",
    ] + TINY
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    result = run_script(common + ["--save_dir", str(straight), "--save_interval", "4"])
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copy(straight / "sft_r_64_resume.pth", resumed / "sft_r_64_resume.pth")  # the state after step 4
    result = run_script(common + ["--save_dir", str(resumed), "--from_resume", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 4/5" in result.stdout and "step 5/5 loss" in result.stdout and "step 4/5 loss" not in result.stdout
    a, b = torch.load(straight / "sft_r_64.pth"), torch.load(resumed / "sft_r_64.pth")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    result = run_script(common + ["--save_dir", str(resumed), "--from_resume", "1", "--learning_rate", "1e-3"])
    assert result.returncode != 0 and "--learning_rate 0.002 (now 0.001)" in result.stderr
    result = run_script(common + ["--save_dir", str(tmp_path), "--from_resume", "1"])
    assert result.returncode == 2 and "no resume file" in result.stderr
