"""The run harness of both RL scripts: the bookkeeping around the algorithm that train_grpo.py and train_ppo.py
share. Infrastructure, not RL: a learner can skip this file.

``RLRun`` holds one run, in the order a script uses it:

    run = RLRun.build(args, "grpo", __file__, argv)      # processes, seed, tokenizer, prompts, held-out evaluator
    ...the script builds the roles of chapter 8.1 (policy, reference, reward model; PPO's critic) and optimizers...
    run.start(model, objects, weights, summary, log_line)  # resume, step-0 evaluation, rollout engine, metrics
    for step, batch in run.batches():                   # epochs, data position, stop requests
        ...the algorithm: rollout -> reward -> advantage -> loss -> backward -> clip -> step...
        run.guard.record(step, skipped, problems)       # updates skipped for a NaN or inf; stops after too many
        run.log(step, metrics, rates)                   # rank means, evaluation, log line, metrics.jsonl
        run.save_if_due(step)                           # atomic checkpoints, resume file, stop
    run.close()

Beside it, the pieces ``RLRun`` is made of: stop requests (``StopSignal``) and skipped updates (``nonfinite_parts``,
``BadStepGuard``); the data order that survives a resume is ``dataset.lm_dataset.ResumableBatchSampler``.
"""
import argparse
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from dataset.lm_dataset import RLAIFDataset, ResumableBatchSampler
from trainer.checkpoints import (
    build_config, check_tokenizer_fits_checkpoint, resume_command, save_checkpoint, start_or_resume, weight_path,
)
from trainer.distributed import Logger, any_rank, init_distributed_mode, mean_over_ranks, setup_seed
from trainer.dtypes import autocast_context, resolve_dtype, resolve_train_dtype, reward_model_dtype
from trainer.evaluation import HeldOutEvaluator
from trainer.flags import rollout_engine_kwargs
from trainer.metrics import MetricsWriter, StepTimer, open_metrics
from trainer.rollout_engine import create_rollout_engine


class StopSignal:
    """Turns SIGTERM / SIGINT (Ctrl-C) into a request that the loop honours at its next safe point.

    The loop calls ``requested(device)`` once per step; it agrees across ranks (any rank signalled), so every
    rank saves and exits at the same step. A second Ctrl-C aborts at once, without saving. Under torchrun the
    launcher forwards the signal to every worker and sends SIGKILL 30 s later: a step plus a save that take
    longer lose this save (the previous periodic checkpoint stays intact).
    """

    def __init__(self):
        self.signal_name = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        # only set a flag: printing from a handler can hit a print in progress ("reentrant call")
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def requested(self, device):
        """True when any rank has received SIGTERM or SIGINT (a collective: every rank calls it each step)."""
        stop = any_rank(self.signal_name is not None, device)
        if stop:
            Logger(f"{self.signal_name or 'a signal to another rank'} received: saving a resume checkpoint "
                   f"(under torchrun, within its 30 s before it sends SIGKILL)")
        return stop

    def restore(self):
        """Give SIGTERM / SIGINT back their default behaviour."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def nonfinite_parts(**tensors):
    """Names of the given tensors (or floats) that hold a NaN or inf, e.g. ['rewards', 'loss']."""
    bad = []
    for name, value in tensors.items():
        value = torch.as_tensor(value)
        if value.is_floating_point() and not torch.isfinite(value).all():
            bad.append(name)
    return bad


class BadStepGuard:
    """Counts updates that were skipped because of a NaN or inf (in the rewards, the loss or the gradients).

    ``record(step, skipped, problems)`` logs a skipped update and raises ``SystemExit`` (exit code 1, a clear
    message) once ``max_bad_steps`` updates in a row were skipped; a good step resets the count.
    """

    def __init__(self, max_bad_steps, in_a_row=0):
        self.max_bad_steps = max_bad_steps
        self.in_a_row = in_a_row

    def record(self, step, skipped, problems=()):
        """skipped: whether the update of ``step`` was skipped; problems: what was non-finite on this rank (empty
        when only another rank saw a NaN or inf)."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        what = ", ".join(problems) or "values on another rank"
        Logger(f"step {step}: update skipped, non-finite {what} "
               f"({self.in_a_row} in a row, --max_bad_steps {self.max_bad_steps})")
        if self.in_a_row >= self.max_bad_steps:
            raise SystemExit(f"stopping at step {step}: {self.in_a_row} updates in a row had non-finite "
                             f"{what}; the weights were not changed by them, and the last saved "
                             f"checkpoint holds no NaN. Lower --learning_rate or check the reward function.")


