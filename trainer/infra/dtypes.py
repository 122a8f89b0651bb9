"""Dtypes: the ``--dtype`` of the training forwards (fp32 or bf16 autocast) and the ``--*_dtype`` flags.

Infrastructure, not RL: a learner can skip this file.
"""

import contextlib

import torch

from model.hf_qwen3 import DTYPES  # the --*_dtype flag values, defined once


TRAIN_DTYPES = ("float32", "bfloat16")


DTYPE_CHOICES = ("auto", *TRAIN_DTYPES)


def resolve_train_dtype(name, device):
    """``--dtype`` as one of ``TRAIN_DTYPES``: "auto" is bfloat16 on a CUDA GPU that supports it (upstream
    MiniMind's default) and float32 elsewhere (a CPU without bf16 matrix units runs bf16 slower than fp32)."""
    if name != "auto":
        return name
    if torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported():
        return "bfloat16"
    return "float32"


def autocast_context(device, dtype_name):
    """The context for the policy's (and critic's) forwards under ``--dtype``.

    "auto": ``resolve_train_dtype``. "float32": no autocast. "bfloat16": ``torch.autocast`` on the device's type
    (CPU or CUDA); weights, gradients and optimizer states stay fp32, matrix products run in bf16, and every
    log-softmax of this project casts its logits to fp32 first (``selective_log_softmax``), so log-probs, KL and
    losses are fp32.
    bf16 is only faster on hardware with bf16 matrix units (CUDA GPUs, CPUs with AMX / AVX512-BF16); on a
    CPU without them it is much slower (``scripts/bench/bench.py`` measures both peaks).

    The context can be entered again after each exit (the scripts build it once and reuse it for every forward),
    but not inside itself: ``torch.autocast`` keeps the state it restores on the object.

    Args:
        device: a torch.device or string ("cpu", "cuda:0").
        dtype_name: one of ``DTYPE_CHOICES``.
    Raises:
        ValueError: for another name.
    """
    if dtype_name not in DTYPE_CHOICES:
        raise ValueError(f"unknown --dtype {dtype_name!r}; valid: {', '.join(DTYPE_CHOICES)}")
    dtype_name = resolve_train_dtype(dtype_name, device)
    if dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[dtype_name])


def reward_model_dtype(name, device):
    """The frozen reward model's torch dtype: ``--reward_dtype`` ``name`` when given, else float16 on a CUDA
    device, as upstream MiniMind loads its reward model (half the memory of fp32; float16 keeps 3 more mantissa
    bits than bfloat16, and a frozen scorer needs no bfloat16 range), and float32 elsewhere (a CPU runs half
    precision slower than fp32).

    Raises:
        ValueError: for a name that is not one of ``DTYPES``.
    """
    return resolve_dtype(name, torch.float16 if torch.device(device).type == "cuda" else torch.float32)


def resolve_dtype(name, default):
    """torch dtype of a --*_dtype flag value ("float32", "bfloat16", "float16"), or ``default`` for "".

    Raises:
        ValueError: for any other name, listing the valid ones.
    """
    if not name:
        return default
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]
