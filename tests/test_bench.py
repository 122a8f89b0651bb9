"""scripts/bench.py: its FLOP count against torch's own counter, and its tiny mode end to end (no timing asserted)."""
import importlib.util
import json
import os
import subprocess
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import ROOT
from model.model_minimind import MiniMindForCausalLM
from scripts.bench import NUM_GENERATIONS, NUM_PROMPTS, PHASES, forward_flops
from trainer.checkpoints import build_config


def test_forward_flops_equal_torch_flop_counter():
    """Without the attention term (context 0) the count is every matrix product of a real forward."""
    config = build_config(64, 2, 0)
    model = MiniMindForCausalLM(config)
    input_ids = torch.randint(0, config.vocab_size, (3, 10))  # [B, T]
    with FlopCounterMode(display=False) as counter:
        model(input_ids, logits_to_keep=4)
    assert forward_flops(config, tokens=30, context=0, logit_positions=12) == counter.get_total_flops()


def test_tiny_bench_runs_every_contestant(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "scripts/bench.py", "--tiny", "--json", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["matmul_peak_gflops"]["float32"] > 0
    by_name = {row["contestant"]: row["result"] for row in report["results"] if row["dtype"] == "float32"}
    assert set(by_name) == {"ours_grpo", "trl_grpo", "ours_rollout", "hf_generate", "ours_ppo", "trl_ppo"}
    if importlib.util.find_spec("trl") is None:
        assert by_name.pop("trl_grpo") == {"skipped": "trl not installed (pip install -r requirements-bench.txt)"}
    if "skipped" in by_name["trl_ppo"]:
        assert "pip install --no-deps --target" in by_name.pop("trl_ppo")["skipped"]
    for name, figures in by_name.items():
        assert "error" not in figures, (name, figures)
        phases = figures["phases_s"]
        assert set(phases) == set(PHASES) | {"other"}
        # phases are medians over steps, so their sum is the median total only with one timed step (--tiny)
        assert abs(sum(phases.values()) - figures["step_s_median"]) < 1e-6 or phases["other"] == 0
        assert figures["rollout_tokens_per_s"] == NUM_PROMPTS * NUM_GENERATIONS * 8 / phases["rollout"]
        assert figures["peak_rss_mib"] > 0
    assert by_name["ours_grpo"]["phases_s"]["policy_backward"] > 0
    assert "| tiny (h64 x2), 8 tok, float32 | ours_grpo |" in result.stdout
    # --dtype auto: fp32 always, bf16 as well only where the CPU lists bf16 matrix units
    from scripts.bench import has_bf16_units
    expected_dtypes = {"float32", "bfloat16"} if has_bf16_units("cpu") else {"float32"}
    assert {row["dtype"] for row in report["results"]} == expected_dtypes


def test_bf16_units_are_read_from_the_cpu_flags(tmp_path, monkeypatch):
    import builtins

    from scripts.bench import has_bf16_units
    real_open = builtins.open
    for flags, expected in (("fpu avx2 avx512f", False), ("fpu avx512f avx512_bf16", True),
                            ("fpu amx_tile amx_bf16 amx_int8", True)):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(
            cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
        assert has_bf16_units("cpu") is expected, flags
    monkeypatch.setattr(builtins, "open", real_open)


def test_bench_levers_layouts_give_the_same_first_loss(tiny_weights, tmp_path):
    """scripts/bench_levers.py's runs: every forward layout computes step 1's loss from the same rollout, so the
    losses agree to float rounding (the bf16 variant is left out: it rounds differently)."""
    from scripts.bench_levers import VARIANTS, format_table, run_training
    save_dir, name = tiny_weights
    tiny = ["--from_weight", os.path.join(save_dir, f"{name}_64.pth"), "--hidden_size", "64",
            "--num_hidden_layers", "2", "--batch_size", "2", "--num_generations", "3", "--max_gen_len", "8"]
    results = {}
    for i, (variant, flags) in enumerate(VARIANTS["grpo"][:2]):
        seconds, loss, wall = run_training("grpo", tiny + flags, 2, str(tmp_path / str(i)), 600)
        assert len(seconds) == 1 and seconds[0] > 0 and wall > seconds[0]
        results[variant] = [(seconds[0], loss)]
    losses = [runs[0][1] for runs in results.values()]
    assert min(abs(loss) for loss in losses) > 1e-3, results  # a loss that is not 0, so agreeing means something
    assert max(losses) - min(losses) <= 1e-5, results
    table = format_table("grpo", results).splitlines()
    assert len(table) == 2 + 2
    expected_ratio = results[VARIANTS["grpo"][1][0]][0][0] / results[VARIANTS["grpo"][0][0]][0][0]
    assert table[3].split("|")[4].strip() == f"{expected_ratio:.2f}"  # --shared_prefix 0 against the defaults


def test_combine_runs_takes_the_median_of_the_run_medians():
    from scripts.bench import combine_runs
    runs = [{"step_s_median": s, "step_s_min": s - 0.1, "step_s_max": s + 0.1, "phases_s": {"rollout": r},
             "rollout_tokens_per_s": t, "mfu": None, "peak_rss_mib": m}
            for s, r, t, m in ((2.0, 1.0, 10.0, 500.0), (1.0, 0.4, 30.0, 700.0), (4.0, 2.0, 20.0, 600.0))]
    combined = combine_runs(runs)
    assert (combined["step_s_median"], combined["step_s_min"], combined["step_s_max"]) == (2.0, 1.0, 4.0)
    assert combined["phases_s"] == {"rollout": 1.0} and combined["rollout_tokens_per_s"] == 20.0
    assert combined["mfu"] is None and combined["peak_rss_mib"] == 700.0
    assert combined["runs"] == 3 and combined["run_medians"] == [2.0, 1.0, 4.0]
    assert combine_runs(runs[:1]) is runs[0]
    assert combine_runs([runs[0], {"error": "timed out after 5 s"}]) == {"error": "timed out after 5 s"}


def test_ratio_pairs_the_runs():
    from scripts.bench import ratio
    ours = {"step_s_median": 2.0, "run_medians": [1.0, 2.0, 4.0]}
    theirs = {"step_s_median": 4.0, "run_medians": [4.0, 2.0, 5.0]}
    assert ratio(ours, theirs, "step_s_median") == "0.80 (0.25-1.00)"  # pairs 0.25, 1.00, 0.80
    assert ratio({"step_s_median": 1.0}, {"step_s_median": 4.0}, "step_s_median") == "0.25"
    assert ratio(ours, None, "step_s_median") == "-"
    ours["rollout_tokens_per_s"], theirs["rollout_tokens_per_s"] = 10.0, 5.0
    assert ratio(ours, theirs, "rollout_tokens_per_s") == "1.25 (1.00-4.00)"  # theirs' time / ours: 4, 1, 1.25
