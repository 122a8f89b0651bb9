"""scripts/rl_report.py: the pass@k estimator against a plain enumeration, the kinds of wrong answers on
hand-written answers, and a small report end to end."""

import itertools
import json
import os

import pytest

from scripts.rl_report import ERROR_KINDS, error_kind, main, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_correct_answer(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            enumerated = sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(enumerated, abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


@pytest.mark.parametrize(
    "question, completion, reference, expected",
    [
        (
            "987 减 47 是多少？",
            "987 减 47, ones first:\n7-7-0=0\n8-4-0=4\n9-0-0=9\n所以差是 940。\n</think>\n\n答案是 940。",
            "940",
            None,
        ),
        (
            "987 减 47 是多少？",
            "987 减 74, ones first:\n7-4-0=3\n8-7-0=1\n9-0-0=9\n所以差是 913。\n</think>\n\n答案是 913。",
            "940",
            "operand copied wrong",
        ),
        (
            "What is 474 - 48?",
            "474 - 48, ones first:\n4-8-0=6\n7-4-1=2\n4-0-0=4\n so 426\n</think>\n\nThe answer is 436.",
            "426",
            "arithmetic wrong",
        ),
        ("What is 474 - 48?", "474 - 48, ones first:\n4-8-0=6\n7-4-1=2\n4-0-0=4", "426", "format"),
        ("What is 474 - 48?", "474 - 48, ones first:\n</think>\n\nI do not know.", "426", "no final number"),
        ("What is 474 - 48?", "\n</think>\n\nThe answer is 430.", "426", "wrong without thinking"),
        ("Compute 821 minus 592.", "\n</think>\n\nThe answer is 229.", "229", None),
    ],
)
def test_error_kinds_of_hand_written_answers(question, completion, reference, expected):
    assert error_kind(question, completion, reference) == expected


def test_a_small_report_end_to_end(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    out_dir = tmp_path / "report"
    report = main(
        [
            "--weights",
            name,
            "--save_dir",
            save_dir,
            "--hidden_size",
            "64",
            "--num_hidden_layers",
            "2",
            "--num_prompts",
            "6",
            "--num_samples",
            "3",
            "--temperatures",
            "0",
            "1.0",
            "--max_gen_len",
            "6",
            "--batch_size",
            "6",
            "--out_dir",
            str(out_dir),
        ]
    )
    for file_name in ("report.json", "accuracy_vs_temperature.png", "pass_at_k.png", "error_kinds.md"):
        assert os.path.isfile(out_dir / file_name), file_name
    result = json.loads((out_dir / "report.json").read_text())["checkpoints"][name]
    assert set(result["accuracy"]) == {"greedy", "1"} and sorted(result["pass_at_k"]) == ["1", "2", "3"]
    pass_k = [result["pass_at_k"][k] for k in ("1", "2", "3")]
    assert pass_k == sorted(pass_k)  # pass@k never falls with k
    assert result["answers"] == 6 * 3 and 0 <= result["wrong_answers"] <= 18
    if result["wrong_answers"]:
        assert sum(result["error_kinds"].values()) == pytest.approx(1.0)
    assert set(result["error_kinds"]) == set(ERROR_KINDS) and report["num_prompts"] == 6
