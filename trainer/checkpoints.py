"""Weights on disk: MiniMind's ``.pth`` names, strict loads, the policy of a run, atomic saves.

Infrastructure, not RL: a learner can skip this file.
"""
import errno
import glob
import os
import re

import torch
from transformers import AutoTokenizer

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from trainer.distributed import Logger

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
