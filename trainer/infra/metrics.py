"""Metrics of a run: metrics.jsonl (+ wandb), the time estimate of the log line, the debug printout. What each
algorithm logs per step is ``trainer/step_metrics.py``.

Infrastructure, not RL: a learner can skip this file.
"""

import functools
import itertools
import json
import os
import time

import torch

from trainer.infra.distributed import Logger, broadcast_from_rank0, is_main_process, run_on_rank0
from trainer.infra.files import atomic_write, describe_failure


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

    def __init__(
        self,
        run_dir,
        use_wandb=False,
        wandb_project="MiniMind-RL",
        run_name=None,
        config=None,
        wandb_id=None,
        tracker="wandb",
    ):
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
            run = swanlab.init(
                project=wandb_project,
                name=run_name,
                config=config,
                log_dir=run_dir,
                id=wandb_id,
                resume="allow" if wandb_id else None,
                mode=os.environ.get("SWANLAB_MODE", "offline"),
            )
            self.wandb_id = run.id
        elif use_wandb:
            import wandb

            self.wandb = wandb
            # a resumed run passes its saved id, so wandb continues the same run
            run = wandb.init(
                project=wandb_project,
                name=run_name,
                config=config,
                dir=run_dir,
                id=wandb_id,
                resume="allow" if wandb_id else None,
            )
            self.wandb_id = run.id

    def log(self, metrics):
        """Append ``metrics`` (dict of str -> float/int, with 'step') as one line, whole or not at all.

        Raises:
            OSError: naming ``self.path``, the step and the cause (a full disk as such); the file is cut back to
                its last whole row, so a resume appends after it.
        """
        if not self.enabled:
            return
        line = json.dumps(metrics) + "\n"
        size = os.path.getsize(self.path) if os.path.isfile(self.path) else 0
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
        except OSError as err:
            try:
                os.truncate(self.path, size)  # no cut row left behind
            except OSError:
                pass
            raise OSError(
                err.errno,
                f"could not write the metrics row of step {metrics.get('step')} to {self.path}: "
                f"{describe_failure(err, os.path.dirname(os.path.abspath(self.path)))}; free "
                f"space, then rerun with --from_resume 1 (rows after the last checkpoint are "
                f"written again)",
            ) from err
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
    """(run_dir, MetricsWriter): ``--run_dir``, else the resumed run's folder, else a new folder of its own
    (``new_run_dir``). A resumed run (``progress["saved_step"]`` set) first drops the rows past its checkpoint's step
    and a cut last line (``trim_metrics``), then appends to its metrics and wandb run."""
    run_dir = args.run_dir or progress.get("run_dir") or new_run_dir(args.save_dir, args.save_weight)
    if progress.get("saved_step") is not None and is_main_process():
        for line in trim_metrics(os.path.join(run_dir, "metrics.jsonl"), progress["saved_step"]):
            Logger(line)
    writer = MetricsWriter(
        run_dir,
        args.use_wandb,
        args.wandb_project,
        os.path.basename(run_dir),
        vars(args),
        wandb_id=progress.get("wandb_id"),
        tracker=args.tracker,
    )
    return run_dir, writer


def new_run_dir(save_dir, save_weight):
    """A metrics folder no other run has: ``{save_dir}/runs/{save_weight}-YYYYmmdd-HHMMSS``, with ``-2``, ``-3``, ...
    when that exists (created by an exclusive ``mkdir``, so two runs started in the same second get two folders).
    A collective: rank 0 creates it, every rank returns its path. Raises OSError naming the folder."""
    base = os.path.join(save_dir, "runs", f"{save_weight}-{time.strftime('%Y%m%d-%H%M%S')}")
    created = {}

    def create():
        os.makedirs(os.path.dirname(base), exist_ok=True)
        for n in itertools.count(1):
            candidate = base if n == 1 else f"{base}-{n}"
            try:
                os.mkdir(candidate)
            except FileExistsError:
                continue
            created["path"] = candidate
            return

    run_on_rank0(create, f"creating a metrics folder under {os.path.dirname(base)}")
    return broadcast_from_rank0(created.get("path"))


