"""Metrics of a run: metrics.jsonl (+ wandb), the time estimate of the log line, the debug printout.

Infrastructure, not RL: a learner can skip this file.
"""
import json
import os
import time

from trainer.distributed import is_main_process


def format_duration(seconds):
    """Seconds -> 'H:MM:SS'."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


TRACKERS = ("wandb", "swanlab")


class MetricsWriter:
    """Appends one JSON object per step to ``run_dir/metrics.jsonl`` and mirrors it to a tracker: wandb, or
    SwanLab (upstream MiniMind's, which it imports as ``wandb``; both take the same ``init`` / ``log`` / ``finish``).

    Only the main process writes. The tracker is imported only when ``use_wandb`` is true. Both work without a
    network: ``WANDB_MODE=offline`` for wandb; SwanLab runs in ``SWANLAB_MODE`` (default ``offline``: the run is
    written under ``run_dir``, ``swanlab sync`` uploads it; ``SWANLAB_MODE=cloud`` after ``swanlab login``).
    Raises ValueError for an unknown ``tracker``.
    """

    def __init__(self, run_dir, use_wandb=False, wandb_project="MiniMind-RL", run_name=None, config=None,
                 wandb_id=None, tracker="wandb"):
        if tracker not in TRACKERS:
            raise ValueError(f"unknown tracker {tracker!r}; valid: {', '.join(TRACKERS)}")
        self.enabled = is_main_process()
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.wandb = None
        self.wandb_id = wandb_id
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if use_wandb and tracker == "swanlab":
            import swanlab
            self.wandb = swanlab
            run = swanlab.init(project=wandb_project, name=run_name, config=config, log_dir=run_dir, id=wandb_id,
                               resume="allow" if wandb_id else None,
                               mode=os.environ.get("SWANLAB_MODE", "offline"))
            self.wandb_id = run.id
        elif use_wandb:
            import wandb
            self.wandb = wandb
            # a resumed run passes its saved id, so wandb continues the same run
            run = wandb.init(project=wandb_project, name=run_name, config=config, dir=run_dir, id=wandb_id,
                             resume="allow" if wandb_id else None)
            self.wandb_id = run.id

    def log(self, metrics):
        """metrics: dict of str -> float/int (must include 'step')."""
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=int(metrics["step"]))

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()


class StepTimer:
    """Elapsed time and an estimate of the time left, for log lines."""

    def __init__(self, total_steps, start_step=0):
        self.start = time.time()
        self.total_steps = total_steps
        self.start_step = start_step

    def eta(self, step):
        """(elapsed 'H:MM:SS', remaining 'H:MM:SS') after ``step`` of ``total_steps``."""
        elapsed = time.time() - self.start
        done = max(step - self.start_step, 1)
        remaining = elapsed / done * (self.total_steps - step)
        return format_duration(elapsed), format_duration(remaining)


def open_metrics(args, progress):
    """(run_dir, MetricsWriter): ``--run_dir``, else the resumed run's folder, else
    ``{save_dir}/runs/{save_weight}-TIME``; a resumed run appends to its metrics and wandb run."""
    run_dir = args.run_dir or progress.get("run_dir") or os.path.join(
        args.save_dir, "runs", f"{args.save_weight}-{time.strftime('%Y%m%d-%H%M%S')}")
    writer = MetricsWriter(run_dir, args.use_wandb, args.wandb_project, os.path.basename(run_dir), vars(args),
                           wandb_id=progress.get("wandb_id"), tracker=args.tracker)
    return run_dir, writer