def count_total_steps(max_steps, epochs, steps_per_epoch):
    """Steps of the run: ``max_steps`` when set (capped by the data), else ``epochs`` full passes."""
    return min(max_steps, epochs * steps_per_epoch) if max_steps else epochs * steps_per_epoch


def evaluate_if_due(evaluator, model, step, total_steps, eval_interval):
    """The ``eval/...`` metrics of the held-out evaluation when it is due (step 0, every ``eval_interval``
    steps, the last step), with one log line; {} otherwise or without an evaluator."""
    if evaluator is None or not (step == 0 or step % eval_interval == 0 or step == total_steps):
        return {}
    metrics = evaluator(model, step)
    Logger(f"eval step {step} | held-out accuracy sampled {metrics['eval/accuracy_sampled']:.3f} "
           f"greedy {metrics['eval/accuracy_greedy']:.3f} | len {metrics['eval/response_len']:.1f} "
           f"({evaluator.num_prompts} prompts)")
    return metrics


@dataclass
class RLRun:
    """One RL run: what ``build`` sets up (processes, seed, tokenizer, prompt data, evaluator) and the loop's
    bookkeeping. The roles of chapter 8.1 are not built here: each script's ``main`` builds them.

    ``start`` adds the policy, the rollout engine, the metrics file and the resumed position. The policy (PPO's
    actor) is ``model`` here, never wrapped in DistributedDataParallel: the scripts wrap it themselves and pass
    the wrapper to what needs the gradient synchronised.
    """
    args: argparse.Namespace
    script: str  # "grpo" or "ppo": the resume file of one is refused by the other
    script_path: str  # the training script's file, for the resume command printed on a stop
    argv: Optional[list]  # its flags (None: sys.argv[1:])
    device: str
    rank: int
    world_size: int
    local_rank: int
    lm_config: Any  # MiniMindConfig
    tokenizer: Any
    dataset: RLAIFDataset
    batch_sampler: ResumableBatchSampler
    loader: DataLoader
    evaluator: Optional[HeldOutEvaluator]  # None with --eval_interval 0
    total_steps: int
    autocast: Any  # the training forwards' context under --dtype (autocast_context), reused by every forward
    reward_dtype: Optional[torch.dtype]  # the reward model's weights (--reward_dtype resolved; None without one)
    # set by start():
    model: Optional[torch.nn.Module] = None  # the policy, fp32 weights
    objects: dict = field(default_factory=dict)  # name -> model / optimizer / schedule / generator, resumable
    weights: dict = field(default_factory=dict)  # name in save_dir -> module saved as a MiniMind .pth
    progress: dict = field(default_factory=dict)  # step, epoch, batch_in_epoch, run_dir, wandb_id, bad steps
    rollout_engine: Any = None
    rollout_engine_state: Optional[dict] = None  # the engine's state from the resume file, if any
    run_dir: str = ""
    writer: Optional[MetricsWriter] = None
    stop_signal: Optional[StopSignal] = None
    guard: Optional[BadStepGuard] = None
    timer: Optional[StepTimer] = None
    log_line: Optional[Any] = None  # metrics -> str, the script's part of the log line
    # where the loop is (set by batches()):
    epoch: int = 0
    batch_in_epoch: int = 0
    sample_indices: list = field(default_factory=list)
    stop: bool = False  # a stop was requested (agreed by all ranks at the end of the step)

    @classmethod
    def build(cls, args, script, script_path, argv):
        """Set-up shared by both RL scripts before the roles exist: distributed init, the seed of the initial
        weights (the same on every rank), the tokenizer, and the prompt data, read and validated here so that a
        bad line is reported before any model is built.

        Raises:
            ValueError: when the data file has fewer prompts than one batch per rank (says how many of each).
            DataFormatError: a bad data line (file and line number).
        """
        local_rank, device = init_distributed_mode(args.device)
        setup_seed(args.seed)  # identical initial weights on every rank
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        args.dtype = resolve_train_dtype(args.dtype, device)  # "auto" -> what this device runs
        autocast = autocast_context(device, args.dtype)  # every training forward's context, entered one at a time
        # the frozen reward model's dtype: --reward_dtype, else half precision on a GPU, the weights' fp32 on a CPU
        reward_dtype = None if args.reward_model_path == "none" else resolve_dtype(
            args.reward_dtype, reward_model_dtype(args.reward_device or device, torch.float32))
        lm_config = build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
        check_tokenizer_fits_checkpoint(tokenizer, args.tokenizer_path, None if args.from_weight == "none" else
                                        weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe))
        dataset = RLAIFDataset(args.data_path, tokenizer, thinking_ratio=args.thinking_ratio, seed=args.seed)
        needed = args.batch_size * world_size
        if len(dataset) < needed:
            raise ValueError(f"--data_path {args.data_path}: found {len(dataset)} prompts, need at least {needed} "
                             f"(--batch_size {args.batch_size} x {world_size} processes) for one full batch")
        long_prompts = dataset.count_longer_than(args.max_seq_len)
        if long_prompts:
            Logger(f"warning: {long_prompts} of {len(dataset)} prompts are longer than --max_seq_len "
                   f"{args.max_seq_len} tokens; they are cut from the left so the generation prompt survives")
        batch_sampler = ResumableBatchSampler(dataset, args.batch_size, world_size, rank, args.seed)
        # its own generator: creating the loader's iterator must not draw from the global RNG (exact resume)
        loader = DataLoader(dataset, batch_sampler=batch_sampler, num_workers=args.num_workers,
                            generator=torch.Generator().manual_seed(args.seed))
        total_steps = count_total_steps(args.max_steps, args.epochs, len(loader))
        evaluator = None
        if args.eval_interval and not args.eval_data_path:
            Logger(f"held-out evaluation off: --data_path {args.data_path} is not the bundled training data, whose "
                   f"validation prompts the evaluation would use; pass --eval_data_path FILE to evaluate")
        elif args.eval_interval:
            eval_dataset = RLAIFDataset(args.eval_data_path, tokenizer, thinking_ratio=1.0, seed=args.seed)
            evaluator = HeldOutEvaluator(eval_dataset, tokenizer, args.eval_num_prompts, args.temperature,
                                         args.max_gen_len, args.max_seq_len, device)
        return cls(args=args, script=script, script_path=script_path, argv=argv, device=device, rank=rank,
                   world_size=world_size, local_rank=local_rank, lm_config=lm_config, tokenizer=tokenizer,
                   dataset=dataset, batch_sampler=batch_sampler, loader=loader, evaluator=evaluator,
                   total_steps=total_steps, autocast=autocast, reward_dtype=reward_dtype)

    def start(self, model, objects, weights, summary, log_line):
        """Resume (``--from_resume 1``) or start at step 0, evaluate the starting policy on the held-out prompts
        (step 0), make the rollout engine for the policy ``model``, and open the metrics.

        Args:
            model: the policy (PPO's actor), not wrapped: the rollout engine samples from it, the evaluation
                scores it, the log reads its final norm gain.
            objects: name -> model / optimizer / schedule / generator restored on resume and saved with it.
            weights: name in ``save_dir`` -> module saved as a MiniMind fp16 .pth at every checkpoint.
            summary: the run's one-line description (", metrics in DIR" is appended).
            log_line: metrics -> the script's part of the log line (after the rewards, before the times).
        """
        args = self.args
        self.model, self.objects, self.weights, self.log_line = model, objects, weights, log_line
        Logger(f"{self.script.upper()}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
               f"{len(self.dataset)} prompts, world size {self.world_size}, device {self.device}, dtype {args.dtype}")
        self.progress = start_or_resume(args, self.script, self, objects, len(self.loader))
        self.guard = BadStepGuard(args.max_bad_steps, self.progress["bad_steps_in_a_row"])
        self.stop_signal = StopSignal()  # from here on Ctrl-C / SIGTERM wait for the end of a step
        eval_metrics = {}  # the starting policy on the held-out prompts (step 0; a resumed run has its own)
        if self.progress["step"] == 0 and self.evaluator is not None:
            eval_metrics = evaluate_if_due(self.evaluator, self.model, 0, self.total_steps, args.eval_interval)
        # made after the restore: the SGLang engine pushes the (restored) policy to its server at start-up
        self.rollout_engine = create_rollout_engine(args.rollout_engine, self.model, self.tokenizer,
                                                    **rollout_engine_kwargs(args))
        if self.rollout_engine_state is not None:
            self.rollout_engine.load_resume_state(self.rollout_engine_state)
        self.run_dir, self.writer = open_metrics(args, self.progress)
        Logger(f"{summary}, metrics in {self.run_dir}")
        if eval_metrics:
            self.writer.log({"step": 0, **eval_metrics})
        self.timer = StepTimer(self.total_steps, start_step=self.progress["step"])  # after the step-0 evaluation

    def batches(self):
        """Yield (step, batch) from the resumed position to the last step, epoch after epoch.

        A batch is a dict of lists: "prompt", "answer" (str) and "index" (a tensor of dataset indices).
        The generator ends after ``total_steps`` or after the step in which a stop was requested.
        """
        step = self.progress["step"]
        for epoch in range(self.progress["epoch"], self.args.epochs):
            if step >= self.total_steps:
                return
            skip_batches = self.progress["batch_in_epoch"] if epoch == self.progress["epoch"] else 0
            self.batch_sampler.set_epoch(epoch, skip_batches)
            for batch_in_epoch, batch in enumerate(self.loader, start=self.batch_sampler.skip_batches + 1):
                step += 1
                self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
                self.sample_indices = batch["index"].tolist()
                yield step, batch
                if self.stop or step >= self.total_steps:
                    return

    def print_samples_if_due(self, step, prompts, completions, reward_parts, num_generations):
        """``--debug_mode``: every ``--debug_interval`` steps, each prompt, its sampled answers and their reward
        parts (rank 0 only)."""
        if not self.args.debug_mode or step % self.args.debug_interval:
            return
        for i in range(0, len(completions), num_generations):
            Logger(f"[debug] step {step} prompt:\n{prompts[i]}")
            for j in range(i, i + num_generations):
                Logger(f"[debug] answer {j - i}: reward {reward_parts['rewards'][j]:.3f} "
                       f"(rule {reward_parts['rule_rewards'][j]:.3f}, rm {reward_parts['reward_model_scores'][j]:.3f}, "
                       f"answer {reward_parts['answer_rewards'][j]:.0f})\n{completions[j]}")

    def log(self, step, metrics, learning_rates):
        """Average ``metrics`` over ranks, add the final norm gain and the held-out evaluation when due, and
        write the log line and metrics.jsonl (+ wandb) every ``--log_interval`` steps.

        Args:
            metrics: dict of floats from this rank's step.
            learning_rates: {"learning_rate": ...} (and PPO's "critic_learning_rate"), the rates the step used.
        Returns the metrics as logged.
        """
        args = self.args
        metrics = mean_over_ranks(metrics, self.device)
        metrics["final_norm_gain"] = self.model.model.norm.weight.mean().item()  # the output's sharpness
        if torch.device(self.device).type == "cuda":
            metrics["gpu_peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2 ** 30
        eval_metrics = evaluate_if_due(self.evaluator, self.model, step, self.total_steps, args.eval_interval)
        metrics.update(eval_metrics)
        if step % args.log_interval == 0 or step == self.total_steps or eval_metrics:
            elapsed, remaining = self.timer.eta(step)
            metrics.update(step=step, total_steps=self.total_steps, epoch=self.epoch, **learning_rates,
                           elapsed_s=time.time() - self.timer.start, sample_indices=self.sample_indices)
            rewards = (f"reward {metrics['reward']:.3f} (rule {metrics['rule_reward']:.3f}, "
                       f"rm {metrics['reward_model_score']:.3f}, answer {metrics['answer_reward']:.3f})")
            Logger(f"step {step}/{self.total_steps} | {rewards} | {self.log_line(metrics)} | "
                   f"{elapsed} elapsed, {remaining} left")
            self.writer.log(metrics)
        return metrics

    def save_if_due(self, step):
        """Agree across ranks whether a stop was requested; checkpoint every ``--save_interval`` steps, at the
        last step and on a stop (then print the command that resumes)."""
        args = self.args
        self.stop = self.stop_signal.requested(self.device)
        if step % args.save_interval == 0 or step == self.total_steps or self.stop:
            self.progress.update(step=step, epoch=self.epoch, batch_in_epoch=self.batch_in_epoch,
                                 run_dir=self.run_dir, wandb_id=self.writer.wandb_id,
                                 bad_steps_in_a_row=self.guard.in_a_row)
            path = self.save()
            Logger(f"saved step {step}: weights ({', '.join(self.weights)}) and {path}")
        if self.stop:
            argv = sys.argv[1:] if self.argv is None else self.argv
            command = resume_command(self.script_path, argv, self.world_size)
            Logger(f"stopped by {self.stop_signal.signal_name or 'a signal to another rank'} at step {step}; "
                   f"resume with:\n  {command}")

    def save(self):
        """One checkpoint (``save_checkpoint``) at ``self.progress``; returns the resume file's path."""
        objects = dict(self.objects, rollout_engine=self.rollout_engine)  # its state is saved, restored by start()
        return save_checkpoint(self.args, self.script, self.lm_config, objects, self.progress, self.weights)

    def close(self):
        """Print the held-out summary, close the metrics (and wandb), give the signals back."""
        if self.evaluator is not None:
            for line in self.evaluator.summary_lines():
                Logger(line)
        self.writer.close()
        self.stop_signal.restore()
