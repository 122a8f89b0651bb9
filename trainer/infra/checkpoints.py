"""Checkpoints and resuming: what a run saves at a safe point (its weights and the resume file, written as a pair),
every state a run needs to continue bit for bit, the random states of every rank, and where a resumed run starts.

Infrastructure, not RL: a learner can skip this file.
"""

import fcntl
import functools
import glob
import hashlib
import os
import random
import re
import shlex
import shutil
import sys
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from trainer.infra.distributed import Logger, broadcast_from_rank0, run_on_rank0, setup_seed, unwrap_model
from trainer.infra.files import atomic_write
from trainer.infra.fsdp import load_sharded, optimizer_name, save_sharded, sharded_objects, whole_model
from trainer.infra.weights import check_finite_state, is_model_folder, model_folder_path, weight_path, weight_writes
from trainer.infra.errors import InputError, SaveFolderBusyError

RESUME_FORMAT_VERSION = 1
ARCHITECTURE_FLAGS = (
    "hidden_size",
    "num_hidden_layers",
    "use_moe",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)
# flags a resumed run cannot take a new value of, and why (the fix is to pass the saved value, or start a new run)
FIXED_ON_RESUME = {
    "data_path": "the data position counts prompts of that file",
    "seed": "the data order and the random states are those of the saved seed",
    "tokenizer_path": "the weights were trained with that tokenizer",
    "from_weight": "the reference model is the starting weights",
    "save_weight": "it names the files of the run",
    "accumulation_steps": "the schedule counts optimizer steps of that window",
    "num_iterations": "the schedule counts that many updates per rollout",
    "lora_alpha": "the adapters were trained at that scale",
    "lora_target_modules": "the resume file holds adapters on those projections",
    "optimizer": "the resume file holds that optimizer's state (fp32 or 8-bit moments)",
}
# flags whose new value moves the learning-rate schedule: it is rebuilt from the flags at the resumed update
SCHEDULE_FLAGS = ("learning_rate", "final_norm_learning_rate", "critic_learning_rate", "max_steps", "epochs")
# flags that never change what is trained
UNCHECKED_FLAGS = (
    "from_resume",
    "run_dir",
    "use_wandb",
    "tracker",
    "wandb_project",
    "device",
    "num_workers",
    "log_interval",
    "debug_mode",
    "debug_interval",
    "sglang_url",
    "tokenizer_path_named",
    "allow_data_change",
    "sglang_timeout",
)


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


def gather_rng_states():
    """Every rank's ``get_rng_state()`` as a list indexed by rank (a collective: all ranks must call it)."""
    state = get_rng_state()
    if not dist.is_initialized():
        return [state]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def save_checkpoint(args, script, lm_config, objects, progress, weights):
    """Save at a safe point: the policy (and critic) weights as MiniMind fp16 ``.pth`` files with their tokenizer
    records, and the resume file with everything ``start_or_resume`` needs, all replaced together (``atomic_write``:
    a crash or a full disk leaves the previous checkpoint whole). A collective: every rank calls it; rank 0 writes.

    Args:
        args: the run's flags (stored in the resume file, compared on resume).
        script: 'grpo' or 'ppo'; a resume by another script is refused.
        objects: name -> model / optimizer / generator / rollout engine (see ``training_states``).
        progress: step, total_steps, epoch, batch_in_epoch (batches of ``epoch`` already trained on),
            lr_schedule_step (the schedules' position), run_dir, wandb_id, bad_steps_in_a_row: plain values. A
            ``run_dir`` inside ``--save_dir`` is stored relative to it, so a copied folder resumes into its own copy.
        weights: name in ``save_dir`` -> module, e.g. {"grpo": policy} or {"ppo": actor, "ppo_critic": critic}.
    Returns the resume file's path.
    Raises:
        ValueError: a NaN or inf in the weights (nothing is replaced: under ``--fsdp 1`` the new shards' folder is
            written first and named by no resume file). OSError naming the path (nothing replaced).
    """
    path = resume_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rng_states = gather_rng_states()
    sharded = sharded_objects(objects)  # --fsdp 1: the models and optimizers each rank holds a shard of
    sharded_names = set(sharded) | {optimizer_name(name) for name in sharded}
    states = training_states({name: obj for name, obj in objects.items() if name not in sharded_names})
    sharded_record = save_sharded_step(path, progress["step"], sharded)  # every rank its shards; None under DDP
    weights = {name: whole_model(module) for name, module in weights.items()}  # sharded: gathered on rank 0

    def write():
        for name in ("model", "critic"):
            if name in states:
                check_finite_state(states[name], f"{name} to {path}")
        checkpoint = {
            "format_version": RESUME_FORMAT_VERSION,
            "script": script,
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
            "progress": dict(
                progress, world_size=world_size, run_dir=relative_run_dir(progress["run_dir"], args.save_dir)
            ),
            "data": data_digest(args.data_path),  # checked on resume (check_resume_data)
            "rng_states": rng_states,
            "states": states,
            "sharded": sharded_record,  # where the shards of the --fsdp 1 models are, or None
        }
        export_folder = is_model_folder(getattr(args, "from_weight", "none"))  # a model folder in, one out
        writes = weight_writes(weights, args.save_dir, lm_config, args.tokenizer_path, export_folder)
        writes[path] = functools.partial(torch.save, checkpoint)  # last: the pair is complete once it is in place
        atomic_write(writes)
        if sharded_record:  # the new shards are current now: the older steps' folders go
            remove_sharded_steps(path, keep=sharded_record["folder"])

    run_on_rank0(write, f"saving {path}")  # an error there (a NaN, a full disk) stops every rank
    Logger(f"saved step {progress['step']}: weights ({', '.join(weights)}) and {path}")
    return path


