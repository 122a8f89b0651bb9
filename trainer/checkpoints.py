"""Weights on disk and the resume file: MiniMind's ``.pth`` names, strict loads, the policy of a run, atomic saves;
the record of the tokenizer a checkpoint was trained with, checked at start; the resume file (every state a run
needs to continue bit for bit), the random states of every rank, and where a resumed run starts.

Infrastructure, not RL: a learner can skip this file.
"""
import errno
import functools
import glob
import hashlib
import json
import os
import random
import re
import shlex

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from trainer.distributed import Logger, is_main_process, setup_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER_PATH = os.path.join(ROOT, "model")
DEFAULT_SAVE_DIR = os.path.join(ROOT, "out")


def weight_path(from_weight, save_dir, hidden_size, use_moe, allow_file=True):
    """MiniMind's naming: ``{save_dir}/{name}_{hidden}[_moe].pth``.

    For loading (``allow_file``): ``from_weight`` itself if it is a file; else the name in ``save_dir``; else,
    when that file does not exist, the name in the repository's ``out/`` (the bundled starting policy), so
    that ``--save_dir runs/exp1`` still starts from ``out/full_sft_256.pth``. When neither exists the path in
    ``save_dir`` is returned (and ``load_weights`` names it). Saves pass ``allow_file=False``: they always
    write into ``save_dir``.
    """
    if allow_file and os.path.isfile(from_weight):
        return from_weight
    suffix = "_moe" if use_moe else ""
    file_name = f"{from_weight}_{hidden_size}{suffix}.pth"
    path = os.path.join(save_dir, file_name)
    bundled = os.path.join(DEFAULT_SAVE_DIR, file_name)
    if allow_file and not os.path.isfile(path) and os.path.isfile(bundled):
        return bundled
    return path


def minimind_dims(state_dict):
    """The architecture flags a MiniMind state dict was trained with, read from its tensors' names and shapes:
    {"hidden_size", "num_hidden_layers", "use_moe", "vocab_size"}, or None when it is not a MiniMind state dict
    (no ``model.embed_tokens.weight``)."""
    embed = state_dict.get("model.embed_tokens.weight")
    if embed is None or embed.dim() != 2:
        return None
    layers = {int(name.split(".")[2]) for name in state_dict if name.startswith("model.layers.")}
    return {"hidden_size": int(embed.shape[1]), "num_hidden_layers": len(layers),
            "use_moe": int(any(".mlp.experts." in name for name in state_dict)), "vocab_size": int(embed.shape[0])}


def describe_dims(dims):
    """'hidden_size 768, 8 layers, dense, vocab 6400' for ``minimind_dims``'s dict."""
    return (f"hidden_size {dims['hidden_size']}, {dims['num_hidden_layers']} layers, "
            f"{'MoE' if dims['use_moe'] else 'dense'}, vocab {dims['vocab_size']}")


def check_state_dict_fits(path, own, state_dict, flag_hint, may_be_missing=()):
    """Raise unless ``state_dict`` (read from ``path``) has exactly the keys and shapes of ``own`` (a model's
    state dict); keys in ``may_be_missing`` may be absent from ``state_dict`` (a freshly initialised head).

    Raises:
        ValueError: naming ``path``, the parameter, both shapes and ``flag_hint`` on a shape mismatch, or listing
            the missing / unexpected keys (first 8 of each).
    """
    dims = minimind_dims(state_dict)
    found = ""
    if dims is not None:  # what the checkpoint holds, as the flags that build it
        flags = f"--hidden_size {dims['hidden_size']} --num_hidden_layers {dims['num_hidden_layers']}"
        found = f" ({path} holds a MiniMind of {describe_dims(dims)}: pass {flags} --use_moe {dims['use_moe']})"
    for name, tensor in state_dict.items():
        if name in own and own[name].shape != tensor.shape:
            raise ValueError(
                f"{path}: parameter {name} has shape {tuple(tensor.shape)} but the model built from the flags "
                f"expects {tuple(own[name].shape)}; change {flag_hint} to match the checkpoint{found}"
            )
    missing = sorted(set(own) - set(state_dict) - set(may_be_missing))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"{path}: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}; "
                         f"check {flag_hint}{found}")


