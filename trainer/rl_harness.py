"""The run harness of both RL scripts: everything around the algorithm that train_grpo.py and train_ppo.py share.

The flags both scripts take (``add_common_rl_args``), the set-up of one run (``RLRun.build``: processes, seed,
policy, frozen reference, reward model, data, held-out evaluator), and the loop's infrastructure, in the
order one step uses it:

    run = RLRun.build(args, "grpo", __file__, argv, reward_fn)     # chapter 8.1: the roles
    run.start(objects, weights, summary, log_line)                  # resume, rollout engine, metrics, step-0 eval
    for step, batch in run.batches():                               # epochs, data position, stop requests
        ...the algorithm: rollout -> reward -> advantage -> loss -> backward...
        norms, problems = nan_safe_step(models, optimizers, grad_clip, problems, device)
        run.log(step, metrics, rates)                               # rank means, evaluation, log line, metrics.jsonl
        run.save_if_due(step)                                       # atomic checkpoints, resume file, stop
    run.close()

Nothing here is specific to GRPO or PPO: the scripts pass what differs (the reward function, the objects to
checkpoint, the log line).
"""
import argparse
import hashlib
import json
import math
import os
import random
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from dataset.lm_dataset import RLAIFDataset
from trainer.evaluation import HeldOutEvaluator
from trainer.rollout_engine import (
    ROLLOUT_ENGINES, SGLANG_LOGPROB_MODES, TORCH_LOGPROB_MODES, create_rollout_engine,
)
from trainer.tokenizer_check import check_tokenizer_fits_checkpoint, write_tokenizer_record
from trainer.trainer_utils import (
    DEFAULT_REWARD_MODEL_PATH, DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, DTYPE_CHOICES, DTYPES, ROOT,
    LMForRewardModel, Logger, add_bool_flag, atomic_save, build_config, check_writable_dir,
    half_state_dict, init_distributed_mode, init_model, is_main_process, load_optimizer_state,
    project_scale_only_gradients,
    read_reward_model_config, resolve_dtype, resolve_train_dtype, setup_seed, unwrap_model, weight_path,
)


RESUME_FORMAT_VERSION = 1
ARCHITECTURE_FLAGS = ("hidden_size", "num_hidden_layers", "use_moe")


# ----------------------------------------------------------------------------- rank agreement, metrics, timing
def get_rng_state():
    """This process's random states (Python, NumPy, torch CPU, torch CUDA) as a picklable dict."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        # NumPy's key array as a tensor, so the resume file loads with torch.load(weights_only=True)
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state):
    """Restore what ``get_rng_state`` returned (the CUDA states only when CUDA is present)."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"].cpu())
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def format_duration(seconds):
    """Seconds -> 'H:MM:SS'."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsWriter:
    """Appends one JSON object per step to ``run_dir/metrics.jsonl`` and mirrors it to wandb.

    Only the main process writes. ``wandb`` is imported only when ``use_wandb`` is true
    (``WANDB_MODE=offline`` works without a network).
    """

    def __init__(self, run_dir, use_wandb=False, wandb_project="MiniMind-RL", run_name=None, config=None,
                 wandb_id=None):
        self.enabled = is_main_process()
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.wandb = None
        self.wandb_id = wandb_id
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if use_wandb:
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


def resume_path(save_weight, save_dir, hidden_size, use_moe):
    """MiniMind's resume file name: ``{save_dir}/{save_weight}_{hidden}[_moe]_resume.pth``."""
    suffix = "_moe" if use_moe else ""
    return os.path.join(save_dir, f"{save_weight}_{hidden_size}{suffix}_resume.pth")


def check_finite_state(state_dict, what):
    """Raise ValueError naming ``what`` and the first tensor that holds a NaN or inf (checkpoints never do)."""
    for name, tensor in state_dict.items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"refusing to save {what}: {name} holds a NaN or inf")


def gather_rng_states():
    """Every rank's ``get_rng_state()`` as a list indexed by rank (a collective: all ranks must call it)."""
    state = get_rng_state()
    if not dist.is_initialized():
        return [state]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def save_resume(path, script, args, progress, states):
    """Write a resume checkpoint (atomically, rank 0). A collective: every rank must call it.

    Args:
        path: the resume file (``resume_path``).
        script: 'grpo' or 'ppo'; a resume by another script is refused.
        args: the run's argparse namespace (stored as a dict, checked on resume).
        progress: dict with step, epoch, batch_in_epoch (batches of ``epoch`` already trained on),
            world_size, run_dir, wandb_id, ... (plain values).
        states: name -> state_dict (model fp32, optimizer, scheduler, critic, generator states ...).
    Raises:
        ValueError: if a model/critic state holds a NaN or inf (nothing is written).
        OSError: naming ``path`` when it cannot be written (the previous file stays as it was).
    """
    rng_states = gather_rng_states()
    if not is_main_process():
        return
    for name, state in states.items():
        if name in ("model", "critic"):
            check_finite_state(state, f"{name} to {path}")
    checkpoint = {
        "format_version": RESUME_FORMAT_VERSION,
        "script": script,
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
        "progress": dict(progress),
        "rng_states": rng_states,
        "states": states,
    }
    atomic_save(checkpoint, path)


