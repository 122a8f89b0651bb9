"""Metrics of a run: metrics.jsonl (+ wandb), the time estimate of the log line, the debug printout.

Infrastructure, not RL: a learner can skip this file.
"""
import json
import os
import time

import torch

from trainer.infra.distributed import Logger, is_main_process


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


class StepLog:
    """The log line and the metrics.jsonl row (+ tracker) of a step: every ``log_interval`` steps, at the last step
    and at every step the held-out evaluation ran. The line is the step, the rewards, ``log_line(metrics)`` (the
    script's part) and the time elapsed and left; the row adds step, total_steps, epoch, the learning rates, the
    wall time and the dataset indices of the step's prompts to ``metrics``.
    """

    def __init__(self, writer, total_steps, log_interval, log_line, start_step=0):
        self.writer = writer
        self.total_steps = total_steps
        self.log_interval = log_interval
        self.log_line = log_line
        self.timer = StepTimer(total_steps, start_step)

    def write(self, step, epoch, metrics, learning_rates, sample_indices):
        """Log ``metrics`` (a dict of floats, averaged over ranks) of ``step`` when due; returns them as logged.

        Args:
            learning_rates: {"learning_rate": ...} (and PPO's "critic_learning_rate"), the rates the step used.
            sample_indices: the dataset indices of this rank's prompts.
        """
        evaluated = any(key.startswith("eval/") for key in metrics)
        if not (step % self.log_interval == 0 or step == self.total_steps or evaluated):
            return metrics
        elapsed, remaining = self.timer.eta(step)
        metrics.update(step=step, total_steps=self.total_steps, epoch=epoch, **learning_rates,
                       elapsed_s=time.time() - self.timer.start, sample_indices=sample_indices)
        rewards = (f"reward {metrics['reward']:.3f} (rule {metrics['rule_reward']:.3f}, "
                   f"rm {metrics['reward_model_score']:.3f}, answer {metrics['answer_reward']:.3f})")
        Logger(f"step {step}/{self.total_steps} | {rewards} | {self.log_line(metrics)} | "
               f"{elapsed} elapsed, {remaining} left")
        self.writer.log(metrics)
        return metrics


def gpu_memory_metrics(device):
    """{"gpu_peak_memory_gib": peak memory allocated on ``device``} on a CUDA device; {} elsewhere."""
    if torch.device(device).type != "cuda":
        return {}
    return {"gpu_peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30}


def print_samples(step, prompts, completions, reward_parts, num_generations):
    """``--debug_mode``: each prompt of the step, its sampled answers and their reward parts (rank 0 prints)."""
    for i in range(0, len(completions), num_generations):
        Logger(f"[debug] step {step} prompt:\n{prompts[i]}")
        for j in range(i, i + num_generations):
            Logger(f"[debug] answer {j - i}: reward {reward_parts['rewards'][j]:.3f} "
                   f"(rule {reward_parts['rule_rewards'][j]:.3f}, rm {reward_parts['reward_model_scores'][j]:.3f}, "
                   f"answer {reward_parts['answer_rewards'][j]:.0f})\n{completions[j]}")
