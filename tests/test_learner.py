"""The learner's view: curves of a run, --debug_mode output, the eval table, the log line's ETA, the walkthrough."""
import json
import os
import re
import struct
import subprocess
import sys

from conftest import ROOT

TINY = ["--hidden_size", "64", "--num_hidden_layers", "2"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_script(args, cwd=ROOT, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def png_size(path):
    """(width, height) from the IHDR chunk that follows the 8-byte PNG signature (PNG spec, section 11.2.2)."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


# ----------------------------------------------------------------------------- scripts/plot_metrics.py
def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_plot_metrics_overlays_runs_and_reports_curves(tmp_path):
    grpo_rows = [{"step": s, "reward": 1.0 + 0.1 * s, "reward_model_score": 0.0, "kl_ref": 0.01 * s,
                  "policy_loss": -0.05, "response_len": 30 + s, "learning_rate": 5e-5} for s in range(1, 6)]
    ppo_rows = [{"step": s, "reward": 1.5, "reward_model_score": 0.0, "kl_ref": 0.02, "approx_kl": 1e-3,
                 "clipfrac": 0.01, "value_loss": 1.0 / s, "learning_rate": 1e-5} for s in range(1, 4)]
    write_jsonl(tmp_path / "grpo" / "metrics.jsonl", grpo_rows)
    write_jsonl(tmp_path / "ppo" / "metrics.jsonl", ppo_rows)
    out = tmp_path / "plots" / "runs.png"
    result = run_script(["scripts/plot_metrics.py", str(tmp_path / "grpo"), str(tmp_path / "ppo" / "metrics.jsonl"),
                         "--labels", "GRPO", "PPO", "--smooth", "2", "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    # Keys logged by at least one run, in the script's panel order; reward_model_score is 0 everywhere.
    assert "curves: reward, kl_ref, approx_kl, clipfrac, policy_loss, value_loss, response_len, learning_rate" \
        in result.stdout
    assert "skipped (0 at every step): reward_model_score" in result.stdout
    assert "run GRPO: 5 logged steps, last step 5" in result.stdout
    assert "run PPO: 3 logged steps, last step 3" in result.stdout
    assert out.stat().st_size > 1000
    # 8 panels in 3 columns -> 3 rows of 5 x 3.2 inches at 100 dpi.
    assert png_size(out) == (1500, 960)
    assert not [p for p in os.listdir(out.parent) if p != "runs.png"], "temporary file left behind"


def test_plot_metrics_default_out_and_one_key(tmp_path):
    write_jsonl(tmp_path / "run" / "metrics.jsonl", [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.7}])
    result = run_script(["scripts/plot_metrics.py", str(tmp_path / "run"), "--keys", "reward", "--columns", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "curves: reward\n" in result.stdout
    assert png_size(tmp_path / "run" / "metrics.png") == (500, 320)


def test_plot_metrics_bad_input_names_file_and_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward": 1.0}\n{"step": 2, "reward": \n')
    result = run_script(["scripts/plot_metrics.py", str(run_dir)])
    assert result.returncode == 1
    assert f"{run_dir / 'metrics.jsonl'}:2: not valid JSON" in result.stderr
    result = run_script(["scripts/plot_metrics.py", str(tmp_path / "missing")])
    assert result.returncode == 1 and f"{tmp_path / 'missing'} does not exist" in result.stderr
    result = run_script(["scripts/plot_metrics.py", str(run_dir), "--labels", "a", "b"])
    assert result.returncode == 2 and "--labels has 2 labels for 1 RUN_DIRs" in result.stderr


def test_moving_average_by_hand():
    from scripts.plot_metrics import moving_average
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([3.0, 6.0, 9.0], 5) == [3.0, 4.5, 6.0]


def test_readme_shows_the_default_runs_plot():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert "![" in text and "(docs/plots/default_runs.png)" in text
    assert "python scripts/plot_metrics.py" in text and "--out docs/plots/default_runs.png" in text
    assert png_size(os.path.join(ROOT, "docs", "plots", "default_runs.png"))[0] > 0
