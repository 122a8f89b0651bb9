"""scripts/dev/check_same_numbers.py: the same seed gives the same numbers, and the comparison sees a one-ulp change."""

import importlib.util
import math
import os

from conftest import ROOT

spec = importlib.util.spec_from_file_location(
    "check_same_numbers", os.path.join(ROOT, "scripts", "dev", "check_same_numbers.py")
)
check_same_numbers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_same_numbers)


def test_compare_rows_finds_a_one_ulp_change_a_key_order_and_a_missing_row():
    rows = [{"step": 0, "eval/accuracy_sampled": 0.375}, {"step": 1, "reward": 4.5867204666137695, "loss": -0.06}]
    assert check_same_numbers.compare_rows(rows, [dict(row) for row in rows]) == []
    one_ulp = [rows[0], dict(rows[1], reward=math.nextafter(4.5867204666137695, 5.0))]
    assert check_same_numbers.compare_rows(rows, one_ulp) == [
        "row 1 (step 1) reward: 4.58672046661377 instead of 4.5867204666137695"
    ]
    reordered = [rows[0], {"step": 1, "loss": -0.06, "reward": 4.5867204666137695}]
    assert check_same_numbers.compare_rows(rows, reordered) == [
        "row 1 (step 1): keys ['step', 'loss', 'reward'] instead of ['step', 'reward', 'loss']"
    ]
    assert check_same_numbers.compare_rows(rows, rows[:1]) == ["1 rows instead of 2"]


def test_new_keys_are_allowed_only_when_asked_and_old_keys_still_compared():
    expected = [{"step": 1, "reward": 4.5, "loss": -0.06}]
    with_new = [{"step": 1, "reward": 4.5, "entropy": 0.09, "loss": -0.06}]
    assert check_same_numbers.compare_rows(expected, with_new) == [
        "row 0 (step 1): keys ['step', 'reward', 'entropy', 'loss'] instead of ['step', 'reward', 'loss']"
    ]
    assert check_same_numbers.compare_rows(expected, with_new, allow_new_keys=True) == []
    changed = [dict(with_new[0], loss=-0.07)]
    assert check_same_numbers.compare_rows(expected, changed, allow_new_keys=True) == [
        "row 0 (step 1) loss: -0.07 instead of -0.06"
    ]
    missing = [{"step": 1, "entropy": 0.09, "loss": -0.06}]
    assert check_same_numbers.compare_rows(expected, missing, allow_new_keys=True) == [
        "row 0 (step 1): keys ['step', 'loss'] instead of ['step', 'reward', 'loss']"
    ]


def test_both_scripts_give_the_same_numbers_twice(tmp_path, tiny_weights):
    """Two runs of each script with the same seed, one thread: every logged number equal, bit for bit (what the
    comparison against a git revision relies on). A tiny policy (hidden 64, 2 layers) with the bundled reward model."""
    tiny = [
        "--eval_interval",
        "0",
        "--hidden_size",
        "64",
        "--num_hidden_layers",
        "2",
        "--from_weight",
        os.path.join(tiny_weights[0], f"{tiny_weights[1]}_64.pth"),
    ]
    for script in ("grpo", "ppo"):
        first, second = (
            check_same_numbers.run_metrics(ROOT, script, 2, tiny, str(tmp_path / f"{script}{i}")) for i in range(2)
        )
        assert len(first) == 2 and first[0]["step"] == 1 and "reward" in first[0]
        assert check_same_numbers.compare_rows(first, second) == []
