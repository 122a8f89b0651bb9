"""scripts/bench/lora_memory.py on the tiny shape: every configuration runs, and LoRA trains the hand-counted
adapter parameters of rank 16 plus the final norm's gain."""

import json
import math

from scripts.bench.lora_memory import main, table_row


def test_the_tiny_shape_runs_full_and_lora_for_both_scripts(tmp_path, capsys):
    out = tmp_path / "lora_memory.json"
    main(
        [
            "--shapes",
            "tiny",
            "--dtypes",
            "float32",
            "--steps",
            "2",
            "--rows",
            "2",
            "--prompt_len",
            "8",
            "--completion_len",
            "4",
            "--json_out",
            str(out),
        ]
    )
    results = json.loads(out.read_text())["results"]
    assert [(row["script"], row["dtype"]) for row in results] == [("grpo", "float32"), ("ppo", "float32")]
    hidden, heads, kv_heads, head_dim, layers = 64, 8, 4, 8, 2  # MiniMindConfig's defaults at hidden 64
    intermediate = math.ceil(hidden * math.pi / 64) * 64
    shapes = [
        (hidden, heads * head_dim),
        (hidden, kv_heads * head_dim),
        (hidden, kv_heads * head_dim),
        (heads * head_dim, hidden),
        (hidden, intermediate),
        (hidden, intermediate),
        (intermediate, hidden),
    ]
    adapters = layers * sum(16 * (fan_in + fan_out) for fan_in, fan_out in shapes)  # r (in + out) per projection
    for row in results:
        assert row["full"]["trainable_policy_parameters"] == row["full"]["policy_parameters"]
        assert row["lora"]["trainable_policy_parameters"] == adapters + hidden  # + the final norm's gain
        assert len(row["lora"]["step_s"]) == len(row["full"]["step_s"]) == 2
    ppo = results[1]
    # the LoRA critic trains its own adapters (the same count), its final norm's gain and the value head in full
    assert ppo["lora"]["trainable_critic_parameters"] == adapters + hidden + hidden + 1
    assert ppo["full"]["trainable_critic_parameters"] == ppo["full"]["policy_parameters"] + hidden + 1  # no LM head:
    # tied to the embeddings, so the critic holds every weight of the policy, plus the head
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| shape | script | dtype |") and len(lines) == 4


def test_a_full_run_stopped_for_memory_gives_an_upper_bound_of_the_ratio():
    row = {
        "shape": "qwen3-0.6b",
        "script": "ppo",
        "dtype": "float32",
        "full": {"stopped_at_mib": 18000.0},
        "lora": {"peak_rss_mib": 9000.0, "step_s": [3.0, 2.0, 4.0]},
    }
    assert table_row(row) == "| qwen3-0.6b | ppo | float32 | did not fit (> 18,000) | 9,000 | < 0.50 | - | 3.00 |"
