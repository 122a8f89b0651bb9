"""Processes: torchrun set-up and tear-down, seeding, printing on rank 0, the wrappers the training forwards run
through (DistributedDataParallel, torch.compile), and the few values ranks agree on.

Infrastructure, not RL: a learner can skip this file. Without torchrun every function is the single-process
identity (``mean_over_ranks`` returns its input, ``any_rank`` the plain bool).
"""

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from trainer.infra.errors import RankZeroError, user_message


def is_main_process():
    """True on rank 0, or when not running distributed."""
    return not dist.is_initialized() or dist.get_rank() == 0


def Logger(content):
    """Print on the main process only (flushes, so logs show up under torchrun and pipes)."""
    if is_main_process():
        print(content, flush=True)


PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # a collective waited on longer than this raises on its rank


def init_distributed_mode(device="", cpu_collectives=False):
    """Initialise torch.distributed when launched by torchrun (RANK in the environment).

    Backend: nccl on CUDA (one device per LOCAL_RANK), gloo on CPU. A rank that raises exits, and torchrun then
    stops the others at once; a rank that hangs (a node lost, a rank stuck in a collective the others never reach)
    makes the others' next collective raise after ``PROCESS_GROUP_TIMEOUT`` (30 minutes, gloo's default, set for
    NCCL too: a CPU rollout of a large policy can keep one rank that long), so that no run waits for ever.
    Args:
        device: ``--device``: "" = the first GPU if there is one, else the CPU; "cpu" keeps every process on
            the CPU (gloo) even where CUDA exists; "cuda:N" picks the GPU of a single process (under torchrun
            each process takes the GPU of its LOCAL_RANK).
        cpu_collectives: on CUDA, gloo beside NCCL for collectives on CPU tensors (``--fsdp_cpu_offload 1``: the
            shards and their gradients live in CPU memory).
    Returns:
        (local_rank, device): local_rank is 0 without torchrun; device is a string like "cuda:1" or "cpu".
    """
    cuda = torch.cuda.is_available() and device != "cpu"
    if int(os.environ.get("RANK", -1)) == -1:
        device = device or ("cuda:0" if cuda else "cpu")
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(device)  # later calls without an index (bf16 support, memory) mean this GPU
        return 0, device
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = ("cuda:nccl,cpu:gloo" if cpu_collectives else "nccl") if cuda else "gloo"
    dist.init_process_group(backend=backend, timeout=PROCESS_GROUP_TIMEOUT)
    if cuda:
        torch.cuda.set_device(local_rank)
        return local_rank, f"cuda:{local_rank}"
    return local_rank, "cpu"


def rank_and_world_size():
    """(this process's rank, number of processes): (0, 1) when not distributed."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed():
    """End a distributed run explicitly: a barrier, so that every rank has finished its collectives, then
    ``destroy_process_group``. Callers delete their DistributedDataParallel wrappers first: a wrapper freed
    later, while Python tears down ``main``'s locals, joins gloo's worker threads from its destructor and can
    deadlock on the GIL (pytorch#75097, #56297), so that a finished run never exits. No-op when not distributed.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()


def setup_seed(seed):
    """Seed the Python, NumPy and torch (CPU and CUDA) RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def wrap_ddp(model, device, local_rank):
    """DistributedDataParallel around ``model`` when distributed (gloo on CPU, one GPU per rank on CUDA); a model
    that ``--fsdp 1`` sharded (infra/fsdp.py) is returned as it is: FSDP2 reduces its gradients itself."""
    if not dist.is_initialized() or isinstance(model, FSDPModule):
        return model
    # MoE experts that received no token on a rank get no gradient there: DDP must be told to expect that.
    use_moe = bool(getattr(getattr(model, "config", None), "use_moe", False))
    return DistributedDataParallel(
        model, device_ids=[local_rank] if device.startswith("cuda") else None, find_unused_parameters=use_moe
    )


def unwrap_model(model):
    """The module inside a DistributedDataParallel (or torch.compile) wrapper."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def compile_for_training(model, use_compile):
    """``--use_compile 1``: ``torch.compile(model, dynamic=True)`` (the lengths change every step), for the
    forwards that train (log-probs with gradient, values); the rollout keeps the plain module. The compiled
    wrapper shares the parameters; ``unwrap_model`` returns the plain module. ``use_compile`` 0: ``model``."""
    return torch.compile(model, dynamic=True) if use_compile else model


def any_rank(flag, device):
    """True when ``flag`` is true on at least one rank (all_reduce MAX); the plain bool when not distributed."""
    if not dist.is_initialized():
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


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


def broadcast_from_rank0(value):
    """``value`` as rank 0 has it, on every rank (the value itself when not distributed)."""
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def run_on_rank0(work, what="rank 0's work"):
    """Call ``work()`` on rank 0 only; every rank raises when it failed there (rank 0 its own error, the other ranks
    a RuntimeError that quotes it, a ``RankZeroError`` when rank 0's is a user's error), so that no rank trains on
    while rank 0 stops. Not distributed: ``work()``."""
    error, caught = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            work()
        except (RuntimeError, OSError, ValueError) as err:
            error, caught = (f"{type(err).__name__}: {err}", user_message(err) is not None), err
    error = broadcast_from_rank0(error)
    if caught is not None:
        raise caught
    if error is not None:
        text, by_the_user = error
        raise (RankZeroError if by_the_user else RuntimeError)(f"{what} failed on rank 0: {text}")