def sharded_root(path):
    """``{save_dir}/{name}_resume_sharded``: the folder of a resume file's ``--fsdp 1`` shards, one ``step_N`` each."""
    return os.path.splitext(path)[0] + "_sharded"


def save_sharded_step(path, step, sharded):
    """Write the shards of ``sharded`` (``fsdp.sharded_objects``) for the resume file ``path`` at ``step`` into a new
    folder ``{sharded_root}/step_{step}_{id}`` (a collective; the id, drawn on rank 0, keeps every save in a folder of
    its own, so that no save can overwrite the shards the resume file names). Returns the record the resume file
    keeps ({"folder": relative to the save folder, "models": ...}), or None when nothing is sharded."""
    if not sharded:
        return None
    name = broadcast_from_rank0(f"step_{step:08d}_{uuid.uuid4().hex[:8]}")
    relative = os.path.join(os.path.basename(sharded_root(path)), name)
    return {"folder": relative, "models": save_sharded(os.path.join(os.path.dirname(path), relative), sharded)}


def remove_sharded_steps(path, keep):
    """Remove every step folder of ``path``'s shards but ``keep`` (relative to the save folder): once the resume file
    names the new step, the older ones are no checkpoint's."""
    for folder in glob.glob(os.path.join(glob.escape(sharded_root(path)), "step_*")):
        if os.path.relpath(folder, os.path.dirname(path)) != keep:
            shutil.rmtree(folder, ignore_errors=True)


def load_resume(path, script, args, mmap=False):
    """Read and check a resume file written by ``save_checkpoint`` (``mmap``: tensors are read only when used, for
    a look at its flags and progress).

    Returns:
        the checkpoint dict, or None when ``path`` does not exist (the run then starts at step 0).
    Raises:
        ValueError: naming the file and the mismatch -- another format version, another script, or a flag that a
            resume cannot change (``check_resume_flags``) with both values.
    """
    if not os.path.isfile(path):
        return None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # a truncated or foreign file
        raise InputError(f"{path} is not a readable resume checkpoint ({type(err).__name__}: {err})") from err
    if not isinstance(checkpoint, dict) or checkpoint.get("format_version") != RESUME_FORMAT_VERSION:
        found = checkpoint.get("format_version") if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise InputError(f"{path} has resume format {found!r}, this code reads format {RESUME_FORMAT_VERSION}")
    if checkpoint["script"] != script:
        raise InputError(
            f"{path} was written by train_{checkpoint['script']}.py, not train_{script}.py; "
            f"use another --save_weight or --save_dir for this run"
        )
    check_resume_flags(path, checkpoint["args"], args)
    return checkpoint