def load_resume(path, script, args):
    """Read and check a resume checkpoint written by ``save_resume``.

    Returns:
        the checkpoint dict, or None when ``path`` does not exist (the run then starts at step 0).
    Raises:
        ValueError: naming the file and the mismatch -- another format version, another script, or an
            architecture flag (``--hidden_size``, ``--num_hidden_layers``, ``--use_moe``) with both values.
    """
    if not os.path.isfile(path):
        return None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file
        raise ValueError(f"{path} is not a readable resume checkpoint ({type(err).__name__}: {err})") from err
    if not isinstance(checkpoint, dict) or checkpoint.get("format_version") != RESUME_FORMAT_VERSION:
        found = checkpoint.get("format_version") if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"{path} has resume format {found!r}, this code reads format {RESUME_FORMAT_VERSION}")
    if checkpoint["script"] != script:
        raise ValueError(f"{path} was written by train_{checkpoint['script']}.py, not train_{script}.py; "
                         f"use another --save_weight or --save_dir for this run")
    saved_args = checkpoint["args"]
    for flag in ARCHITECTURE_FLAGS:
        if saved_args.get(flag) != getattr(args, flag):
            raise ValueError(f"{path} was saved with --{flag} {saved_args.get(flag)} but this run has "
                             f"--{flag} {getattr(args, flag)}; pass --{flag} {saved_args.get(flag)} to resume it")
    return checkpoint


def describe_changed_flags(saved_args, args, ignore=("from_resume", "run_dir", "use_wandb")):
    """'--flag old -> new' for every flag whose value differs from the saved run's (announced on resume)."""
    changes = []
    for flag, value in sorted(vars(args).items()):
        if flag in ignore or flag not in saved_args or saved_args[flag] == value:
            continue
        changes.append(f"--{flag} {saved_args[flag]} -> {value}")
    return changes


def resume_progress(checkpoint, world_size, steps_per_epoch, rank):
    """Where a resumed run starts, and this rank's random state.

    With the saved world size, every rank gets its own saved RNG state back and the run continues exactly.
    With another world size, step and batch_in_epoch are rescaled by old/new world size (MiniMind's rule:
    the number of prompts seen stays the same), the RNG states cannot be matched to ranks, and the caller
    must announce it.
    Returns:
        (progress dict with step, epoch, batch_in_epoch; rng_state of this rank or None)
    """
    progress = dict(checkpoint["progress"])
    saved_world_size = progress["world_size"]
    rng_state = None
    if saved_world_size == world_size:
        rng_state = checkpoint["rng_states"][rank]
    else:
        progress["step"] = progress["step"] * saved_world_size // world_size
        progress["batch_in_epoch"] = progress["batch_in_epoch"] * saved_world_size // world_size
    if progress["batch_in_epoch"] >= steps_per_epoch:  # saved at the end of an epoch
        progress["epoch"] += 1
        progress["batch_in_epoch"] = 0
    return progress, rng_state


def resume_command(script, argv, world_size):
    """The command line that resumes this run: ``script`` with ``argv`` and ``--from_resume 1``."""
    kept, i = [], 0
    while i < len(argv):  # drop every --from_resume: bare, with its 0/1, or as --from_resume=...
        word = argv[i]
        if word == "--from_resume":
            i += 2 if i + 1 < len(argv) and argv[i + 1] in ("0", "1") else 1
            continue
        if not word.startswith("--from_resume="):
            kept.append(word)
        i += 1
    argv = kept + ["--from_resume", "1"]
    launcher = ["torchrun", "--nproc_per_node", str(world_size)] if world_size > 1 else ["python"]
    script = os.path.relpath(script) if not os.path.relpath(script).startswith("..") else script
    return shlex.join(launcher + [script] + argv)