def load_weights(model, path, flag_hint="--hidden_size / --num_hidden_layers / --use_moe"):
    """Load a ``.pth`` state dict into ``model`` strictly (weights_only=True).

    Raises:
        FileNotFoundError: if ``path`` is missing; the message lists the ``.pth`` files next to it.
        ValueError: on a shape mismatch (naming the parameter, both shapes and the flags to change) or
            missing/unexpected keys.
    """
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.pth")))
        raise FileNotFoundError(f"weights not found: {path} (in {folder}: {found or 'no .pth files'})")
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
    own = model.state_dict()
    check_state_dict_fits(path, own, state_dict, flag_hint)
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state_dict.items()}, strict=True)


def build_config(hidden_size, num_hidden_layers, use_moe, vocab_size=6400):
    """MiniMindConfig from the architecture flags every script shares."""
    return MiniMindConfig(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                          use_moe=bool(use_moe), vocab_size=vocab_size)


def init_model(lm_config, from_weight="none", save_dir=DEFAULT_SAVE_DIR, tokenizer_path=DEFAULT_TOKENIZER_PATH,
               device="cpu", tokenizer=None):
    """Build a ``MiniMindForCausalLM`` and its tokenizer, loading weights strictly unless from_weight == 'none'.

    Args:
        lm_config: ``MiniMindConfig``.
        from_weight: a weight name resolved as ``{save_dir}/{name}_{hidden}[_moe].pth`` (then in the
            repository's ``out/``, see ``weight_path``), a path to a ``.pth`` file, or 'none' for random init.
        tokenizer: an already loaded tokenizer (then ``tokenizer_path`` is not read again).
    Returns:
        (model fp32 on ``device``, tokenizer)
    Raises:
        FileNotFoundError / ValueError: see ``load_weights``.
    """
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(tokenizer_path)
    model = MiniMindForCausalLM(lm_config)
    if from_weight != "none":
        path = weight_path(from_weight, save_dir, lm_config.hidden_size, lm_config.use_moe)
        load_weights(model, path)
        Logger(f"loaded weights {path} ({describe_dims(minimind_dims(model.state_dict()))})")
        sizes = re.compile(rf"{re.escape(from_weight)}_\d+(_moe)?\.pth")  # other sizes of this weight, not ppo_critic
        others = sorted(p for p in glob.glob(os.path.join(glob.escape(save_dir), f"{glob.escape(from_weight)}_*.pth"))
                        if sizes.fullmatch(os.path.basename(p)) and os.path.abspath(p) != os.path.abspath(path))
        if others and not os.path.isfile(from_weight):  # e.g. upstream's full_sft_768.pth beside the bundled one
            Logger(f"note: {', '.join(map(os.path.basename, others))} in {save_dir} too: --hidden_size, "
                   f"--num_hidden_layers and --use_moe choose which {from_weight} a run starts from")
    if len(tokenizer) > lm_config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer_path} has {len(tokenizer)} tokens but vocab_size is "
                         f"{lm_config.vocab_size}")
    return model.to(device), tokenizer


def load_policy(lm_config, args, tokenizer, device):
    """The policy of an RL run (chapter 8.1's actor): ``init_model`` with ``--from_weight``, ``--save_dir`` and the
    run's tokenizer; fp32 weights on ``device``. Raises what ``init_model`` raises."""
    model, _ = init_model(lm_config, args.from_weight, args.save_dir, args.tokenizer_path, device, tokenizer)
    return model