def changed_flags(saved_args, args):
    """What a resume does with every flag whose value differs from the saved run's, as lines to print.

    Flags of ``FIXED_ON_RESUME`` cannot change (``check_resume_flags`` refuses them); a new ``--batch_size``
    keeps the data position in prompts (``resume_progress``); a flag of ``SCHEDULE_FLAGS`` rebuilds the cosine
    schedule from the new values at the resumed update; every other flag is read at every step, so its new value
    applies from the first resumed step.
    """
    lines = []
    for flag, value in sorted(vars(args).items()):
        if flag in UNCHECKED_FLAGS or flag not in saved_args or saved_args[flag] == value:
            continue
        if flag == "batch_size":
            how = "the data position is kept in prompts (step and schedule rescaled to the new batch)"
        elif flag in SCHEDULE_FLAGS:
            how = "the learning-rate schedule is rebuilt from this run's flags at the resumed update"
        else:
            how = "applies from the first resumed step"
        lines.append(f"resuming with a changed flag: --{flag} {saved_args[flag]} -> {value}: {how}")
    return lines


def check_resume_flags(path, saved_args, args):
    """Refuse a resume whose flags cannot apply to the saved run: another architecture, or a new value of a flag
    in ``FIXED_ON_RESUME``.

    Raises:
        ValueError: naming ``path``, the flag, both values, why, and the flag to pass.
    """
    for flag in ARCHITECTURE_FLAGS:
        if flag in saved_args and saved_args[flag] != getattr(args, flag, None):
            raise InputError(
                f"{path} was saved with --{flag} {saved_args.get(flag)} but this run has "
                f"--{flag} {getattr(args, flag)}; pass --{flag} {saved_args.get(flag)} to resume it"
            )
    saved_rank, rank = saved_args.get("lora_rank", 0), getattr(args, "lora_rank", 0)
    if saved_rank != rank:  # a file of every weight, or of adapters (infra/lora.py)
        what = f"adapters of rank {saved_rank}" if saved_rank else "every weight of the policy (no LoRA)"
        raise InputError(
            f"{path} holds {what} but this run has --lora_rank {rank}: pass --lora_rank {saved_rank} "
            f"to resume it, or start a new run (another --save_dir or --save_weight)"
        )
    for flag, reason in FIXED_ON_RESUME.items():
        if flag in saved_args and hasattr(args, flag) and saved_args[flag] != getattr(args, flag):
            raise InputError(
                f"{path} was saved with --{flag} {saved_args[flag]} but this run has --{flag} "
                f"{getattr(args, flag)}, which a resume cannot take ({reason}): pass --{flag} "
                f"{saved_args[flag]} to resume, or start a new run (another --save_dir or "
                f"--save_weight) from the saved weights"
            )


def resume_progress(checkpoint, world_size, steps_per_epoch, rank, batch_size):
    """Where a resumed run starts, and this rank's random state.

    With the saved world size and batch size, every rank gets its own saved RNG state back and the run continues
    exactly. With another number of prompts per step (``--batch_size`` x processes), step, batch_in_epoch and the
    schedules' position are rescaled by old/new prompts per step, rounded down: the number of prompts seen stays
    the same (MiniMind's rule for the world size), and a prompt may be seen twice but none is skipped. With another
    world size the RNG states cannot be matched to ranks, and the caller must announce it.
    Returns:
        (progress dict with step, epoch, batch_in_epoch, lr_schedule_step; rng_state of this rank or None)
    """
    progress = dict(checkpoint["progress"])
    if "lr_schedule_step" not in progress:  # a file that saved the schedule itself
        progress["lr_schedule_step"] = checkpoint["states"]["scheduler"]["last_epoch"]
    saved_world_size = progress["world_size"]
    saved_prompts_per_step = checkpoint.get("args", {}).get("batch_size", batch_size) * saved_world_size
    prompts_per_step = batch_size * world_size
    rng_state = checkpoint["rng_states"][rank] if saved_world_size == world_size else None
    if saved_prompts_per_step != prompts_per_step:
        for key in ("step", "batch_in_epoch", "lr_schedule_step"):
            progress[key] = progress[key] * saved_prompts_per_step // prompts_per_step
    if progress["batch_in_epoch"] >= steps_per_epoch:  # saved at the end of an epoch
        progress["epoch"] += 1
        progress["batch_in_epoch"] = 0
    return progress, rng_state


def relative_run_dir(run_dir, save_dir):
    """``run_dir`` relative to ``save_dir`` when it lies inside it (a copied folder then resumes into its own copy),
    else unchanged; None stays None."""
    if run_dir is None:
        return None
    relative = os.path.relpath(os.path.abspath(run_dir), os.path.abspath(save_dir))
    return run_dir if relative.startswith("..") else relative


