"""trainer/infra/metrics.py: metrics.jsonl, SwanLab (upstream MiniMind's tracker) offline with the real package, and
the statistics PPO logs (explained variance, the advantages' std) against hand-computed values."""

import glob
import json
import math
import os

import pytest
import torch

from trainer.infra.metrics import MetricsWriter
from trainer.step_metrics import explained_variance, masked_std


def test_swanlab_offline_run_holds_the_config_and_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("swanlab", reason="swanlab is in requirements.txt; this environment lacks it")
    monkeypatch.delenv("SWANLAB_MODE", raising=False)  # the default: offline, no network, no login
    monkeypatch.chdir(tmp_path)
    writer = MetricsWriter(
        str(tmp_path / "run"),
        use_wandb=True,
        wandb_project="MiniMind-RL",
        run_name="t",
        config={"learning_rate": 2e-5},
        tracker="swanlab",
    )
    for step, reward in ((1, 4.5), (2, 4.25)):
        writer.log({"step": step, "reward_of_the_step": reward})
    writer.close()
    assert writer.wandb_id
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["reward_of_the_step"] for row in rows] == [4.5, 4.25]
    runs = glob.glob(str(tmp_path / "run" / "run-*"))
    assert len(runs) == 1 and writer.wandb_id in os.path.basename(runs[0])
    config = open(os.path.join(runs[0], "files", "config.yaml"), encoding="utf-8").read()
    assert "learning_rate:" in config and ("2e-05" in config or "2.0e-05" in config.lower())
    with open(glob.glob(os.path.join(runs[0], "*.swanlab"))[0], "rb") as f:
        assert b"reward_of_the_step" in f.read()


def test_unknown_tracker_is_refused(tmp_path):
    with pytest.raises(ValueError, match="wandb, swanlab"):
        MetricsWriter(str(tmp_path), tracker="tensorboard")


def test_explained_variance():
    mask = torch.tensor([[1, 1, 1, 0]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0, abs=1e-6)


def test_explained_variance_is_nan_when_returns_do_not_vary():
    # all returns equal: a clamped denominator would report 1.0 (values equal) or -888.5 (values off)
    returns = torch.full((2, 3), 1.5)
    mask = torch.ones(2, 3)
    assert math.isnan(explained_variance(returns.clone(), returns, mask))
    assert math.isnan(explained_variance(torch.tensor([[0.0, 1, 2], [3, 4, 5]]), returns, mask))


def test_advantages_std_metric_is_a_std_not_an_rms():
    advantages = torch.tensor([[3.0, 5.0, 99.0]])
    mask = torch.tensor([[1, 1, 0]])
    # real tokens 3 and 5: mean 4, population std 1 (the RMS would be sqrt(17) = 4.123)
    assert masked_std(advantages, mask).item() == pytest.approx(1.0)
