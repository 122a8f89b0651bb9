"""Resume: the resume file (every state a run needs to continue bit for bit), the random states of every rank,
and where a resumed run starts. Infrastructure, not RL: a learner can skip this file.
"""
import os
import random
import shlex

import numpy as np
import torch
import torch.distributed as dist

from trainer.checkpoints import atomic_save, half_state_dict, unwrap_model, weight_path
from trainer.distributed import Logger, is_main_process, setup_seed
from trainer.optimizer import load_optimizer_state
from trainer.tokenizer_check import write_tokenizer_record

RESUME_FORMAT_VERSION = 1
ARCHITECTURE_FLAGS = ("hidden_size", "num_hidden_layers", "use_moe")


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
