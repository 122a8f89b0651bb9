"""``--fsdp 1`` (trainer/infra/fsdp.py) under torchrun with 2 CPU ranks (gloo): each rank holds half of the policy,
its gradients, AdamW's state and the reference; GRPO, PPO and the agent give DDP's losses, metrics and weights; the
sharded checkpoints resume bit for bit, survive a kill during a save, and are refused by a DDP run (and the reverse).

Equality is stated in fp32 as |a - b| <= 1e-5 max(1, |a|) for every metric and weight: FSDP reduces each gradient by a
reduce-scatter and DDP by an all-reduce, which sum the ranks' values in another order. A metric that is NaN in both
runs (PPO's explained variance of a one-token minibatch) counts as equal.
"""

import json
import math
import os

import pytest
import torch

from test_distributed import TINY, read_rank_files, torchrun
from test_train_agent import flags as agent_flags, write_agent_files

TOLERANCE = 1e-5  # fp32, see the module's docstring
GRPO = ["--num_generations", "3", "--shared_prefix", "0"]  # --fsdp 1's default; DDP's is 1
PPO = ["--mini_batch_size", "1"]
LEVERS = ["--gradient_checkpointing", "1", "--micro_batch_size", "2", "--logprob_chunk_size", "4"]


def test_each_rank_holds_half_of_weights_gradients_optimizer_state_and_reference(tmp_path):
    result = torchrun(["tests/support/dist_worker.py", "fsdp_shards", str(tmp_path)], timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = read_rank_files(tmp_path)
    assert [r["meta_before_sharding"] for r in ranks] == [False, True]  # only rank 0 ever held the whole model
    for kind, whole in (
        ("parameters", "whole_parameters"),
        ("gradients", "whole_gradients"),
        ("optimizer_state", "whole_optimizer_state"),
        ("reference", "whole_parameters"),
    ):
        assert all(r[kind] <= 0.55 * r[whole] for r in ranks), (kind, ranks)
        assert sum(r[kind] for r in ranks) == ranks[0][whole]  # the shards add up to the whole, nothing twice
    # the sharded step is the plain step: its global gradient norm (clipped at 0.5) and the weights after it
    assert ranks[0]["grad_norm"] == pytest.approx(ranks[0]["plain_grad_norm"], rel=TOLERANCE)
    assert ranks[0]["weight_error"] <= TOLERANCE
    # one gather for all forwards, 3 on rank 0 and 7 on rank 1, and the logits of the plain model
    assert all(r["logit_error"] <= TOLERANCE for r in ranks)


def run(script, tmp_path, name, flags, harness=(), timeout=300):
    """A 2-rank run of tests/support/run_patched.py with its weights dumped at every checkpoint; returns
    (the CompletedProcess, its folder)."""
    folder = tmp_path / name
    trace = folder / "trace"
    result = torchrun(
        ["tests/support/run_patched.py", script, "--text_reward", "--trace_dir", str(trace), "--dump_weights"]
        + list(harness)
        + ["--"]
        + flags(folder),
        timeout=timeout,
    )
    return result, folder


def metrics_rows(folder):
    return [json.loads(line) for line in open(folder / "run" / "metrics.jsonl")]


def assert_same_run(first, second, steps, tolerance):
    """The two runs logged the same metrics (within ``tolerance`` max(1, |value|), timings and memory aside) and saved
    the same weights (within ``tolerance``) at their last step."""
    rows = [metrics_rows(first), metrics_rows(second)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] and rows[0][-1]["step"] == steps
    compared = 0
    for row, other in zip(*rows):
        for key, value in row.items():
            if not isinstance(value, (int, float)) or key.startswith(("time", "gpu", "eval", "elapsed")):
                continue
            if math.isnan(value) and math.isnan(other[key]):
                continue
            assert other[key] == pytest.approx(value, rel=tolerance, abs=tolerance), (row["step"], key)
            compared += 1
    assert compared > 20 * steps
    weights = [torch.load(folder / "trace" / f"weights_step{steps}.pt") for folder in (first, second)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        for key, tensor in weights[0][name].items():
            assert (tensor - weights[1][name][key]).abs().max().item() <= tolerance, (name, key)


def script_flags(tiny_weights, small_data, extra):
    def flags(folder):
        os.makedirs(folder, exist_ok=True)
        for file in ("tiny_64.pth", "tiny_64.tokenizer.json"):
            os.link(os.path.join(tiny_weights[0], file), folder / file)
        return TINY + extra + ["--save_dir", str(folder), "--run_dir", str(folder / "run"), "--data_path", small_data]

    return flags


@pytest.mark.parametrize(
    "script, extra, fsdp_extra",
    [
        ("grpo", GRPO, []),
        ("ppo", PPO, []),
        ("grpo", GRPO + LEVERS, []),
        ("grpo", GRPO, ["--fsdp_reshard_after_forward", "0"]),
    ],
    ids=["grpo", "ppo", "grpo-memory-levers", "grpo-no-reshard"],
)
def test_fsdp_equals_ddp(script, extra, fsdp_extra, tmp_path, tiny_weights, small_data):
    ddp, ddp_folder = run(script, tmp_path, "ddp", script_flags(tiny_weights, small_data, extra))
    fsdp_flags = script_flags(tiny_weights, small_data, extra + ["--fsdp", "1"] + fsdp_extra)
    fsdp, fsdp_folder = run(script, tmp_path, "fsdp", fsdp_flags)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert_same_run(ddp_folder, fsdp_folder, 3, TOLERANCE)
    assert os.path.isfile(fsdp_folder / "trace" / "weights_step3.pt")
    shards = fsdp_folder / f"{script}_64_resume_sharded"
    (step_folder,) = os.listdir(shards)  # the last step's only
    assert step_folder.startswith("step_00000003_")
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(shards / step_folder))  # each rank its part


def test_agent_under_fsdp_equals_ddp(tmp_path):
    save_dir, train, _ = write_agent_files(tmp_path)

    def flags(extra):
        def of(folder):
            os.makedirs(folder, exist_ok=True)
            for file in os.listdir(save_dir):
                os.link(os.path.join(save_dir, file), folder / file)
            return (
                agent_flags(str(folder), train, str(folder / "run"), "--max_steps", "2", "--save_interval", "2")
                + [
                    "--eval_interval",
                    "0",
                ]
                + extra
            )

        return of

    ddp, ddp_folder = run("agent", tmp_path, "ddp", flags([]))
    fsdp, fsdp_folder = run("agent", tmp_path, "fsdp", flags(["--fsdp", "1"]))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert_same_run(ddp_folder, fsdp_folder, 2, TOLERANCE)


def resume(script, folder, flags, data_path):
    """The run in ``folder`` continued with --from_resume 1 (its weights dumped into the same trace)."""
    return torchrun(
        [
            "tests/support/run_patched.py",
            script,
            "--text_reward",
            "--trace_dir",
            str(folder / "trace"),
            "--dump_weights",
        ]
        + ["--"]
        + TINY
        + flags
        + ["--save_dir", str(folder), "--run_dir", str(folder / "run"), "--data_path", data_path, "--from_resume", "1"]
    )


@pytest.mark.parametrize("script, extra", [("grpo", GRPO), ("ppo", PPO)])
def test_a_killed_fsdp_run_resumes_bit_exact(script, extra, tmp_path, tiny_weights, small_data):
    base = extra + ["--fsdp", "1", "--save_interval", "1"]
    straight, straight_folder = run(script, tmp_path, "straight", script_flags(tiny_weights, small_data, base))
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed_flags = script_flags(tiny_weights, small_data, base)
    killed, folder = run(script, tmp_path, "killed", killed_flags, ["--kill_after_save", "2"])
    assert killed.returncode != 0 and not os.path.isfile(folder / "trace" / "weights_step3.pt")
    resumed = resume(script, folder, base, small_data)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert_same_run(straight_folder, folder, 3, 0.0)  # bit for bit
    (step_folder,) = os.listdir(folder / f"{script}_64_resume_sharded")  # older steps removed
    assert step_folder.startswith("step_00000003_")


def test_a_kill_during_a_sharded_save_leaves_the_previous_checkpoint_resumable(tmp_path, tiny_weights, small_data):
    base = GRPO + ["--fsdp", "1", "--save_interval", "1"]
    straight, straight_folder = run("grpo", tmp_path, "straight", script_flags(tiny_weights, small_data, base))
    assert straight.returncode == 0, straight.stderr[-3000:]
    # killed while rank 0 writes step 2's resume file, after every rank wrote step 2's shards
    killed, folder = run(
        "grpo", tmp_path, "killed", script_flags(tiny_weights, small_data, base), ["--kill_during_save", "2"]
    )
    assert killed.returncode != 0
    resume_file = torch.load(folder / "grpo_64_resume.pth", weights_only=True)
    assert resume_file["progress"]["step"] == 1 and "step_00000001_" in resume_file["sharded"]["folder"]
    resumed = resume("grpo", folder, base, small_data)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 1" in resumed.stdout
    assert_same_run(straight_folder, folder, 3, 0.0)


@pytest.mark.parametrize("saved, resumed", [("0", "1"), ("1", "0")])
def test_a_resume_across_ddp_and_fsdp_is_refused_naming_both(saved, resumed, tmp_path, tiny_weights, small_data):
    flags = script_flags(tiny_weights, small_data, GRPO + ["--max_steps", "1", "--save_interval", "1"])
    first, folder = run("grpo", tmp_path, "run", lambda f: flags(f) + ["--fsdp", saved])
    assert first.returncode == 0, first.stderr[-3000:]
    second = torchrun(
        ["tests/support/run_patched.py", "grpo", "--text_reward", "--"]
        + TINY
        + GRPO
        + ["--max_steps", "2", "--save_dir", str(folder), "--run_dir", str(folder / "run")]
        + ["--data_path", small_data, "--from_resume", "1", "--fsdp", resumed]
    )
    assert second.returncode != 0
    assert f"was saved under --fsdp {saved} but this run has --fsdp {resumed}" in second.stderr
    assert f"pass --fsdp {saved} to resume" in second.stderr


def test_a_rank_that_fails_stops_the_other(tmp_path, tiny_weights, small_data):
    flags = script_flags(tiny_weights, small_data, GRPO + ["--fsdp", "1"])
    result, _ = run("grpo", tmp_path, "run", flags, ["--fail_on_rank1_before_step", "2"], timeout=120)
    assert result.returncode != 0
    assert "rank 1 fails on purpose before step 2" in result.stderr
    assert "step 3/3" not in result.stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fsdp", "1"], "--fsdp 1 shards the models over the processes of torchrun"),
        (["--fsdp", "1", "--lora_rank", "4"], "--fsdp 1 with --lora_rank 4: LoRA already leaves the frozen base"),
        (["--fsdp", "1", "--use_moe", "1"], "--use_moe 1 with --fsdp 1: an expert that got no token on one rank"),
        (["--fsdp", "1", "--use_compile", "1"], "--use_compile 1 with --fsdp 1"),
        (["--fsdp", "1", "--shared_prefix", "1"], "--shared_prefix 1 with --fsdp 1: its second forward runs only"),
        (["--fsdp_cpu_offload", "1"], "act with --fsdp 1 only: add --fsdp 1"),
        (["--fsdp_reshard_after_forward", "0"], "act with --fsdp 1 only: add --fsdp 1"),
    ],
)
def test_fsdp_flags_it_does_not_take_are_refused(flags, message, monkeypatch, capsys, tmp_path):
    from trainer import train_grpo

    monkeypatch.delenv("RANK", raising=False)
    if "torchrun" not in message:
        monkeypatch.setenv("RANK", "0")  # as under torchrun: the refusal tested is the one left
    with pytest.raises(SystemExit) as exit_info:
        train_grpo.parse_args(flags + ["--save_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