def trim_metrics(path, last_step):
    """Drop what a resumed run writes again from the metrics file at ``path``: the rows past ``last_step`` (written
    after the checkpoint it resumes from) and a cut or unreadable line (a crash or a full disk mid-row). The dropped
    lines are kept, unchanged, in ``{path}.dropped-after-step-{last_step}`` (``-2``, ... when that exists).

    Returns:
        lines to print (empty when nothing was dropped or there is no file).
    Raises:
        OSError: naming the file when it cannot be rewritten.
    """
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        raw_lines = f.read().splitlines(keepends=True)
    kept, dropped, dropped_steps = [], [], []
    for raw in raw_lines:
        try:
            row = json.loads(raw) if raw.endswith(b"\n") else None
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            kept.append(raw)
            continue
        dropped.append(raw)
        dropped_steps.append(row.get("step") if isinstance(row, dict) else "a cut line")
    if not dropped:
        return []
    for n in itertools.count(1):
        copy = f"{path}.dropped-after-step-{last_step}" + ("" if n == 1 else f"-{n}")
        if not os.path.exists(copy):
            break

    def write_lines(lines, tmp):
        with open(tmp, "wb") as f:
            f.writelines(lines)

    atomic_write({copy: functools.partial(write_lines, dropped), path: functools.partial(write_lines, kept)})
    return [
        f"{path}: {len(dropped)} rows after the checkpoint's step {last_step} (steps "
        f"{', '.join(map(str, dropped_steps[:8]))}) moved to {copy}; this run writes those steps again"
    ]


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
        metrics.update(
            step=step,
            total_steps=self.total_steps,
            epoch=epoch,
            **learning_rates,
            elapsed_s=time.time() - self.timer.start,
            sample_indices=sample_indices,
        )
        rewards = (
            f"reward {metrics['reward']:.3f} (rule {metrics['rule_reward']:.3f}, "
            f"rm {metrics['reward_model_score']:.3f}, answer {metrics['answer_reward']:.3f})"
        )
        Logger(
            f"step {step}/{self.total_steps} | {rewards} | {self.log_line(metrics)} | "
            f"{elapsed} elapsed, {remaining} left"
        )
        self.writer.log(metrics)
        return metrics


def gpu_memory_metrics(device):
    """{"gpu_peak_memory_gib": peak memory allocated by tensors on ``device``, "gpu_peak_reserved_gib": peak memory
    held by torch's caching allocator (what the GPU must have)} on a CUDA device; {} elsewhere."""
    if torch.device(device).type != "cuda":
        return {}
    return {
        "gpu_peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def print_samples(step, prompts, completions, reward_parts, num_generations):
    """``--debug_mode``: each prompt of the step, its sampled answers and their reward parts (rank 0 prints)."""
    for i in range(0, len(completions), num_generations):
        Logger(f"[debug] step {step} prompt:\n{prompts[i]}")
        for j in range(i, i + num_generations):
            Logger(
                f"[debug] answer {j - i}: reward {reward_parts['rewards'][j]:.3f} "
                f"(rule {reward_parts['rule_rewards'][j]:.3f}, rm {reward_parts['reward_model_scores'][j]:.3f}, "
                f"answer {reward_parts['answer_rewards'][j]:.0f})\n{completions[j]}"
            )


# ----------------------------------------------------------------------------- statistics PPO logs


def mask_segments(tokenizer, ids, mask):
    """[(mask value, text)] of the runs of equal mask in one conversation's tokens (``--debug_mode``)."""
    segments, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            segments.append((mask[start], tokenizer.decode(ids[start:end], skip_special_tokens=False)))
            start = end
    return segments


def print_conversations(step, rollout_batch, tokenizer, num_generations):
    """``--debug_mode``: every conversation of the step, whole, in runs marked by their mask (1: the model's
    tokens, trained; 0: prompt, tool replies and template tokens, seen only), with its reward parts."""
    rollout, parts = rollout_batch.rollout, rollout_batch.reward_parts
    prompt_width = rollout.output_ids.size(1) - rollout.completion_ids.size(1)
    for n in range(rollout.output_ids.size(0)):
        keep = rollout.attention_mask[n].bool().cpu()
        mask = torch.cat([torch.zeros(prompt_width, dtype=torch.long), rollout_batch.completion_mask[n].cpu()])
        ids, mask = rollout.output_ids[n].cpu()[keep].tolist(), mask[keep].tolist()
        Logger(
            f"[debug] step {step} prompt {n // num_generations} answer {n % num_generations}: reward "
            f"{parts['rewards'][n]:.3f} (rule {parts['rule_rewards'][n]:.3f}, rm "
            f"{parts['reward_model_scores'][n]:.3f}, calls {parts['call_rewards'][n]:.2f}, gt "
            f"{parts['answer_rewards'][n]:.2f}), {rollout.num_turns[n]} turns, {rollout.num_tool_calls[n]} calls "
            f"({rollout.num_valid_calls[n]} valid)"
        )
        for value, text in mask_segments(tokenizer, ids, mask):
            Logger(f"[mask {value}: {'trained' if value else 'not trained'}]\n{text}")