def any_rank(flag, device):
    """True when ``flag`` is true on at least one rank (all_reduce MAX); the plain bool when not distributed."""
    if not dist.is_initialized():
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


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

    ``record(step, problems)`` logs a skipped update and raises ``SystemExit`` (exit code 1, a clear message)
    once ``max_bad_steps`` updates in a row were skipped; a good step resets the count.
    """

    def __init__(self, max_bad_steps, in_a_row=0):
        self.max_bad_steps = max_bad_steps
        self.in_a_row = in_a_row

    def record(self, step, problems):
        """problems: list of what was non-finite at ``step`` (empty for a good step)."""
        if not problems:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        Logger(f"step {step}: update skipped, non-finite {', '.join(problems)} "
               f"({self.in_a_row} in a row, --max_bad_steps {self.max_bad_steps})")
        if self.in_a_row >= self.max_bad_steps:
            raise SystemExit(f"stopping at step {step}: {self.in_a_row} updates in a row had non-finite "
                             f"{', '.join(problems)}; the weights were not changed by them, and the last saved "
                             f"checkpoint holds no NaN. Lower --learning_rate or check the reward function.")


class ResumableBatchSampler(torch.utils.data.Sampler):
    """Batches of one epoch's prompt indices for this rank, skipping the batches a resumed run already saw.

    The order of epoch ``e`` is DistributedSampler's (a permutation seeded by ``seed + e``, split over ranks;
    world size 1 when not distributed), so it does not depend on whether or where the run was interrupted.
    ``set_epoch(e, skip_batches)`` picks the epoch; the last partial batch is dropped.
    """

    def __init__(self, dataset, batch_size, world_size, rank, seed):
        self.sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                                           shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self.skip_batches = 0

    def set_epoch(self, epoch, skip_batches=0):
        self.sampler.set_epoch(epoch)
        self.skip_batches = skip_batches

    def __iter__(self):
        indices = list(self.sampler)
        full = len(indices) // self.batch_size * self.batch_size
        for start in range(self.skip_batches * self.batch_size, full, self.batch_size):
            yield indices[start:start + self.batch_size]

    def __len__(self):
        return len(self.sampler) // self.batch_size - self.skip_batches


def training_states(objects):
    """name -> state for a resume file: ``state_dict()`` of models (fp32, unwrapped), optimizers and schedules,
    ``get_state()`` of ``torch.Generator`` objects, a rollout engine's ``state_dict()``. A model's gradients that
    are not yet applied (a save in the middle of an accumulation window) go under ``{name}_grads``."""
    states = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.Generator):
            states[name] = obj.get_state()
        elif isinstance(obj, torch.nn.Module):
            module = unwrap_model(obj)
            states[name] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
            states[f"{name}_grads"] = {k: p.grad.detach().cpu().clone() for k, p in module.named_parameters()
                                       if p.grad is not None}
        else:
            states[name] = obj.state_dict()
    return states


def load_training_states(objects, states, path):
    """Inverse of ``training_states``: load each saved state into the object of the same name (strictly).

    Raises:
        ValueError: naming ``path`` and the missing entry when the file lacks a state this run needs.
    """
    for name, obj in objects.items():
        if name not in states:
            raise ValueError(f"{path} has no saved {name!r}; it was written by a different kind of run")
        if isinstance(obj, torch.Generator):
            obj.set_state(states[name])
        elif isinstance(obj, torch.nn.Module):
            module = unwrap_model(obj)
            module.load_state_dict(states[name], strict=True)
            grads = states.get(f"{name}_grads", {})
            for param_name, param in module.named_parameters():
                param.grad = grads[param_name].to(param.device) if param_name in grads else None
        elif isinstance(obj, torch.optim.Optimizer):
            load_optimizer_state(obj, states[name])  # keeps this run's kernel (fused) over the saved one's
        else:
            obj.load_state_dict(states[name])


def parameter_digest(model):
    """sha256 over every parameter's name and bytes: equal digests mean bit-identical weights."""
    digest = hashlib.sha256()
    for name, param in unwrap_model(model).state_dict().items():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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


