"""torchrun with 2 CPU ranks (gloo): gradients really sync, ranks stay bit-identical (grpo, ppo, agent), PPO early
stop agrees, runs exit by themselves."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from test_train_agent import flags as agent_flags, write_agent_files

from trainer.infra.weights import build_config, init_model
from tests.support.weights_digest import parameter_digest

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
    "--batch_size",
    "2",
    "--max_steps",
    "3",
    "--save_interval",
    "3",
]


def torchrun(args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] + args
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_rank_files(folder):
    return [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(2)]


def test_toy_linear_gradients_are_averaged_over_ranks(tmp_path):
    result = torchrun(["tests/support/dist_worker.py", "toy_linear", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    # grad = mean([1, 0], [0, 1]) = [0.5, 0.5]; w = [1, 1] - 1.0 * [0.5, 0.5]
    assert read_rank_files(tmp_path) == [{"weight": [0.5, 0.5]}, {"weight": [0.5, 0.5]}]


@pytest.mark.parametrize("early_stop_kl, stops", [(0.5, True), (1.5, False)])
def test_ppo_early_stop_when_only_one_rank_is_over_the_threshold(tmp_path, early_stop_kl, stops):
    # rank 0's local approx KL is 2.0, rank 1's is 0.0: the decision uses their mean, 1.0, on both ranks
    result = torchrun(
        ["tests/support/dist_worker.py", "ppo_one_rank_kl", str(tmp_path), str(early_stop_kl)], timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = read_rank_files(tmp_path)
    assert rank0 == rank1
    assert rank0["early_stop"] == float(stops)
    assert rank0["optimizer_steps"] == (0.0 if stops else 4.0)  # 2 epochs x 2 minibatches


def assert_ranks_trained_alike(result, trace, initial, steps):
    """The run of tests/support/run_patched.py --trace_dir ``trace`` exited, both ranks' last checkpoint (step
    ``steps``) holds the same weights and not ``initial``'s, the ranks rolled out disjoint prompts, and only rank 0
    printed."""
    assert result.returncode == 0, result.stderr[-3000:]
    digests = [json.loads(open(trace / f"digest_rank{r}.txt").read().splitlines()[-1]) for r in range(2)]
    assert digests[0] == digests[1] and digests[0]["step"] == steps
    assert digests[0]["model"] != parameter_digest(initial)  # they trained, and stayed equal
    indices = [
        [json.loads(line) for line in open(trace / f"indices_rank{r}.jsonl").read().splitlines()] for r in range(2)
    ]
    seen = [set(i for batch in rank for i in batch) for rank in indices]
    assert not seen[0] & seen[1]  # each rank rolled out its own prompts
    assert result.stdout.count(f"step {steps}/{steps}") == 1  # only rank 0 prints


@pytest.mark.parametrize(
    "script, extra",
    [
        ("grpo", ["--num_generations", "3"]),
        ("ppo", ["--mini_batch_size", "1"]),
        ("grpo", ["--num_generations", "3", "--lora_rank", "4"]),  # LoRA: adapters and the final norm's copy in sync
        ("ppo", ["--mini_batch_size", "1", "--lora_rank", "4"]),  # and the critic's adapters and head
        (
            "grpo",
            [
                "--num_generations",
                "3",
                "--gradient_checkpointing",
                "1",
                "--micro_batch_size",
                "2",
                "--logprob_chunk_size",
                "4",
            ],
        ),  # the memory levers under DDP
    ],
)
def test_two_ranks_end_bit_identical(script, extra, tmp_path, tiny_weights, small_data):
    assert tiny_weights[0] == str(tmp_path)  # the fixture wrote tiny_64.pth here
    trace = tmp_path / "trace"
    result = torchrun(
        ["tests/support/run_patched.py", script, "--text_reward", "--trace_dir", str(trace), "--"]
        + TINY
        + extra
        + ["--save_dir", str(tmp_path), "--run_dir", str(tmp_path / "run"), "--data_path", small_data]
    )
    initial, _ = init_model(build_config(64, 2, 0), "tiny", str(tmp_path))
    assert_ranks_trained_alike(result, trace, initial, 3)
    trained, _ = init_model(build_config(64, 2, 0), script, str(tmp_path))  # the merged weights rank 0 saved
    assert parameter_digest(trained) != parameter_digest(initial)  # with LoRA too: the adapters learned


def test_two_agent_ranks_end_bit_identical(tmp_path):
    # upstream-format rows, 2 prompts x 2 ranks a step, up to 2 turns of 8 tokens: 2 steps stay in the first epoch
    save_dir, train, _ = write_agent_files(tmp_path)
    trace = tmp_path / "trace"
    result = torchrun(
        ["tests/support/run_patched.py", "agent", "--text_reward", "--trace_dir", str(trace), "--"]
        + agent_flags(save_dir, train, str(tmp_path / "run"), "--max_steps", "2", "--save_interval", "2")
    )
    initial, _ = init_model(build_config(64, 2, 0), "tiny", save_dir)
    assert_ranks_trained_alike(result, trace, initial, 2)


def assert_runs_always_exit(script, flags_of_run, tmp_path):
    """Three short torchrun runs of trainer/{script} (flags_of_run(run_dir) each, one step): each must exit by itself
    within the timeout."""
    for attempt in range(3):
        run_dir = str(tmp_path / f"run{attempt}")
        try:
            result = torchrun([f"trainer/{script}"] + flags_of_run(run_dir), timeout=150)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun {script} run {attempt} did not exit within 150 s")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "step 1/1" in result.stdout


@pytest.mark.parametrize(
    "script, extra", [("train_grpo.py", ["--num_generations", "2"]), ("train_ppo.py", ["--mini_batch_size", "1"])]
)
def test_two_rank_runs_always_exit(script, extra, tmp_path, tiny_weights, small_data):
    # A rank that frees its DDP wrapper while tearing down main can deadlock in gloo's destructor (1 run in 6
    # hung that way, see shutdown_distributed).
    assert_runs_always_exit(
        script,
        lambda run_dir: (
            TINY[:-4]
            + ["--max_steps", "1", "--save_interval", "1"]
            + extra
            + [
                "--save_dir",
                str(tmp_path),
                "--run_dir",
                run_dir,
                "--data_path",
                small_data,
                "--reward_model_path",
                "none",
            ]
        ),
        tmp_path,
    )


def test_two_rank_agent_runs_always_exit(tmp_path):
    save_dir, train, _ = write_agent_files(tmp_path)  # the agent frees its DDP wrapper as grpo does
    assert_runs_always_exit(
        "train_agent.py",
        lambda run_dir: agent_flags(save_dir, train, run_dir, "--max_steps", "1", "--save_interval", "1"),
        tmp_path,
    )


def test_two_ranks_draw_alike_under_dynamic_sampling_and_batch_whitening(tmp_path, tiny_weights, small_data):
    """0/1 rewards under --dynamic_sampling: a rank whose groups all differ still draws as many batches as the other
    (every rank calls the collectives equally often, so the run exits) and the ranks end bit-identical, with
    REINFORCE++'s whitening over both ranks' tokens (its values: test_advantage_estimators.py)."""
    trace = tmp_path / "trace"
    result = torchrun(
        ["tests/support/run_patched.py", "grpo", "--binary_text_reward", "--trace_dir", str(trace), "--"]
        + TINY
        + [
            "--num_generations",
            "3",
            "--max_steps",
            "4",
            "--save_interval",
            "4",
            "--dynamic_sampling",
            "1",
            "--max_num_gen_batches",
            "4",
            "--advantage_estimator",
            "reinforce_pp",
            "--save_dir",
            str(tmp_path),
            "--run_dir",
            str(tmp_path / "run"),
            "--data_path",
            small_data,
        ],
        timeout=300,
    )
    initial, _ = init_model(build_config(64, 2, 0), "tiny", str(tmp_path))
    assert_ranks_trained_alike(result, trace, initial, 4)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    draws = [row["dynamic_sampling/gen_batches"] for row in rows]  # the mean over the ranks: equal counts are whole
    assert all(d == int(d) for d in draws) and sum(draws) > len(rows)
