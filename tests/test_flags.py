"""trainer/infra/flags.py: upstream MiniMind's flag names where they mean the same, clear errors where they do not, and
the held-out evaluation only on the data it belongs to."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def parse(script, argv):
    import importlib

    return importlib.import_module(f"trainer.train_{script}").parse_args(argv)


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_upstream_sglang_base_url_is_the_sglang_url(script):
    assert parse(script, ["--sglang_base_url", "http://10.0.0.2:8998"]).sglang_url == "http://10.0.0.2:8998"


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--dtype", "float16"], ["--dtype float16", "loss scaler", "bfloat16"]),
        (["--dtype", "fp8"], ["--dtype fp8", "auto, float32, bfloat16"]),
    ],
)
def test_upstream_flags_with_another_meaning_are_errors_that_name_ours(argv, names, capsys):
    with pytest.raises(SystemExit):
        parse("grpo", argv)
    err = capsys.readouterr().err
    assert all(name in err for name in names), err


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_evaluation_prompts_follow_the_training_data(script, tmp_path):
    bundled_val = os.path.join(ROOT, "dataset", "rlaif_val.jsonl")
    assert parse(script, []).eval_data_path == bundled_val
    other = tmp_path / "mine.jsonl"
    other.write_text(open(os.path.join(ROOT, "dataset", "rlaif_train.jsonl"), encoding="utf-8").readline())
    assert parse(script, ["--data_path", str(other)]).eval_data_path == ""
    assert parse(script, ["--data_path", str(other), "--eval_data_path", bundled_val]).eval_data_path == bundled_val


def test_a_run_on_other_data_says_it_does_not_evaluate(tiny_weights, small_data, tmp_path):
    save_dir, name = tiny_weights
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        os.path.join(ROOT, "trainer", "train_grpo.py"),
        "--max_steps",
        "1",
        "--save_dir",
        save_dir,
        "--from_weight",
        name,
        "--hidden_size",
        "64",
        "--num_hidden_layers",
        "2",
        "--data_path",
        small_data,
        "--batch_size",
        "2",
        "--num_generations",
        "2",
        "--max_gen_len",
        "4",
        "--run_dir",
        str(run_dir),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=dict(os.environ, WANDB_MODE="disabled")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out evaluation off: --data_path" in result.stdout and "--eval_data_path" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1] and not any(key.startswith("eval/") for key in rows[0])


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_the_torch_engine_gets_the_sampling_flags_only(script):
    from trainer.infra.flags import rollout_engine_kwargs

    assert rollout_engine_kwargs(parse(script, ["--top_k", "5", "--top_p", "0.9"])) == {"top_p": 0.9, "top_k": 5}


@pytest.mark.parametrize("flag", ["--sglang_model_path", "--ignore_eos", "--torch_logprobs"])
def test_flags_the_scripts_do_not_have_are_refused_by_argparse(flag, capsys):
    with pytest.raises(SystemExit):
        parse("grpo", [flag, "1"])
    assert f"unrecognized arguments: {flag} 1" in capsys.readouterr().err