def atomic_save(obj, path):
    """torch.save to ``path`` through a temporary file in the same folder, fsync, then os.replace.

    A crash, a SIGKILL or a full disk leaves the previous file at ``path`` intact (a temporary file left by a
    killed writer is removed by the next save to ``path``).
    Raises:
        OSError: naming ``path`` when the folder is not writable or the write fails.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp{os.getpid()}"
    for stale in glob.glob(glob.escape(path) + ".tmp*"):  # left by a process killed mid-write
        os.remove(stale)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch's zip writer reports a full disk as a RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = getattr(err, "strerror", None) or str(err)
        code = getattr(err, "errno", None) or errno.EIO
        raise OSError(code, f"could not save checkpoint to {path}: {reason}") from err


def half_state_dict(model):
    """The model's state dict in fp16 on CPU (MiniMind's release format for ``.pth`` weights)."""
    raw = unwrap_model(model)
    return {k: v.detach().half().cpu() for k, v in raw.state_dict().items()}


def unwrap_model(model):
    """The module inside a DistributedDataParallel (or torch.compile) wrapper."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def check_writable_dir(path):
    """Create ``path`` if needed and prove a file can be written there.

    Raises:
        OSError: naming ``path`` (not a folder, no permission, read-only or full disk).
    """
    probe = os.path.join(path, f".write_probe{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as err:
        raise OSError(err.errno, f"{path} is not a writable folder: {err.strerror}") from err


# ----------------------------------------------------------------------------- the tokenizer of a checkpoint
# Which tokenizer a MiniMind checkpoint was trained with, and the start-up check that a run uses that one.
#
# The embedding of a MiniMind checkpoint does not say which tokenizer it belongs to: this project's
# ``out/full_sft_256.pth`` keeps upstream's 6400-row embedding (``vocab_size`` 6400) while it was trained with the
# project's 441-token tokenizer (``model/``), and an upstream ``full_sft_768.pth`` has the same 6400 rows but needs
# upstream's 6400-token tokenizer. So every ``.pth`` this project's scripts save gets a record beside it,
# ``NAME.tokenizer.json`` (``write_tokenizer_record``): the number of tokens and a digest of the vocabulary of the
# tokenizer it was trained with. ``check_tokenizer_fits_checkpoint`` then accepts
#
#   - a checkpoint with a record: when the run's tokenizer has that size and that vocabulary;
#   - a checkpoint without one (upstream's, or any other): when the run's tokenizer has as many tokens as the
#     embedding has rows;
#
# and stops the run otherwise, before any model is built, naming both sizes and ``--tokenizer_path``.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")  # written by the chat template, one id each
EMBEDDING_KEY = "model.embed_tokens.weight"


def tokenizer_record_path(checkpoint_path):
    """``dir/NAME.pth`` -> ``dir/NAME.tokenizer.json``."""
    return os.path.splitext(checkpoint_path)[0] + ".tokenizer.json"


def tokenizer_record(tokenizer):
    """{"tokenizer_size": len(tokenizer), "vocab_sha256": sha256 of the sorted (token, id) pairs of get_vocab()}."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return {"tokenizer_size": len(tokenizer), "vocab_sha256": hashlib.sha256(vocab.encode("utf-8")).hexdigest()}


@functools.lru_cache(maxsize=4)
def tokenizer_record_of(tokenizer_path):
    """``tokenizer_record`` of the tokenizer folder ``tokenizer_path`` (loaded once per process)."""
    from transformers import AutoTokenizer
    return tokenizer_record(AutoTokenizer.from_pretrained(tokenizer_path))


def write_tokenizer_record(checkpoint_path, tokenizer_path):
    """Write ``tokenizer_record_path(checkpoint_path)``: the record of the tokenizer in ``tokenizer_path`` (JSON,
    written to a temporary file, then renamed into place). Returns the record's path."""
    path = tokenizer_record_path(checkpoint_path)
    record = dict(tokenizer_record_of(tokenizer_path), tokenizer_path=os.path.basename(os.path.abspath(tokenizer_path)))
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(temporary, path)
    return path


def embedding_rows(checkpoint_path):
    """Rows of ``model.embed_tokens.weight`` in a MiniMind ``.pth`` state dict (memory-mapped where the file allows,
    so the tensors are not read), or None when the file has no such tensor (the strict load names that later)."""
    try:
        state_dict = torch.load(checkpoint_path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be memory-mapped
        state_dict = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    tensor = state_dict.get(EMBEDDING_KEY) if isinstance(state_dict, dict) else None
    return None if tensor is None else tensor.shape[0]


def check_tokenizer_fits_checkpoint(tokenizer, tokenizer_path, checkpoint_path):
    """Stop a run whose tokenizer is not the one its starting checkpoint was trained with.

    Args:
        tokenizer: the run's tokenizer (transformers), loaded from ``tokenizer_path`` (named in the messages).
        checkpoint_path: the ``.pth`` the policy starts from, or None (random init): then only the tokens are checked.
    Raises:
        ValueError: the chat template's tokens (``CHAT_TOKENS``) are not single tokens of the tokenizer, or it has no
            EOS token; the checkpoint's record names another tokenizer (size or vocabulary); or, without a record,
            the tokenizer's size differs from the checkpoint's embedding rows. Each message names the sizes, the
            files and ``--tokenizer_path``.
    """
    vocab = tokenizer.get_vocab()
    missing = [t for t in CHAT_TOKENS if t not in vocab or tokenizer.encode(t, add_special_tokens=False) != [vocab[t]]]
    if missing:
        raise ValueError(f"--tokenizer_path {tokenizer_path}: the chat template needs {missing} as single tokens and "
                         f"this tokenizer of {len(tokenizer)} tokens lacks them (a MiniMind tokenizer has them)")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer_path {tokenizer_path}: the tokenizer has no EOS token "
                         f"(MiniMind's is <|im_end|>)")
    if checkpoint_path is None or not os.path.isfile(checkpoint_path):
        return
    record_path = tokenizer_record_path(checkpoint_path)
    if os.path.isfile(record_path):
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        ours = tokenizer_record(tokenizer)
        if record["tokenizer_size"] != ours["tokenizer_size"]:
            raise ValueError(f"{checkpoint_path} was trained with a tokenizer of {record['tokenizer_size']} tokens "
                             f"({record_path}), but --tokenizer_path {tokenizer_path} has {ours['tokenizer_size']}: "
                             f"pass --tokenizer_path with the tokenizer it was trained with")
        if record["vocab_sha256"] != ours["vocab_sha256"]:
            raise ValueError(f"{checkpoint_path} was trained with another vocabulary of the same size "
                             f"({record['tokenizer_size']} tokens, {record_path}) than --tokenizer_path "
                             f"{tokenizer_path}: pass --tokenizer_path with the tokenizer it was trained with")
        return
    rows = embedding_rows(checkpoint_path)
    if rows is not None and rows != len(tokenizer):
        raise ValueError(f"{checkpoint_path} has an embedding of {rows} rows (a {rows}-token vocabulary) and no "
                         f"record of its tokenizer ({os.path.basename(record_path)}), but --tokenizer_path "
                         f"{tokenizer_path} has {len(tokenizer)} tokens: pass --tokenizer_path with the tokenizer it "
                         f"was trained with (upstream MiniMind's checkpoints need upstream's tokenizer, its model/ "
                         f"folder of 6400 tokens)")


# ----------------------------------------------------------------------------- resume
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
    ``get_state()`` of ``torch.Generator`` objects, a rollout engine's ``resume_state()``. A model's gradients that
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
        elif hasattr(obj, "resume_state"):  # a rollout engine
            states[name] = obj.resume_state()
        else:
            states[name] = obj.state_dict()
    return states


def load_optimizer_state(optimizer, state):
    """``optimizer.load_state_dict(state)`` that keeps this optimizer's kernel (``fused``, ``foreach``).

    ``load_state_dict`` takes every group option from the saved state, so a checkpoint written with another
    kernel (a plain ``torch.optim.AdamW``) would bring that kernel back, silently. State dicts with another number
    of groups go to ``load_state_dict`` unchanged, which raises its ValueError.
    """
    saved_groups = state["param_groups"]
    if len(saved_groups) == len(optimizer.param_groups):
        kernel_options = [{key: group[key] for key in ("fused", "foreach") if key in group}
                          for group in optimizer.param_groups]
        state = dict(state, param_groups=[dict(saved, **options)
                                          for saved, options in zip(saved_groups, kernel_options)])
    optimizer.load_state_dict(state)


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
        progress = restore_from_checkpoint(args, run, objects, steps_per_epoch, path, checkpoint, progress)
    if dist.is_initialized():  # every rank must have read the same file (multi-node: a shared --save_dir)
        steps = torch.tensor([progress["step"], -progress["step"]], dtype=torch.float64, device=run.device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if steps[0].item() != -steps[1].item():
            raise ValueError(f"ranks would resume from different steps (up to {int(steps[0].item())}, this one "
                             f"{progress['step']}): every node needs the same {path} (a shared --save_dir)")
    return progress


def restore_from_checkpoint(args, run, objects, steps_per_epoch, path, checkpoint, progress):
    """The restore part of ``start_or_resume``: states, data position and random state; returns ``progress`` with
    the saved position."""
    start_weights = weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe)
    saved_weights = weight_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe, allow_file=False)
    if os.path.abspath(start_weights) == os.path.abspath(saved_weights):
        raise ValueError(f"--from_weight {args.from_weight} is {saved_weights}, the file this run saves its policy "
                         f"to, so on resume the reference model would be the step-{checkpoint['progress']['step']} "
                         f"policy, not the starting one; start runs from a copy (another --save_weight)")
    load_training_states(objects, checkpoint["states"], path)
    for change in describe_changed_flags(checkpoint["args"], args):
        Logger(f"warning: resuming with a changed flag: {change}")
    run.rollout_engine_state = checkpoint["states"].get("rollout_engine")  # loaded into the engine by start()
    resumed, rng_state = resume_progress(checkpoint, run.world_size, steps_per_epoch, run.rank)
    progress = dict(progress, **resumed)
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
    Logger(f"resumed from {path} at step {progress['step']} (epoch {progress['epoch']}, "
           f"batch {progress['batch_in_epoch']})")
    return progress


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