def resume_command(script, argv, world_size):
    """The command line that resumes this run: ``script`` with ``argv`` (None: ``sys.argv[1:]``) and
    ``--from_resume 1``."""
    argv = sys.argv[1:] if argv is None else argv
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
    ``get_state()`` of ``torch.Generator`` objects, a rollout engine's ``resume_state()``. A model's gradients that
    are not yet applied (a save in the middle of an accumulation window) go under ``{name}_grads``."""
    states = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.Generator):
            states[name] = obj.get_state()
        elif isinstance(obj, torch.nn.Module):
            module = unwrap_model(obj)
            states[name] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
            states[f"{name}_grads"] = {
                k: p.grad.detach().cpu().clone() for k, p in module.named_parameters() if p.grad is not None
            }
        elif hasattr(obj, "resume_state"):  # a rollout engine
            states[name] = obj.resume_state()
        else:
            states[name] = obj.state_dict()
    return states


def load_optimizer_state(optimizer, state):
    """``optimizer.load_state_dict(state)`` that takes the moments and step counts from ``state`` and keeps every
    group setting of this optimizer: its rates and weight decay (this run's flags; the schedule then places the
    rates at the resumed step, ``build_cosine_scheduler``) and its kernel (``fused``, ``foreach``).

    ``load_state_dict`` alone takes every group setting from the saved state, so it would bring back the saved
    run's rates and a checkpoint written with another kernel would bring that kernel back, silently. State dicts
    with another number of groups go to ``load_state_dict`` unchanged, which raises its ValueError.
    """
    saved_groups = state["param_groups"]
    if len(saved_groups) == len(optimizer.param_groups):
        own_settings = [
            {key: value for key, value in group.items() if key not in ("params", "initial_lr")}
            for group in optimizer.param_groups
        ]
        state = dict(
            state, param_groups=[dict(saved, **settings) for saved, settings in zip(saved_groups, own_settings)]
        )
    optimizer.load_state_dict(state)


def load_training_states(objects, states, path):
    """Inverse of ``training_states``: load each saved state into the object of the same name (strictly).

    Raises:
        ValueError: naming ``path`` and the missing entry when the file lacks a state this run needs, or when a
            model's state has other keys or shapes than this run's model (naming the first difference).
    """
    for name, obj in objects.items():
        if name not in states:
            raise InputError(f"{path} has no saved {name!r}; it was written by a different kind of run")
        if isinstance(obj, torch.Generator):
            obj.set_state(states[name])
        elif isinstance(obj, torch.nn.Module):
            module = unwrap_model(obj)
            check_finite_state(states[name], f"{path} ({name}; a damaged file?)", "refusing to resume from")
            try:
                module.load_state_dict(states[name], strict=True)
            except RuntimeError as err:  # other keys or shapes: a file of another version of the scripts
                lines = str(err).splitlines()  # "Error(s) in loading state_dict for ...:", then the differences
                first = lines[1].strip() if len(lines) > 1 else str(err)
                raise InputError(
                    f"{path}: its {name!r} does not fit this run's ({first[:300]}); it was written by "
                    f"another version of the scripts: start a new run (--from_resume 0) from its "
                    f"weights"
                ) from None
            grads = states.get(f"{name}_grads", {})
            for param_name, param in module.named_parameters():
                param.grad = grads[param_name].to(param.device) if param_name in grads else None
        elif isinstance(obj, torch.optim.Optimizer):
            load_optimizer_state(obj, states[name])  # keeps this run's kernel (fused) over the saved one's
        else:
            obj.load_state_dict(states[name])


def lock_path(args):
    """``{save_dir}/{save_weight}_{hidden}[_moe].lock``: the lock of the run that writes these checkpoint files."""
    return resume_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe)[: -len("_resume.pth")] + ".lock"


def claim_save_dir(args, script, total_steps):
    """Make this run the only one writing its checkpoint files, and refuse to replace an unfinished run, at start-up
    (before any model is built). A collective: every rank calls it; rank 0 checks, every rank raises its error.

    Rank 0 takes an exclusive lock on ``lock_path(args)`` (``fcntl.flock``, released by the operating system when the
    process ends, however it ends; the file keeps the PID and start time of its holder). Then the resume file at
    ``resume_path``: without ``--from_resume 1``, one that holds an unfinished run is refused (a fresh run would
    replace the state that run cannot recreate; a finished run's files are replaced as upstream replaces weights);
    with it, the file's script, format and fixed flags are checked (``load_resume``) before any model is built.
    A fresh run's ``--run_dir`` must not hold another run's metrics (``check_fresh_run_dir``). Also refused: a
    ``--save_weight`` file that is the ``--from_weight`` start, and the resume checks (``check_resume_run_dir``,
    ``check_resume_data``, ``check_work_left``, ``check_other_resume_files``).
    With ``--rollout_engine sglang`` rank 0 also locks ``{sglang_folder(args)}.lock``: one run per weights folder.
    Args:
        total_steps: this run's steps (recorded with every checkpoint: a run is finished once its step reaches it).
    Returns:
        the ``RunLocks`` on rank 0 (keep them for the run's lifetime; ``close()``), None on other ranks.
    Raises:
        RuntimeError: another process holds a lock (its PID named). ValueError: an unfinished run's resume file
            without ``--from_resume 1`` (naming the file, its step and the three ways on), a resume file this run
            cannot continue, or a fresh run's ``--run_dir`` with another run's metrics, or a check above.
    """
    claimed = {}

    def claim():
        path = lock_path(args)
        claimed["locks"] = [
            take_lock(
                path,
                lambda holder: (
                    f"{args.save_dir} is in use by another run writing {args.save_weight} checkpoints ({holder}, "
                    f"lock {path}): two runs would overwrite each other's weights and resume file; wait for it, or "
                    f"give this run another --save_dir or --save_weight"
                ),
            )
        ]
        if getattr(args, "rollout_engine", "torch") == "sglang":
            folder = os.path.abspath(sglang_folder(args))
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            claimed["locks"].append(
                take_lock(
                    folder + ".lock",
                    lambda holder: (
                        f"--sglang_shared_path {folder} is in use by another run ({holder}): each run's server would "
                        f"load the other run's weights; give each run its own --sglang_shared_path (the default "
                        f"{{save_dir}}/sglang_NAME_HIDDEN is one per --save_weight)"
                    ),
                )
            )
        check_start_weights_kept(args)
        data_digest(args.data_path)  # the data this run reads, as its checkpoints will record it
        path = resume_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe)
        checkpoint = load_resume(path, script, args, mmap=True) if args.from_resume else None
        if checkpoint is not None:  # refusals before any model is built
            check_resume_run_dir(args, path, checkpoint)
            check_resume_data(args, path, checkpoint)
            check_work_left(args, path, checkpoint, total_steps, dist.get_world_size() if dist.is_initialized() else 1)
            return
        if args.from_resume:
            check_other_resume_files(args, path)
        check_fresh_run_dir(args.run_dir)
        checkpoint = peek_resume(path)
        if checkpoint is not None and not run_finished(checkpoint):
            progress = checkpoint["progress"]
            of = f" of {progress['total_steps']}" if "total_steps" in progress else ""
            raise InputError(
                f"{path} holds an unfinished run (step {progress['step']}{of}) that this fresh run would "
                f"replace: resume it with --from_resume 1, start this run elsewhere (another --save_dir "
                f"or --save_weight), or delete that file to start over"
            )

    try:
        run_on_rank0(claim, f"claiming {args.save_dir}")
    except BaseException:
        for lock in claimed.get("locks", []):
            lock.close()
        raise
    return RunLocks(claimed["locks"]) if "locks" in claimed else None


class RunLocks:
    """The lock files a run holds (``claim_save_dir``); ``close()`` releases them."""

    def __init__(self, files):
        self.files = files

    def close(self):
        for lock in self.files:
            lock.close()


def take_lock(path, refusal):
    """An exclusive ``fcntl.flock`` on ``path`` (released by the operating system when the process ends, however it
    ends), the file holding the PID and start time of its holder. Returns the open file.
    Raises RuntimeError(``refusal(holder)``) when another process holds it."""
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise SaveFolderBusyError(refusal(holder)) from None
    lock.truncate(0)
    lock.write(f"PID {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    return lock


def sglang_folder(args):
    """The folder ``--rollout_engine sglang`` writes its synced weights to: ``--sglang_shared_path``, else
    ``{save_dir}/sglang_{save_weight}_{hidden}[_moe]``, one per checkpoint files (so one per run: ``lock_path``)."""
    if args.sglang_shared_path:
        return args.sglang_shared_path
    return os.path.join(args.save_dir, "sglang_" + os.path.basename(lock_path(args))[: -len(".lock")])


def check_fresh_run_dir(run_dir):
    """Refuse a fresh run whose ``--run_dir`` already holds another run's metrics.jsonl: its rows would be appended
    to that run's, and the curves of both would be mixed. Raises ValueError naming the file and the ways on."""
    metrics_path = os.path.join(run_dir, "metrics.jsonl") if run_dir else None
    if metrics_path and os.path.isfile(metrics_path) and os.path.getsize(metrics_path) > 0:
        raise InputError(
            f"--run_dir {run_dir} already holds another run's metrics ({metrics_path}): this fresh run "
            f"would append its rows to that run's; give a new --run_dir (or none: "
            f"{{save_dir}}/runs/NAME-TIME), resume that run with --from_resume 1, or delete the file"
        )


def check_start_weights_kept(args):
    """Refuse a run whose ``--save_weight`` file is its own ``--from_weight`` start: its first save would overwrite
    the weights it started from (and a resume would rebuild the reference from the trained policy). Raises
    ValueError naming the file and both flags."""
    if args.from_weight == "none":
        return
    start = weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe)
    saved = weight_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe, allow_file=False)
    if is_model_folder(args.from_weight):  # a model folder: the run writes {save_weight}_{hidden}_hf/
        start, saved = os.path.abspath(args.from_weight), os.path.abspath(model_folder_path(saved))
    same = os.path.isfile(start) and os.path.isfile(saved) and os.path.samefile(start, saved)
    if same or os.path.abspath(start) == os.path.abspath(saved):
        raise InputError(
            f"--from_weight {args.from_weight} is {start}, the file this run saves its policy to "
            f"(--save_weight {args.save_weight}): the run's first save would overwrite its starting "
            f"weights; give this run another --save_weight (or start from a copy of that file)"
        )


