"""trainer/infra/metrics.py: metrics.jsonl, and SwanLab (upstream MiniMind's tracker) offline, with the real package."""
import glob
import json
import os

import pytest

from trainer.infra.metrics import MetricsWriter


def test_swanlab_offline_run_holds_the_config_and_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("swanlab", reason="swanlab is in requirements.txt; this environment lacks it")
    monkeypatch.delenv("SWANLAB_MODE", raising=False)  # the default: offline, no network, no login
    monkeypatch.chdir(tmp_path)
    writer = MetricsWriter(str(tmp_path / "run"), use_wandb=True, wandb_project="MiniMind-RL", run_name="t",
                           config={"learning_rate": 2e-5}, tracker="swanlab")
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
