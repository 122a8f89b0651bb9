"""scripts/summarize_runs.py: a run's row from its metrics.jsonl and the evaluation tables, by hand."""

import json

import pytest

from scripts.summarize_runs import main


def test_a_run_row_holds_the_last_evaluation_the_means_and_the_median_step_time(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": 0, "eval/accuracy_sampled": 0.3, "eval/accuracy_greedy": 0.6},
        {
            "step": 1,
            "reward": 1.0,
            "response_len": 10.0,
            "entropy": 0.5,
            "frac_reward_zero_std": 0.25,
            "cispo_clip_ratio": 0.0,
            "elapsed_s": 2.0,
        },
        {
            "step": 2,
            "reward": 1.0,
            "response_len": 20.0,
            "entropy": 0.3,
            "frac_reward_zero_std": 0.75,
            "cispo_clip_ratio": 0.1,
            "elapsed_s": 5.0,
        },
        {
            "step": 3,
            "reward": 1.0,
            "response_len": 30.0,
            "entropy": 0.1,
            "frac_reward_zero_std": 0.5,
            "cispo_clip_ratio": 0.2,
            "elapsed_s": 12.0,
            "eval/accuracy_sampled": 0.4,
            "eval/accuracy_greedy": 0.7,
        },
        {
            "step": 4,
            "reward": 1.0,
            "response_len": 40.0,
            "entropy": 0.1,
            "frac_reward_zero_std": 0.5,
            "cispo_clip_ratio": 0.3,
            "elapsed_s": 16.0,
        },
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    table = tmp_path / "greedy.json"
    table.write_text(json.dumps({"w.pth": {"accuracy": 0.66}}))
    summaries = main(["--runs", f"a={run}", "--evals", f"greedy={table}", "--weights", "a=w.pth", "--last_steps", "2"])
    summary = summaries["a"]
    assert (summary["in_run_sampled"], summary["in_run_greedy"], summary["greedy"]) == (0.4, 0.7, 0.66)
    assert summary["response_len"] == pytest.approx(35.0)  # steps 3 and 4
    assert summary["entropy"] == pytest.approx(0.1)
    assert summary["frac_reward_zero_std"] == pytest.approx(0.5)  # (0.25 + 0.75 + 0.5 + 0.5) / 4
    assert summary["clip_fraction"] == pytest.approx(0.15)
    assert summary["seconds_per_step"] == pytest.approx(3.5)  # gaps 3 (step 2) and 4 (step 4); step 3 evaluated
    assert "| a | 0.660 | 0.400 | 0.700 | 35.0 |" in capsys.readouterr().out