def check_resume_run_dir(args, path, checkpoint):
    """Refuse a resume whose ``--run_dir`` holds another run's metrics.jsonl (its rows would be appended to that
    run's). The run's own folder, recorded in ``path``, and a folder without metrics pass. Raises ValueError."""
    if not args.run_dir:
        return
    saved = checkpoint["progress"].get("run_dir")
    if saved and not os.path.isabs(saved):  # stored relative to save_dir
        saved = os.path.join(args.save_dir, saved)
    if saved and os.path.realpath(saved) == os.path.realpath(args.run_dir):
        return
    metrics_path = os.path.join(args.run_dir, "metrics.jsonl")
    if os.path.isfile(metrics_path) and os.path.getsize(metrics_path) > 0:
        raise InputError(
            f"--run_dir {args.run_dir} holds another run's metrics ({metrics_path}); the run saved in "
            f"{path} writes its metrics to {saved or 'no recorded folder'}: drop --run_dir to resume "
            f"into its own folder, or give a --run_dir without metrics"
        )


@functools.lru_cache(maxsize=8)
def file_digest(path, size, mtime_ns):
    """(size, sha256 hex) of the file at ``path``; ``size`` and ``mtime_ns`` key the cache (a file is read once)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            sha.update(chunk)
    return size, sha.hexdigest()


def data_digest(path):
    """{"size": bytes, "sha256": hex} of the data file at ``path``, as a resume file records it."""
    stat = os.stat(path)
    size, sha256 = file_digest(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    return {"size": size, "sha256": sha256}


def check_resume_data(args, path, checkpoint):
    """Refuse to resume when ``--data_path`` differs (size or sha256) from the file the saved run read: the saved data
    position and the sample indices of its metrics count prompts of that file. ``--allow_data_change 1`` continues
    with a warning. Raises ValueError naming the file, both sizes or digests, and the flag."""
    saved = checkpoint.get("data")
    if not saved:  # a resume file without the record
        return
    current = data_digest(args.data_path)
    if current == dict(saved):
        return
    what = (
        f"{saved['size']} -> {current['size']} bytes"
        if saved["size"] != current["size"]
        else f"same size, sha256 {saved['sha256'][:12]}... -> {current['sha256'][:12]}..."
    )
    if getattr(args, "allow_data_change", 0):
        Logger(
            f"warning: --data_path {args.data_path} changed since {path} was saved ({what}); "
            f"--allow_data_change 1: the run continues at the saved position, counted in prompts of this file"
        )
        return
    raise InputError(
        f"--data_path {args.data_path} changed since {path} was saved ({what}): the saved data position "
        f"and the sample indices of the metrics count prompts of the saved file. Put that file back to "
        f"resume exactly, or pass --allow_data_change 1 to continue at the same position in this one"
    )


def check_work_left(args, path, checkpoint, total_steps, world_size):
    """Refuse a resume with no step left: the saved step, rescaled to this run's prompts per step
    (``resume_progress``'s rule), at or past ``total_steps``. Raises ValueError naming the file, both steps and the
    flags that give the run steps to do."""
    progress = checkpoint["progress"]
    saved_prompts = checkpoint["args"].get("batch_size", args.batch_size) * progress.get("world_size", 1)
    prompts = args.batch_size * world_size
    step = progress["step"] * saved_prompts // prompts
    if step < total_steps:
        return
    at = f"step {step}"
    if step != progress["step"]:
        at = (
            f"step {progress['step']} of {saved_prompts} prompts per step, which is step {step} at this run's "
            f"{prompts} (--batch_size {args.batch_size} x {world_size} processes)"
        )
    raise InputError(
        f"nothing to resume: {path} is at {at} and this run has {total_steps} steps. To train further "
        f"pass a --max_steps above {step} (or more --epochs; the schedule is rebuilt); for a new run "
        f"give another --save_weight or --save_dir"
    )


def check_other_resume_files(args, path):
    """``--from_resume 1`` without a resume file at ``path``: refuse when ``--save_dir`` holds other runs' resume
    files (a mistyped name would start at step 0 beside them). Raises ValueError naming each file with the flags
    that resume it, and ``--from_resume 0``."""
    others = sorted(
        name for name in os.listdir(args.save_dir) if name.endswith("_resume.pth") and name != os.path.basename(path)
    )
    if not others:
        return
    described = []
    for name in others:
        match = re.fullmatch(r"(.+)_(\d+)(_moe)?_resume\.pth", name)
        flags = (
            f" (--save_weight {match[1]} --hidden_size {match[2]}{' --use_moe 1' if match[3] else ''})" if match else ""
        )
        described.append(f"{name}{flags}")
    raise InputError(
        f"--from_resume 1: there is no {path}, but {args.save_dir} holds {', '.join(described)}: pass "
        f"the flags of the run to resume, or --from_resume 0 to start this run at step 0"
    )


def peek_resume(path):
    """The resume file at ``path`` with its tensors memory-mapped (not read), or None when there is none or it cannot
    be read (then a fresh run may replace it)."""
    if not os.path.isfile(path):
        return None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # a truncated, legacy or foreign file: nothing a fresh run could resume
        return None
    return checkpoint if isinstance(checkpoint, dict) and "progress" in checkpoint else None


def run_finished(checkpoint):
    """Whether a resume file's run reached its last step (``total_steps``, recorded with every checkpoint; for a file
    without it, ``--max_steps`` of its flags)."""
    progress = checkpoint["progress"]
    total = progress.get("total_steps") or checkpoint.get("args", {}).get("max_steps") or 0
    return 0 < total <= progress["step"]


def start_or_resume(args, script, objects, steps_per_epoch, device, rank, world_size):
    """Where the run starts: step 0, or (``--from_resume 1`` and a resume file exists) the saved step, with
    ``objects`` (policy, optimizer, ...) and this rank's random state restored.

    The reference model is not in ``objects``: it stays the initial ``--from_weight`` weights (a resume whose
    ``--from_weight`` is the file the run saves to is refused, since that file holds the trained policy).
    Under torchrun every rank must find the same file: ranks that would start from different steps stop.
    Returns:
        (progress, rollout_engine_state): progress is a dict with step, epoch, batch_in_epoch, lr_schedule_step,
        run_dir, wandb_id, bad_steps_in_a_row; rollout_engine_state the engine's saved state ({} when none).
    Raises:
        ValueError: a resume file from another script, format or architecture (see ``load_resume``), a
            ``--from_weight`` that is the saved policy, or ranks at different steps.
    """
    progress = {
        "step": 0,
        "epoch": 0,
        "batch_in_epoch": 0,
        "lr_schedule_step": 0,
        "run_dir": None,
        "wandb_id": None,
        "bad_steps_in_a_row": 0,
    }
    if not args.from_resume:
        return progress, {}
    path = resume_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe)
    checkpoint = load_resume(path, script, args)
    rollout_engine_state = {}
    if checkpoint is None:
        Logger(f"--from_resume 1: no resume file at {path}, starting at step 0")
    else:
        progress = restore_from_checkpoint(args, objects, steps_per_epoch, path, checkpoint, progress, rank, world_size)
        rollout_engine_state = checkpoint["states"].get("rollout_engine", {})
    if dist.is_initialized():  # every rank must have read the same file (multi-node: a shared --save_dir)
        steps = torch.tensor([progress["step"], -progress["step"]], dtype=torch.float64, device=device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if steps[0].item() != -steps[1].item():
            raise InputError(
                f"ranks would resume from different steps (up to {int(steps[0].item())}, this one "
                f"{progress['step']}): every node needs the same {path} (a shared --save_dir)"
            )
    return progress, rollout_engine_state


def restore_from_checkpoint(args, objects, steps_per_epoch, path, checkpoint, progress, rank, world_size):
    """The restore part of ``start_or_resume``: states, data position and random state; returns ``progress`` with
    the saved position."""
    start_weights = weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe)
    saved_weights = weight_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe, allow_file=False)
    if is_model_folder(args.from_weight):  # a model folder: the run writes {save_weight}_{hidden}_hf/
        start_weights, saved_weights = args.from_weight, model_folder_path(saved_weights)
    if os.path.abspath(start_weights) == os.path.abspath(saved_weights):
        raise InputError(
            f"--from_weight {args.from_weight} is {saved_weights}, the file this run saves its policy "
            f"to, so on resume the reference model would be the step-{checkpoint['progress']['step']} "
            f"policy, not the starting one; start runs from a copy (another --save_weight)"
        )
    sharded = sharded_objects(objects)  # --fsdp 1: read with torch.distributed.checkpoint
    record = checkpoint.get("sharded")
    if bool(record) != bool(sharded):
        saved, this = (1, 0) if record else (0, 1)
        raise InputError(
            f"{path} was saved under --fsdp {saved} but this run has --fsdp {this}: pass --fsdp {saved} to resume "
            f"it (a resume does not convert between whole and sharded states)"
        )
    sharded_names = set(sharded) | {optimizer_name(name) for name in sharded}
    load_training_states({k: v for k, v in objects.items() if k not in sharded_names}, checkpoint["states"], path)
    if sharded:
        folder = os.path.join(os.path.dirname(path), record["folder"])
        if not os.path.isfile(os.path.join(folder, ".metadata")):
            raise InputError(f"{path} names the shards {folder}, which are missing: copy the whole --save_dir")
        load_sharded(folder, sharded, record["models"])
    for line in changed_flags(checkpoint["args"], args):
        Logger(line)
    resumed, rng_state = resume_progress(checkpoint, world_size, steps_per_epoch, rank, args.batch_size)
    progress = dict(progress, **resumed, saved_step=checkpoint["progress"]["step"])
    if progress.get("run_dir") and not os.path.isabs(progress["run_dir"]):  # stored relative to save_dir
        progress["run_dir"] = os.path.join(args.save_dir, progress["run_dir"])
    if rng_state is not None:
        set_rng_state(rng_state)
    else:
        saved_world_size = checkpoint["progress"]["world_size"]
        setup_seed(args.seed + rank + 1000 * progress["step"])
        Logger(
            f"world size changed from {saved_world_size} to {world_size}: random states reseeded, so this resume "
            f"is not bit-exact"
        )
    if progress["step"] != checkpoint["progress"]["step"]:
        Logger(
            f"prompts per step changed: step and learning-rate schedules rescaled to {progress['step']}, data "
            f"position to batch {progress['batch_in_epoch']} of epoch {progress['epoch']} (the prompts seen stay "
            f"the same)"
        )
    Logger(
        f"resumed from {path} at step {progress['step']} (epoch {progress['epoch']}, "
        f"batch {progress['batch_in_epoch']})"
    )
    return progress


def checkpoint_progress(step, total_steps, position, scheduler, run_dir, writer, guard, optimizer_step=None):
    """What a checkpoint saves of the run's progress, the same in the three RL scripts: the step, the data position
    ({"epoch", "batch_in_epoch"}), the schedule's step, the metrics folder and wandb id, the skipped updates in a
    row, and (``optimizer_step``: an ``OptimizerStep``) its open accumulation window. -> dict."""
    progress = {
        "step": step,
        "total_steps": total_steps,
        **position,
        "lr_schedule_step": scheduler.last_epoch,
        "run_dir": run_dir,
        "wandb_id": writer.wandb_id,
        "bad_steps_in_a_row": guard.in_a_row,
    }
    return {**progress, **(optimizer_step.state() if optimizer_step is not None else {})}