# ----------------------------------------------------------------------------- flags both scripts take
def add_common_rl_args(parser):
    """Flags shared by train_grpo.py and train_ppo.py (same names, same meanings); each script adds its own."""
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR, help="where weights and runs are written")
    parser.add_argument("--run_dir", default="", help="metrics folder (default: {save_dir}/runs/{save_weight}-TIME)")
    parser.add_argument("--data_path", default=os.path.join(ROOT, "dataset", "rlaif_train.jsonl"),
                        help="RL prompts, MiniMind's RLAIF JSONL (the assistant turn, if any, is the reference answer)")
    parser.add_argument("--tokenizer_path", default=DEFAULT_TOKENIZER_PATH, help="tokenizer folder")
    parser.add_argument("--from_weight", default="full_sft", help="name in save_dir ({name}_{hidden}.pth) or a path")
    parser.add_argument("--hidden_size", type=int, default=256, help="model width (MiniMind: 512, 768)")
    parser.add_argument("--num_hidden_layers", type=int, default=4, help="model depth")
    add_bool_flag(parser, "--use_moe", help="1: mixture-of-experts MLPs")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the prompts (when --max_steps is 0)")
    parser.add_argument("--max_steps", type=int, default=300, help="stop after this many steps (0 = whole epochs)")
    parser.add_argument("--batch_size", type=int, default=4, help="prompts per step and rank")
    parser.add_argument("--learning_rate", type=float, default=2e-5, help="AdamW learning rate of the policy")
    parser.add_argument("--final_norm_learning_rate", type=float, default=1e-2,
                        help="learning rate of the policy's final RMSNorm gain, which sets how sharp its output "
                             "distribution is (0 = --learning_rate, one group)")
    parser.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="gradient-norm clipping")
    parser.add_argument("--max_seq_len", type=int, default=256, help="prompt tokens kept (from the right)")
    parser.add_argument("--max_gen_len", type=int, default=96, help="most tokens generated per answer")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollout")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling (1.0 = off)")
    parser.add_argument("--top_k", type=int, default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="autocast dtype of the policy/critic forwards (weights and log-softmax stay fp32); "
                             "auto = bfloat16 on a CUDA GPU that supports it, float32 elsewhere")
    parser.add_argument("--device", default="",
                        help="e.g. cuda:1 or cpu (default: the first GPU if there is one; under torchrun each "
                             "process takes the GPU of its LOCAL_RANK, and cpu keeps them all on the CPU)")
    add_bool_flag(parser, "--use_compile",
                  help="1: torch.compile the training forwards (policy; PPO's critic too), not the rollout's decode")
    parser.add_argument("--num_workers", type=int, default=0,
                        help="DataLoader worker processes that read the prompts (0 = in the training process)")
    parser.add_argument("--torch_logprobs", default="sampler", choices=TORCH_LOGPROB_MODES,
                        help="old log-probs of --rollout_engine torch: recorded while sampling, or one more forward")
    parser.add_argument("--thinking_ratio", type=float, default=0.9, help="share of prompts that open <think>")
    parser.add_argument("--reward_model_path", default=DEFAULT_REWARD_MODEL_PATH,
                        help="reward model folder (sequence classification, or get_score remote code), or none")
    parser.add_argument("--reward_batch_size", type=int, default=16, help="answers per reward-model forward")
    parser.add_argument("--reward_device", default="", help="device of the reward model (default: the policy's)")
    parser.add_argument("--reward_dtype", default="", choices=["", *DTYPES],
                        help="dtype of the reward model (default: the policy's)")
    add_bool_flag(parser, "--trust_remote_code",
                  help="allow a reward model that runs its own Python code (e.g. internlm2-1_8b-reward)")
    parser.add_argument("--answer_reward_weight", type=float, default=2.0,
                        help="weight of the 0/1 reward for a correct final number")
    parser.add_argument("--rollout_engine", default="torch", help=f"one of {', '.join(ROLLOUT_ENGINES)}")
    parser.add_argument("--sglang_url", default="http://127.0.0.1:30000", help="server of --rollout_engine sglang")
    parser.add_argument("--sglang_shared_path", default="",
                        help="folder the trainer writes synced weights to and the server reads "
                             "(default {save_dir}/sglang_policy)")
    parser.add_argument("--sglang_logprobs", default="recompute", choices=SGLANG_LOGPROB_MODES,
                        help="old log-probs: recomputed by the local policy, or the server's (checked at batch 1)")
    parser.add_argument("--sglang_sync_interval", type=int, default=1,
                        help="push weights to SGLang every N policy updates (N > 1: rollouts up to N-1 updates old)")
    parser.add_argument("--sglang_export_dtype", default="float32", choices=sorted(DTYPES),
                        help="dtype of the weights synced to SGLang")
    parser.add_argument("--eval_data_path", default=os.path.join(ROOT, "dataset", "rlaif_val.jsonl"),
                        help="held-out prompts of the periodic evaluation (the validation split)")
    parser.add_argument("--eval_interval", type=int, default=50,
                        help="held-out evaluation at step 0, every N steps and at the end (0 = off)")
    parser.add_argument("--eval_num_prompts", type=int, default=200,
                        help="held-out prompts per evaluation, each answered sampled and greedy")
    parser.add_argument("--log_interval", type=int, default=1, help="log line and metrics.jsonl every N steps")
    parser.add_argument("--save_interval", type=int, default=50, help="checkpoint and resume file every N steps")
    parser.add_argument("--seed", type=int, default=42, help="data order, initial state and sampling")
    add_bool_flag(parser, "--use_wandb", help="1: also send the metrics to wandb")
    parser.add_argument("--wandb_project", default="MiniMind-RL", help="wandb project name")
    add_bool_flag(parser, "--debug_mode", help="1: print prompts, answers and reward parts")
    parser.add_argument("--debug_interval", type=int, default=20, help="--debug_mode prints every N steps")
    add_bool_flag(parser, "--from_resume",
                  help="1: continue from {save_dir}/{save_weight}_{hidden}_resume.pth when it exists")
    parser.add_argument("--max_bad_steps", type=int, default=3,
                        help="stop after this many updates in a row skipped for a NaN/inf")


