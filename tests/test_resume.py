"""Resume (--from_resume 1): bit-exact continuation after SIGKILL, atomic checkpoints, refusals, SIGTERM."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import ROOT

from trainer.infra.checkpoints import get_rng_state, load_resume, resume_progress, set_rng_state
from dataset.lm_dataset import ResumableBatchSampler

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
]  # the held-out evaluation has its own tests (test_evaluation.py)
GRPO = TINY + ["--batch_size", "2", "--num_generations", "3", "--max_steps", "6", "--save_interval", "3"]
PPO = TINY + ["--batch_size", "2", "--mini_batch_size", "1", "--max_steps", "6", "--save_interval", "3"]
LEVERS = [
    "--gradient_checkpointing",
    "1",
    "--micro_batch_size",
    "2",
    "--logprob_chunk_size",
    "5",
    "--ref_dtype",
    "bfloat16",
]


def harness(script, harness_flags, script_flags, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    harness_script = os.path.join(ROOT, "tests", "support", "run_patched.py")
    cmd = [sys.executable, harness_script, script] + harness_flags + ["--"] + script_flags
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def new_run_dir(tmp_path, name, tiny_weights):
    folder = tmp_path / name
    folder.mkdir()
    for name in ("tiny_64.pth", "tiny_64.tokenizer.json"):  # the weights and the record of their tokenizer
        shutil.copy(os.path.join(tiny_weights[0], name), folder / name)
    return folder


def read_jsonl(path):
    return [json.loads(line) for line in open(path).read().splitlines()]


def straight_and_resumed(script, flags, tmp_path, tiny_weights, small_data, kill_flag, reward="--text_reward"):
    """Run 6 steps straight; run again, killed by SIGKILL at step 3 (kill_flag), then resumed to step 6."""
    runs = {}
    for name in ("straight", "resumed"):
        folder = new_run_dir(tmp_path, name, tiny_weights)
        common = flags + ["--save_dir", str(folder), "--run_dir", str(folder / "run"), "--data_path", small_data]
        trace = [reward, "--trace_dir", str(folder / "trace")]
        if name == "straight":
            result = harness(script, trace, common)
            assert result.returncode == 0, result.stderr[-3000:]
        else:
            killed = harness(script, trace + kill_flag, common)
            assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
            result = harness(script, trace, common + ["--from_resume", "1"])
            assert result.returncode == 0, result.stderr[-3000:]
            assert "resumed from" in result.stdout
        runs[name] = folder
    return runs


@pytest.mark.parametrize(
    "script, flags",
    [
        ("grpo", GRPO),
        ("ppo", PPO),
        ("grpo", GRPO + ["--accumulation_steps", "2"]),  # killed after step 3: one step's gradients not yet applied
        ("grpo", GRPO + ["--lora_rank", "4"]),  # LoRA: the adapters, the final norm's copy and their AdamW state
        ("ppo", PPO + ["--lora_rank", "4"]),
        ("grpo", GRPO + ["--dynamic_sampling", "1"]),  # 0/1 rewards: steps draw more prompts, the position counts them
        ("grpo", GRPO + LEVERS),  # the memory levers: checkpointing, micro-batches, chunks, a bf16 reference
        ("ppo", PPO + LEVERS),
    ],
)
def test_sigkill_then_resume_equals_straight_run(script, flags, tmp_path, tiny_weights, small_data):
    reward = "--binary_text_reward" if "--dynamic_sampling" in flags else "--text_reward"
    runs = straight_and_resumed(script, flags, tmp_path, tiny_weights, small_data, ["--kill_after_save", "3"], reward)
    straight_indices = read_jsonl(runs["straight"] / "trace" / "indices_rank0.jsonl")
    resumed_indices = read_jsonl(runs["resumed"] / "trace" / "indices_rank0.jsonl")
    assert len(straight_indices) == 6 and len(resumed_indices) == 6  # 3 before the kill, 3 after the resume
    assert resumed_indices[3:] == straight_indices[3:]  # steps 4-6 see the same prompts in the same order
    straight_digests = read_jsonl(runs["straight"] / "trace" / "digest_rank0.txt")
    resumed_digests = read_jsonl(runs["resumed"] / "trace" / "digest_rank0.txt")
    assert [d["step"] for d in resumed_digests] == [3, 6]
    assert resumed_digests[-1] == straight_digests[-1]  # bit-identical final policy (and critic)
    assert straight_digests[0]["model"] != straight_digests[1]["model"]  # the weights did change in steps 4-6
    straight_rows = read_jsonl(runs["straight"] / "run" / "metrics.jsonl")
    resumed_rows = read_jsonl(runs["resumed"] / "run" / "metrics.jsonl")
    for a, b in zip(straight_rows[3:], resumed_rows[3:]):
        assert a["step"] == b["step"] and a["reward"] == b["reward"] and a["sample_indices"] == b["sample_indices"]
    if "--dynamic_sampling" in flags:  # the steps after the resume drew as many prompts, the same ones
        draws = [row["dynamic_sampling/gen_batches"] for row in straight_rows]
        assert sum(draws[:3]) > 3 and [row["dynamic_sampling/gen_batches"] for row in resumed_rows[3:]] == draws[3:]


def test_sigkill_while_writing_checkpoint_keeps_previous_one(tmp_path, tiny_weights, small_data):
    runs = straight_and_resumed("grpo", GRPO, tmp_path, tiny_weights, small_data, ["--kill_during_save", "6"])
    resume_file = runs["resumed"] / "grpo_64_resume.pth"
    # the run killed mid-write at step 6 resumed from the intact step-3 file and ended like the straight run
    assert (
        read_jsonl(runs["resumed"] / "trace" / "digest_rank0.txt")[-1]
        == read_jsonl(runs["straight"] / "trace" / "digest_rank0.txt")[-1]
    )
    assert torch.load(resume_file, weights_only=True)["progress"]["step"] == 6
    assert not [p for p in os.listdir(runs["resumed"]) if ".tmp" in p]  # the partial file was cleaned up


def test_killed_mid_write_leaves_step3_file_loadable(tmp_path, tiny_weights, small_data):
    folder = new_run_dir(tmp_path, "run", tiny_weights)
    common = GRPO + ["--save_dir", str(folder), "--run_dir", str(folder / "run"), "--data_path", small_data]
    killed = harness("grpo", ["--kill_during_save", "6"], common)
    assert killed.returncode == -signal.SIGKILL
    assert [p for p in os.listdir(folder) if ".tmp" in p]  # the half-written file is there ...
    checkpoint = torch.load(folder / "grpo_64_resume.pth", weights_only=True)  # ... and the previous one loads
    assert checkpoint["progress"]["step"] == 3


def test_resume_refuses_another_script_and_overwrites_nothing(tmp_path, tiny_weights, small_data):
    folder = new_run_dir(tmp_path, "run", tiny_weights)
    common = TINY + ["--save_dir", str(folder), "--data_path", small_data, "--batch_size", "2"]
    grpo = harness("grpo", [], common + ["--num_generations", "2", "--max_steps", "1", "--run_dir", str(folder / "a")])
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    before = {p: (folder / p).read_bytes() for p in os.listdir(folder) if p.endswith(".pth")}
    ppo = harness(
        "ppo",
        [],
        common + ["--save_weight", "grpo", "--from_resume", "1", "--max_steps", "1", "--run_dir", str(folder / "b")],
    )
    assert ppo.returncode != 0
    assert "grpo_64_resume.pth was written by train_grpo.py, not train_ppo.py" in ppo.stderr
    assert {p: (folder / p).read_bytes() for p in os.listdir(folder) if p.endswith(".pth")} == before


def test_resume_refuses_other_architecture_naming_both_values(tmp_path, tiny_weights, small_data):
    folder = new_run_dir(tmp_path, "run", tiny_weights)
    common = [
        "--hidden_size",
        "64",
        "--from_weight",
        "none",
        "--max_gen_len",
        "4",
        "--save_dir",
        str(folder),
        "--data_path",
        small_data,
        "--batch_size",
        "2",
        "--num_generations",
        "2",
        "--max_steps",
        "1",
    ]
    first = harness("grpo", [], common + ["--num_hidden_layers", "2", "--run_dir", str(folder / "a")])
    assert first.returncode == 0, first.stderr[-3000:]
    second = harness(
        "grpo", [], common + ["--num_hidden_layers", "3", "--from_resume", "1", "--run_dir", str(folder / "b")]
    )
    assert second.returncode != 0
    assert "was saved with --num_hidden_layers 2 but this run has --num_hidden_layers 3" in second.stderr


def test_sigterm_saves_and_prints_resume_command(tmp_path, tiny_weights, small_data):
    folder = new_run_dir(tmp_path, "run", tiny_weights)
    cmd = (
        [sys.executable, "trainer/train_grpo.py"]
        + TINY
        + [
            "--batch_size",
            "2",
            "--num_generations",
            "2",
            "--max_steps",
            "200",
            "--save_interval",
            "1000",
            "--save_dir",
            str(folder),
            "--run_dir",
            str(folder / "run"),
            "--data_path",
            small_data,
        ]
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not os.path.exists(folder / "run" / "metrics.jsonl"):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by SIGTERM at step" in stdout
    assert "--from_resume 1" in stdout.split("resume with:")[1]
    last_logged = read_jsonl(folder / "run" / "metrics.jsonl")[-1]["step"]
    checkpoint = torch.load(folder / "grpo_64_resume.pth", weights_only=True)
    assert checkpoint["progress"]["step"] == last_logged < 200


def test_resume_progress_rescales_step_for_another_world_size():
    checkpoint = {
        "progress": {"step": 10, "epoch": 0, "batch_in_epoch": 10, "lr_schedule_step": 10, "world_size": 2},
        "rng_states": [{"r": 0}, {"r": 1}],
    }
    progress, rng_state = resume_progress(checkpoint, world_size=4, steps_per_epoch=50, rank=0, batch_size=4)
    assert (progress["step"], progress["batch_in_epoch"], rng_state) == (5, 5, None)  # 10 * 2 / 4
    assert progress["lr_schedule_step"] == 5
    progress, rng_state = resume_progress(checkpoint, world_size=2, steps_per_epoch=50, rank=1, batch_size=4)
    assert (progress["step"], rng_state) == (10, {"r": 1})
    # saved at an epoch's end
    progress, _ = resume_progress(checkpoint, world_size=2, steps_per_epoch=10, rank=0, batch_size=4)
    assert (progress["epoch"], progress["batch_in_epoch"]) == (1, 0)


def test_batch_sampler_order_and_skip():
    # DistributedSampler's documented order: randperm(n) seeded with seed + epoch, rank r takes every world_size-th
    dataset = list(range(10))
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(7 + 2)).tolist()
    sampler = ResumableBatchSampler(dataset, batch_size=2, world_size=2, rank=1, seed=7)
    sampler.set_epoch(2)
    mine = expected[1::2]  # 5 indices for rank 1
    assert list(sampler) == [mine[0:2], mine[2:4]]  # the partial last batch is dropped
    sampler.set_epoch(2, skip_batches=1)
    assert list(sampler) == [mine[2:4]] and len(sampler) == 1


def test_rng_state_round_trip():
    state = get_rng_state()
    expected = (random.random(), float(np.random.rand()), torch.rand(3).tolist())
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), torch.rand(3).tolist()) == expected


def test_load_resume_missing_file_starts_fresh_and_garbage_is_named(tmp_path):
    args = type("Args", (), {"hidden_size": 64, "num_hidden_layers": 2, "use_moe": 0})()
    assert load_resume(str(tmp_path / "none.pth"), "grpo", args) is None
    bad = tmp_path / "bad_resume.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad_resume.pth is not a readable resume checkpoint"):
        load_resume(str(bad), "grpo", args)


def test_wandb_run_id_is_kept_on_resume(tmp_path, monkeypatch):
    from trainer.infra.metrics import MetricsWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = MetricsWriter(str(tmp_path / "run"), use_wandb=True, wandb_project="test")
    first.log({"step": 1, "reward": 0.5})
    first.close()
    resumed = MetricsWriter(str(tmp_path / "run"), use_wandb=True, wandb_project="test", wandb_id=first.wandb_id)
    resumed.log({"step": 2, "reward": 0.6})
    resumed.close()
    assert first.wandb_id and resumed.wandb_id == first.wandb_id
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


def test_resume_command_quotes_arguments():
    from trainer.infra.checkpoints import resume_command

    command = resume_command(
        os.path.join(ROOT, "trainer", "train_grpo.py"), ["--run_dir", "my runs/a", "--from_resume", "0"], world_size=2
    )
    assert command.startswith("torchrun --nproc_per_node 2 ")
    assert command.endswith("--run_dir 'my runs/a' --from_resume 1")


def test_saves_never_take_the_load_shortcut(tmp_path, monkeypatch):
    from trainer.infra.weights import weight_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "grpo").write_text("a file that happens to share the weight's name")
    assert weight_path("grpo", "out", 256, 0) == "grpo"  # loading accepts a path
    assert weight_path("grpo", "out", 256, 0, allow_file=False) == os.path.join("out", "grpo_256.pth")


def test_world_size_change_moves_the_learning_rate_schedule_with_the_step(tmp_path, capsys):
    # 40 optimizer steps saved by 1 process, resumed by 2: the step becomes 40 * 1 // 2 = 20 and the cosine
    # learning rate must be the one of step 20 of 100: 0.1 + 0.9 * 0.5 * (1 + cos(0.2 * pi)) = 0.9140576 (by hand),
    # not step 40's 0.6890576 (what rescaling the step alone would give).
    from trainer.infra.checkpoints import restore_from_checkpoint, training_states
    from trainer.train_grpo import parse_args
    from trainer.infra.optimizer import build_cosine_scheduler

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = build_cosine_scheduler(optimizer, 100)
    for _ in range(40):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.6890576, abs=1e-6)  # 0.1 + 0.45 * (1 + cos(0.4 pi))
    args = parse_args(["--save_dir", str(tmp_path), "--from_weight", "none", "--reward_model_path", "none"])
    checkpoint = {
        "progress": {
            "step": 40,
            "epoch": 0,
            "batch_in_epoch": 40,
            "lr_schedule_step": scheduler.last_epoch,
            "world_size": 1,
        },
        "states": training_states({"model": model, "optimizer": optimizer}),
        "rng_states": [None],
        "args": {},
    }
    fresh_model = torch.nn.Linear(2, 1)
    fresh_optimizer = torch.optim.SGD(fresh_model.parameters(), lr=1.0)
    objects = {"model": fresh_model, "optimizer": fresh_optimizer}
    progress = restore_from_checkpoint(args, objects, 1000, str(tmp_path / "x_resume.pth"), checkpoint, {}, 0, 2)
    assert progress["step"] == 20 and progress["lr_schedule_step"] == 20
    fresh_scheduler = build_cosine_scheduler(fresh_optimizer, 100, progress["lr_schedule_step"])
    assert fresh_scheduler.last_epoch == 20
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(0.9140576, abs=1e-6)
    assert "world size changed from 1 to 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--from_resume", "--max_steps", "5"],  # a bare 0/1 flag means 1: the next word is another flag
        ["--from_resume=0", "--max_steps", "5"],
        ["--max_steps", "5", "--from_resume", "0"],
    ],
)
def test_resume_command_replaces_every_form_of_from_resume(argv):
    from trainer.infra.checkpoints import resume_command

    expected = "python trainer/train_grpo.py --max_steps 5 --from_resume 1"
    assert resume_command("trainer/train_grpo.py", argv, 1) == expected


def test_sglang_engine_resumes_from_a_torch_engine_state():
    # a resume file of --rollout_engine torch holds {} for the engine: the SGLang cadence starts afresh
    import types

    from trainer.rollout_engine import SGLangRolloutEngine

    engine = types.SimpleNamespace(num_update_calls=0, client=types.SimpleNamespace(weight_pushes=1))
    SGLangRolloutEngine.load_resume_state(engine, {})
    assert (engine.num_update_calls, engine.client.weight_pushes) == (0, 1)


def test_a_resume_file_whose_model_state_does_not_fit_is_refused_naming_it():
    from model.model_minimind import CriticModel
    from trainer.infra.checkpoints import load_training_states
    from trainer.infra.errors import InputError
    from trainer.infra.weights import build_config

    critic = CriticModel(build_config(64, 2, 0))
    saved = dict(critic.state_dict())
    del saved["value_head.bias"]  # e.g. a critic of another layout
    with pytest.raises(
        InputError,
        match=r"ppo_64_resume.pth: its 'critic' does not fit this run's \(Missing "
        r"key\(s\) in state_dict: \"value_head.bias\"\.\); it was written by another",
    ):
        load_training_states({"critic": critic}, {"critic": saved}, "ppo_64_resume.pth")