def check_common_rl_args(parser, args):
    """argparse-style errors (exit 2) for out-of-range shared flags, before any model is built."""
    for flag in ("batch_size", "max_gen_len", "max_seq_len", "epochs", "log_interval",
                 "save_interval", "debug_interval", "reward_batch_size", "max_bad_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.max_steps < 0:
        parser.error(f"--max_steps must be >= 0, got {args.max_steps}")
    if args.eval_interval < 0 or args.eval_num_prompts < 1:
        parser.error(f"--eval_interval must be >= 0 and --eval_num_prompts >= 1, got {args.eval_interval} and "
                     f"{args.eval_num_prompts}")
    if args.eval_interval and not os.path.isfile(args.eval_data_path):
        parser.error(f"--eval_data_path {args.eval_data_path} does not exist (--eval_interval 0 turns evaluation off)")
    if args.learning_rate <= 0:
        parser.error(f"--learning_rate must be > 0, got {args.learning_rate}")
    if args.final_norm_learning_rate < 0:
        parser.error(f"--final_norm_learning_rate must be >= 0 (0 = --learning_rate), got "
                     f"{args.final_norm_learning_rate}")
    if args.temperature <= 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top_p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.thinking_ratio <= 1:
        parser.error(f"--thinking_ratio must be in [0, 1], got {args.thinking_ratio}")
    if args.rollout_engine not in ROLLOUT_ENGINES:
        parser.error(f"--rollout_engine {args.rollout_engine!r} is unknown; valid: {', '.join(ROLLOUT_ENGINES)}")
    if not os.path.isfile(args.data_path):
        parser.error(f"--data_path {args.data_path} does not exist")
    if args.num_workers < 0:
        parser.error(f"--num_workers must be >= 0, got {args.num_workers}")
    if args.device:
        try:
            device_type = torch.device(args.device).type
        except RuntimeError:
            parser.error(f"--device {args.device!r} is not a device (e.g. cpu, cuda, cuda:1)")
        if device_type not in ("cpu", "cuda"):
            parser.error(f"--device {args.device!r}: the scripts run on cpu or cuda")
        if device_type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: this machine has no CUDA GPU (torch.cuda.is_available() is False)")
        index = torch.device(args.device).index
        if device_type == "cuda" and index is not None and index >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if args.grad_clip <= 0:
        parser.error(f"--grad_clip must be > 0, got {args.grad_clip}")
    if args.top_k < 0:
        parser.error(f"--top_k must be >= 0 (0 = off), got {args.top_k}")
    if args.reward_model_path != "none":
        try:
            read_reward_model_config(args.reward_model_path, args.trust_remote_code)
        except (OSError, ValueError) as err:
            parser.error(str(err))
    try:
        check_writable_dir(args.save_dir)
    except OSError as err:
        parser.error(f"--save_dir: {err.strerror}")
    if args.sglang_sync_interval < 1:
        parser.error(f"--sglang_sync_interval must be >= 1, got {args.sglang_sync_interval}")
    if args.rollout_engine == "sglang" and args.use_moe:
        parser.error("--rollout_engine sglang needs a dense model (--use_moe 0): MoE weights have no Qwen3 export")
    if not args.sglang_url.startswith(("http://", "https://")):
        parser.error(f"--sglang_url must start with http:// or https://, got {args.sglang_url!r}")



def count_long_prompts(dataset, tokenizer, max_seq_len):
    """How many prompts of ``dataset`` are longer than ``max_seq_len`` tokens (they will be cut from the left)."""
    prompts = [dataset[i]["prompt"] for i in range(len(dataset))]
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    return sum(length > max_seq_len for length in lengths)


def rollout_engine_kwargs(args):
    """Constructor arguments of the ``--rollout_engine`` chosen (chapter 8.2)."""
    kwargs = dict(top_p=args.top_p, top_k=args.top_k)
    if args.rollout_engine == "torch":
        kwargs.update(logprobs_mode=args.torch_logprobs)
    if args.rollout_engine == "sglang":
        kwargs.update(
            url=args.sglang_url, shared_path=args.sglang_shared_path or os.path.join(args.save_dir, "sglang_policy"),
            logprobs_mode=args.sglang_logprobs, sync_interval=args.sglang_sync_interval,
            export_dtype=DTYPES[args.sglang_export_dtype],
            resume_hint=f"A checkpoint is saved every --save_interval {args.save_interval} steps: rerun the same "
                        f"command with --from_resume 1 to continue from the last one.",
        )
    return kwargs


def wrap_ddp(model, device, local_rank):
    """DistributedDataParallel around ``model`` when distributed (gloo on CPU, one GPU per rank on CUDA)."""
    if not dist.is_initialized():
        return model
    # MoE experts that received no token on a rank get no gradient there: DDP must be told to expect that.
    use_moe = bool(getattr(getattr(model, "config", None), "use_moe", False))
    return DistributedDataParallel(model, device_ids=[local_rank] if device.startswith("cuda") else None,
                                   find_unused_parameters=use_moe)


def compile_for_training(model, use_compile):
    """``--use_compile 1``: ``torch.compile(model, dynamic=True)`` (the lengths change every step), for the
    forwards that train (log-probs with gradient, values); the rollout keeps the plain module. The compiled
    wrapper shares the parameters; ``unwrap_model`` returns the plain module. ``use_compile`` 0: ``model``."""
    return torch.compile(model, dynamic=True) if use_compile else model


def all_ranks_mean(value, device):
    """Mean of one float over ranks (so that every rank takes the same early-stop decision)."""
    return float(mean_over_ranks({"value": float(value)}, device)["value"])


def mean_over_ranks(metrics, device):
    """Average a dict of floats over ranks (all_reduce); unchanged when not distributed."""
    if not dist.is_initialized():
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return dict(zip(keys, values.tolist()))


def print_debug_samples(step, prompts, completions, reward_parts, num_generations):
    """--debug_mode: each prompt, its sampled answers and their reward parts (rank 0 only)."""
    for i in range(0, len(completions), num_generations):
        Logger(f"[debug] step {step} prompt:\n{prompts[i]}")
        for j in range(i, i + num_generations):
            Logger(f"[debug] answer {j - i}: reward {reward_parts['rewards'][j]:.3f} "
                   f"(rule {reward_parts['rule_rewards'][j]:.3f}, rm {reward_parts['reward_model_scores'][j]:.3f}, "
                   f"answer {reward_parts['answer_rewards'][j]:.0f})\n{completions[j]}")



def accumulation_window_size(step, total_steps, accumulation_steps):
    """How many backward passes the optimizer step that ``step`` (1-based) belongs to accumulates.

    Windows are steps 1..k, k+1..2k, ... (k = ``accumulation_steps``); the last one ends at ``total_steps`` and
    may be shorter. Each loss is divided by its window's size, so that every optimizer step applies the mean
    gradient of its window (the fix transformers PR #39659 and TRL PR #3493 made for the same mistake).
    Example: total 5, k 2 -> sizes 2, 2, 2, 2, 1.
    """
    window_start = (step - 1) // accumulation_steps * accumulation_steps  # steps before this window
    return min(accumulation_steps, total_steps - window_start)


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


def open_metrics(args, progress):
    """(run_dir, MetricsWriter): ``--run_dir``, else the resumed run's folder, else
    ``{save_dir}/runs/{save_weight}-TIME``; a resumed run appends to its metrics and wandb run."""
    run_dir = args.run_dir or progress.get("run_dir") or os.path.join(
        args.save_dir, "runs", f"{args.save_weight}-{time.strftime('%Y%m%d-%H%M%S')}")
    writer = MetricsWriter(run_dir, args.use_wandb, args.wandb_project, os.path.basename(run_dir), vars(args),
                           wandb_id=progress.get("wandb_id"))
    return run_dir, writer


def start_or_resume(args, script, run, objects, steps_per_epoch):
    """Where the run starts: step 0, or (``--from_resume 1`` and a resume file exists) the saved step, with
    ``objects`` (policy, optimizer, schedule, ...) and this rank's random state restored.

    The reference model is not in ``objects``: it stays the initial ``--from_weight`` weights (a resume whose
    ``--from_weight`` is the file the run saves to is refused, since that file holds the trained policy).
    Under torchrun every rank must find the same file: ranks that would start from different steps stop.
    Returns a progress dict: step, epoch, batch_in_epoch, run_dir, wandb_id, bad_steps_in_a_row.
    Raises:
        ValueError: a resume file from another script, format or architecture (see ``load_resume``), a
            ``--from_weight`` that is the saved policy, or ranks at different steps.
    """
    progress = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "run_dir": None, "wandb_id": None,
                "bad_steps_in_a_row": 0}
    if not args.from_resume:
        return progress
    path = resume_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe)
    checkpoint = load_resume(path, script, args)
    if checkpoint is None:
        Logger(f"--from_resume 1: no resume file at {path}, starting at step 0")
    else:
        restore_from_checkpoint(args, run, objects, steps_per_epoch, path, checkpoint, progress)
    if dist.is_initialized():  # every rank must have read the same file (multi-node: a shared --save_dir)
        steps = torch.tensor([progress["step"], -progress["step"]], dtype=torch.float64, device=run.device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if steps[0].item() != -steps[1].item():
            raise ValueError(f"ranks would resume from different steps (up to {int(steps[0].item())}, this one "
                             f"{progress['step']}): every node needs the same {path} (a shared --save_dir)")
    return progress


def restore_from_checkpoint(args, run, objects, steps_per_epoch, path, checkpoint, progress):
    """The restore part of ``start_or_resume``: states, data position and random state (updates ``progress``)."""
    start_weights = weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe)
    saved_weights = weight_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe, allow_file=False)
    if os.path.abspath(start_weights) == os.path.abspath(saved_weights):
        raise ValueError(f"--from_weight {args.from_weight} is {saved_weights}, the file this run saves its policy "
                         f"to, so on resume the reference model would be the step-{checkpoint['progress']['step']} "
                         f"policy, not the starting one; start runs from a copy (another --save_weight)")
    load_training_states(objects, checkpoint["states"], path)
    run.rollout_engine_state = checkpoint["states"].get("rollout_engine")  # loaded into the engine by start()
    resumed, rng_state = resume_progress(checkpoint, run.world_size, steps_per_epoch, run.rank)
    progress.update(resumed)
    if rng_state is not None:
        set_rng_state(rng_state)
    else:
        saved_world_size = checkpoint["progress"]["world_size"]
        for obj in objects.values():  # the schedules move with the step (a cosine keyed to the old step would not)
            if isinstance(obj, torch.optim.lr_scheduler.LambdaLR):
                rescale_schedule(obj, saved_world_size, run.world_size)
        setup_seed(args.seed + run.rank + 1000 * progress["step"])
        Logger(f"world size changed from {saved_world_size} to {run.world_size}: step and learning-rate schedules "
               f"rescaled to {progress['step']}, data position to batch {progress['batch_in_epoch']} of epoch "
               f"{progress['epoch']}; random states reseeded, so this resume is not bit-exact")
    for change in describe_changed_flags(checkpoint["args"], args):
        Logger(f"warning: resuming with a changed flag: {change}")
    Logger(f"resumed from {path} at step {progress['step']} (epoch {progress['epoch']}, "
           f"batch {progress['batch_in_epoch']})")


def rescale_schedule(scheduler, saved_world_size, world_size):
    """Move a restored ``LambdaLR`` (``build_cosine_scheduler``) to where a resume across a world-size change
    puts the step: its position is scaled by ``saved_world_size / world_size`` with the same integer rule as
    ``resume_progress``, and every group's learning rate is recomputed at that position."""
    scheduler.last_epoch = scheduler.last_epoch * saved_world_size // world_size
    rates = [base * rate(scheduler.last_epoch) for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, learning_rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = learning_rate
    scheduler._last_lr = rates


def save_checkpoint(args, script, lm_config, objects, progress, weights):
    """Save at a safe point: the policy (and critic) weights as MiniMind fp16 ``.pth`` files (rank 0) and the
    resume file with everything ``start_or_resume`` needs (a collective: every rank calls it).

    Args:
        objects: name -> model / optimizer / schedule / generator (see ``training_states``).
        progress: step, epoch, batch_in_epoch, run_dir, wandb_id, bad_steps_in_a_row.
        weights: name in ``save_dir`` -> module, e.g. {"grpo": policy} or {"ppo": actor, "ppo_critic": critic}.
    Returns the resume file's path.
    Raises:
        ValueError: a NaN or inf in the weights (nothing is written); OSError naming the path.
    """
    if is_main_process():
        for name, module in weights.items():
            path = weight_path(name, args.save_dir, lm_config.hidden_size, lm_config.use_moe, allow_file=False)
            state_dict = half_state_dict(module)
            check_finite_state(state_dict, path)
            atomic_save(state_dict, path)
            write_tokenizer_record(path, args.tokenizer_path)  # which tokenizer these weights go with
    path = resume_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    save_resume(path, script, args, dict(progress, world_size=world_size), training_states(objects))
    return path


def nan_safe_step(models, optimizers, grad_clip, problems, device):
    """One optimizer step of every (model, optimizer) pair, or of none: the NaN-safe update of both scripts.

    The final norm gain's gradient is projected onto the gain (``project_scale_only_gradients``), each model's
    gradient norm is clipped to ``grad_clip``, and every optimizer steps -- unless a value was non-finite on
    any rank, in which case no optimizer steps on any rank. The gradients are cleared either way.

    Args:
        models: modules (or DDP wrappers) whose gradients are clipped, in the order of ``optimizers``.
        problems: names of non-finite values seen since the last update on this rank (e.g. ['rewards']).
    Returns:
        (grad_norms: list of floats, one per model, before clipping; problems: list, empty when the step was
        taken; a non-finite norm adds 'gradients', and a skip caused only by another rank reads
        'values on another rank').
    """
    for optimizer in optimizers:
        project_scale_only_gradients(optimizer)  # the final norm gain learns one number (build_policy_optimizer)
    grad_norms = [float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)) for model in models]
    problems = list(problems) + ([] if all(math.isfinite(norm) for norm in grad_norms) else ["gradients"])
    skip = any_rank(bool(problems), device)
    if not skip:
        for optimizer in optimizers:
            optimizer.step()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    if skip:
        return grad_norms, problems or ["values on another rank"]
    return grad_norms, []


# ----------------------------------------------------------------------------- one run
@dataclass
class RLRun:
    """One RL run: what ``build`` sets up (chapter 8.1's roles and the data) and the loop's bookkeeping.

    Built by ``RLRun.build``; ``start`` adds the rollout engine, the metrics file and the resumed position.
    The policy (PPO's actor) is ``model`` here, never wrapped in DistributedDataParallel: the scripts wrap
    it themselves and pass the wrapper to what needs the gradient synchronised.
    """
    args: argparse.Namespace
    script: str  # "grpo" or "ppo": the resume file of one is refused by the other
    script_path: str  # the training script's file, for the resume command printed on a stop
    argv: Optional[list]  # its flags (None: sys.argv[1:])
    reward_fn: Callable  # (prompts, completions, answers, reward_model, answer_reward_weight) -> reward parts
    device: str
    rank: int
    world_size: int
    local_rank: int
    lm_config: Any  # MiniMindConfig
    model: torch.nn.Module  # the policy, fp32 weights
    ref_model: torch.nn.Module  # the frozen starting policy
    tokenizer: Any
    reward_model: Optional[LMForRewardModel]
    dataset: RLAIFDataset
    batch_sampler: ResumableBatchSampler
    loader: DataLoader
    evaluator: Optional[HeldOutEvaluator]  # None with --eval_interval 0
    total_steps: int
    # set by start():
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
    log_line: Optional[Callable] = None  # metrics -> str, the script's part of the log line
    # where the loop is (set by batches()):
    epoch: int = 0
    batch_in_epoch: int = 0
    sample_indices: list = field(default_factory=list)
    stop: bool = False  # a stop was requested (agreed by all ranks at the end of the step)

    @classmethod
    def build(cls, args, script, script_path, argv, reward_fn):
        """Shared set-up of both RL scripts (chapter 8.1, the roles): distributed init, seed, the actor/policy,
        the frozen reference, the reward model, and the prompt data (validated here, before the first rollout).

        Raises:
            ValueError: when the data file has fewer prompts than one batch per rank (says how many of each).
            DataFormatError: a bad data line (file and line number).
        """
        local_rank, device = init_distributed_mode(args.device)
        args.dtype = resolve_train_dtype(args.dtype, device)  # "auto" -> what this device runs
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        setup_seed(args.seed)  # identical initial weights on every rank
        lm_config = build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
        # the data is read and validated before any model is built: a bad line is reported even without weights
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
        check_tokenizer_fits_checkpoint(tokenizer, args.tokenizer_path, None if args.from_weight == "none" else
                                        weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe))
        dataset = RLAIFDataset(args.data_path, tokenizer, thinking_ratio=args.thinking_ratio, seed=args.seed)
        needed = args.batch_size * world_size
        if len(dataset) < needed:
            raise ValueError(f"--data_path {args.data_path}: found {len(dataset)} prompts, need at least {needed} "
                             f"(--batch_size {args.batch_size} x {world_size} processes) for one full batch")
        model, tokenizer = init_model(lm_config, args.from_weight, args.save_dir, args.tokenizer_path, device,
                                      tokenizer)
        long_prompts = count_long_prompts(dataset, tokenizer, args.max_seq_len)
        if long_prompts:
            Logger(f"warning: {long_prompts} of {len(dataset)} prompts are longer than --max_seq_len "
                   f"{args.max_seq_len} tokens; they are cut from the left so the generation prompt survives")
        ref_model, _ = init_model(lm_config, "none", args.save_dir, args.tokenizer_path, device)
        ref_model.load_state_dict(model.state_dict())  # the reference is the starting policy, also for 'none'
        ref_model.eval().requires_grad_(False)
        reward_model = None
        if args.reward_model_path != "none":
            reward_dtype = resolve_dtype(args.reward_dtype, next(model.parameters()).dtype)
            reward_model = LMForRewardModel(args.reward_model_path, device=args.reward_device or device,
                                            dtype=reward_dtype, batch_size=args.reward_batch_size,
                                            trust_remote_code=args.trust_remote_code)
        evaluator = None
        if args.eval_interval:
            eval_dataset = RLAIFDataset(args.eval_data_path, tokenizer, thinking_ratio=1.0, seed=args.seed)
            evaluator = HeldOutEvaluator(eval_dataset, tokenizer, args.eval_num_prompts, args.temperature,
                                         args.max_gen_len, args.max_seq_len, device)
        batch_sampler = ResumableBatchSampler(dataset, args.batch_size, world_size, rank, args.seed)
        # its own generator: creating the loader's iterator must not draw from the global RNG (exact resume)
        loader = DataLoader(dataset, batch_sampler=batch_sampler, num_workers=args.num_workers,
                            generator=torch.Generator().manual_seed(args.seed))
        setup_seed(args.seed + rank)  # different sampling on every rank
        Logger(f"{script.upper()}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
               f"{len(dataset)} prompts, world size {world_size}, device {device}, dtype {args.dtype}")
        total_steps = count_total_steps(args.max_steps, args.epochs, len(loader))
        return cls(args=args, script=script, script_path=script_path, argv=argv, reward_fn=reward_fn, device=device,
                   rank=rank, world_size=world_size, local_rank=local_rank, lm_config=lm_config, model=model,
                   ref_model=ref_model, tokenizer=tokenizer, reward_model=reward_model, dataset=dataset,
                   batch_sampler=batch_sampler, loader=loader, evaluator=evaluator, total_steps=total_steps)

    def start(self, objects, weights, summary, log_line):
        """Resume (``--from_resume 1``) or start at step 0, make the rollout engine, open the metrics, and
        evaluate the starting policy on the held-out prompts (step 0).

        Args:
            objects: name -> model / optimizer / schedule / generator restored on resume and saved with it.
            weights: name in ``save_dir`` -> module saved as a MiniMind fp16 .pth at every checkpoint.
            summary: the run's one-line description (", metrics in DIR" is appended).
            log_line: metrics -> the script's part of the log line (after the rewards, before the times).
        """
        args = self.args
        self.objects, self.weights, self.log_line = objects, weights, log_line
        self.progress = start_or_resume(args, self.script, self, objects, len(self.loader))
        # made after the restore: the SGLang engine pushes the (restored) policy to its server at start-up
        self.rollout_engine = create_rollout_engine(args.rollout_engine, self.model, self.tokenizer,
                                                    **rollout_engine_kwargs(args))
        if self.rollout_engine_state is not None:
            self.rollout_engine.load_state_dict(self.rollout_engine_state)
        self.run_dir, self.writer = open_metrics(args, self.progress)
        Logger(f"{summary}, metrics in {self.run_dir}")
        self.stop_signal = StopSignal()
        self.guard = BadStepGuard(args.max_bad_steps, self.progress["bad_steps_in_a_row"])
        if self.progress["step"] == 0 and self.evaluator is not None:
            eval_metrics = evaluate_if_due(self.evaluator, self.model, 0, self.total_steps, args.eval_interval)
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

    def debug_due(self, step):
        """True when ``--debug_mode`` prints this step's samples."""
        return bool(self.args.debug_mode) and step % self.args.debug_interval == 0

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
