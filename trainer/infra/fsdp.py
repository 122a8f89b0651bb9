"""Sharding (``--fsdp 1`` under torchrun): PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) around the policy,
the reference and PPO's critic, and their sharded checkpoints (``torch.distributed.checkpoint``).

Infrastructure, not RL: the chapter's loops do not change. Under DDP every rank holds the whole policy, its gradients
and AdamW's two moments (16 bytes per fp32 parameter) plus the whole reference; with ``fully_shard`` each of W ranks
holds 1/W of each and gathers one decoder layer at a time for its forward and backward (docs/distributed.md).

The layout: every decoder layer is one unit, and the root (the embedding, the tied LM head, the final norm; PPO's
value head) is one more, so the tied embedding and LM head stay in one unit. Without torchrun, or with ``--fsdp 0``,
every function here is the identity.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from model.model_minimind import CriticModel, MiniMindForCausalLM
from trainer.infra.distributed import run_on_rank0, unwrap_model


def is_sharded(model):
    """True when ``model`` (or the module inside its wrapper) was sharded by ``shard_model``."""
    return model is not None and isinstance(unwrap_model(model), FSDPModule)


def fsdp_units(model):
    """The FSDP units of a sharded model, the decoder layers first and the root last ([] for any other model)."""
    if not is_sharded(model):
        return []
    return [module for module in unwrap_model(model).modules() if isinstance(module, FSDPModule)][::-1]


def load_on_rank0(load, lm_config, fsdp, critic=False):
    """Where the whole starting weights exist: with ``fsdp`` under torchrun, ``load()`` runs on rank 0 alone and the
    other ranks build the same architecture on the meta device (no memory), so that no rank but 0 ever holds a
    whole model; ``shard_model(..., from_rank0=True)`` then sends every rank its shard. Otherwise ``load()``.

    Args:
        load: a function of no arguments returning the loaded model (``MiniMindForCausalLM``, or ``CriticModel``
            with ``critic``) in fp32.
        lm_config: the ``MiniMindConfig`` the meta copies are built from.
    Raises:
        what ``load`` raises on rank 0, on rank 0; the other ranks a RuntimeError quoting it (``run_on_rank0``).
    """
    if not (fsdp and dist.is_initialized()):
        return load()
    loaded = {}
    run_on_rank0(lambda: loaded.update(model=load()), "loading the starting weights")
    if "model" in loaded:
        return loaded["model"]
    with torch.device("meta"):
        return (CriticModel if critic else MiniMindForCausalLM)(lm_config)


def shard_model(
    model,
    device,
    param_dtype=None,
    reshard_after_forward=True,
    cpu_offload=False,
    from_rank0=True,
):
    """``fully_shard`` every decoder layer of ``model``, then the root, in place; with ``from_rank0`` the weights are
    rank 0's (``load_on_rank0``: the other ranks' modules are on the meta device) and reach the others as shards.

    Args:
        model: a ``MiniMindForCausalLM`` or ``CriticModel`` (fp32 or the reference's dtype), on rank 0 with its
            weights, on the other ranks with them or on the meta device.
        device: this rank's device string.
        param_dtype: None, or the dtype of the gathered weights in forward and backward (``MixedPrecisionPolicy``,
            gradients reduced in fp32; the sharded weights and AdamW's state stay fp32): ``--dtype bfloat16``.
        reshard_after_forward: a decoder layer frees its gathered weights after its forward and gathers them again
            in the backward (True: less memory, one more all-gather per layer and step). The root keeps its gathered
            weights from its forward to its backward (FSDP2's default; the chunked log-probs use the LM head's weight
            after the forward); a frozen model's root, which has no backward to free them, is freed by
            ``gathered_weights(..., frozen=...)`` at the end of the rollout.
        cpu_offload: the shards, their gradients and AdamW's state live in CPU memory (``CPUOffloadPolicy``); the
            optimizer step runs on the CPU. Meant for a GPU, where the process group then needs gloo for the CPU
            tensors beside NCCL (``init_distributed_mode(..., cpu_collectives=True)``); on a CPU device it changes
            nothing but the copies.
        from_rank0: broadcast rank 0's weights and buffers into every rank's shards.
    Returns:
        the same ``model`` object, now an ``FSDPModule``. Not distributed: ``model`` unchanged.
    """
    if not dist.is_initialized():
        return model
    full_state = model.state_dict() if from_rank0 and dist.get_rank() == 0 else {}
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    offload_policy = CPUOffloadPolicy(pin_memory=device.startswith("cuda")) if cpu_offload else OffloadPolicy()
    for layer in model.model.layers:
        fully_shard(
            layer, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload_policy
        )
    fully_shard(model, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload_policy)
    if from_rank0:
        if dist.get_rank() != 0:
            model.to_empty(device="cpu" if cpu_offload else device)  # meta -> memory for this rank's shards
            for buffer in model.buffers():  # buffers live on the device, offloaded shards or not
                buffer.data = buffer.data.to(device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full_state, options=options)
        for buffer in model.buffers():  # rotary tables and the like: not in the state dict, computed on rank 0
            dist.broadcast(buffer.data, src=0)
    del full_state
    # FSDP2 sets up its root (dtypes, the units' order) at the first forward; ``gathered_weights`` may come first
    # (the step-0 evaluation, the first rollout), so set it up now (no collective, no change of the weights)
    model._get_fsdp_state()._lazy_init()
    return model


def shard_roles(args, device, train_dtype, *models):  # train_dtype: resolve_train_dtype's name, e.g. "bfloat16"
    """``--fsdp 1``: each of ``models`` that is not None sharded by ``shard_model`` from rank 0's weights, the trained
    ones (with parameters that require grad) under ``--dtype``'s mixed precision (bf16 gathers, fp32 reduction), the
    frozen reference in its own dtype with ``--dtype``'s autocast, as under DDP. ``--fsdp 0``: ``models`` unchanged.
    Returns the models in their order."""
    if not args.fsdp:
        return models
    sharded = []
    for model in models:
        if model is not None:
            trained = any(p.requires_grad for p in model.parameters())
            half = getattr(torch, train_dtype) if trained and train_dtype != "float32" else None  # --dtype's name
            model = shard_model(model, device, half, bool(args.fsdp_reshard_after_forward), bool(args.fsdp_cpu_offload))
        sharded.append(model)
    return tuple(sharded)


@contextmanager
def gathered_weights(model, reshard_after_forward=True, enabled=True, frozen=()):
    """Every unit of a sharded ``model`` gathered once on entering, resharded on leaving, and no collective in between:
    the rollout's decoding runs a forward per new token and the ranks stop at different steps (their answers end at
    different lengths), so a gather per forward would leave one rank waiting for another that has finished. The
    whole policy exists on every rank for the rollout (its weights only: no gradients, no optimizer state).

    ``reshard_after_forward``: the decoder layers' setting to restore on leaving (``shard_model``'s). ``frozen``: the
    sharded models without a backward used inside (the reference), whose root units keep their gathered weights
    after a forward; leaving frees them too. ``enabled`` False, or models that are not sharded: nothing happens. A
    collective on entering (every rank enters); leaving frees the gathered weights on each rank.
    """
    units = fsdp_units(model) if enabled else []
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit in [unit for other in frozen for unit in fsdp_units(other)]:
            unit.reshard()
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(bool(reshard_after_forward) and unit is not units[-1], recurse=False)


def full_tensor(tensor):
    """The whole tensor of a shard (a collective: every rank calls it), or ``tensor`` itself when it is not one."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_state_dict(model):
    """The whole fp32 state dict of ``model`` on the CPU: for a sharded model gathered on rank 0 (a collective; {}
    on the other ranks), else ``model.state_dict()`` of the unwrapped module on every rank."""
    if not is_sharded(model):
        return unwrap_model(model).state_dict()
    return get_model_state_dict(unwrap_model(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def whole_model(model):
    """A module with the whole weights of ``model`` for what reads them on rank 0 alone (the ``.pth`` and Qwen3
    exports, the SGLang weight sync): a sharded model is gathered (a collective: every rank calls it) into a plain
    module of the same class on rank 0 (its non-persistent buffers left on the meta device: it is for saving, not
    for a forward), None on the other ranks. Any other model: ``model`` itself, on every rank."""
    if not is_sharded(model):
        return model
    state = full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    sharded = unwrap_model(model)
    plain_class = next(c for c in type(sharded).__mro__ if not issubclass(c, FSDPModule))  # the model's own class
    with torch.device("meta"):
        plain = plain_class(sharded.config)
    plain.load_state_dict(state, assign=True)
    return plain


def local_numel(tensors):
    """How many values this rank holds of ``tensors`` (its shard's for a DTensor): what sharding saves, counted."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors if t is not None)


def optimizer_name(model_name):
    """The name under which a run's objects hold the optimizer of model ``model_name`` ("model" -> "optimizer",
    "critic" -> "critic_optimizer")."""
    return "optimizer" if model_name == "model" else f"{model_name}_optimizer"


def sharded_objects(objects):
    """{name: (model, its optimizer or None)} of the sharded models among a run's ``objects`` (name -> model,
    optimizer, ...): what a checkpoint saves with ``torch.distributed.checkpoint``. {} under DDP."""
    return {
        name: (obj, objects.get(optimizer_name(name)))
        for name, obj in objects.items()
        if isinstance(obj, torch.nn.Module) and is_sharded(obj)
    }


def save_sharded(folder, sharded):
    """Write every rank's shards of ``sharded`` (``sharded_objects``) into ``folder`` with
    ``torch.distributed.checkpoint`` (each rank its own files, rank 0 the metadata; a collective). The caller makes
    the folder current only after this returns (a kill in between leaves the previous checkpoint the current one).
    An optimizer that has not stepped yet has no state to save (``get_optimizer_state_dict`` would make one by a
    step at rate 0). Returns {model name: {"grads": names of the gradients saved, "optimizer": whether its state
    was saved}} for ``load_sharded``."""
    states = {}
    for name, (model, optimizer) in sharded.items():
        model = unwrap_model(model)
        states[name] = {"model": get_model_state_dict(model)}
        if optimizer is not None and optimizer.state:
            states[name]["optimizer"] = get_optimizer_state_dict(model, optimizer)
        states[name]["grads"] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    dcp.save(states, checkpoint_id=folder)
    return {
        name: {"grads": sorted(state["grads"]), "optimizer": "optimizer" in state} for name, state in states.items()
    }


def load_sharded(folder, sharded, record):
    """Inverse of ``save_sharded``: every rank reads its shards of weights, AdamW's moments and steps (the groups'
    settings, this run's flags, are kept) and the open window's gradients (``record``: ``save_sharded``'s return).
    A collective."""
    states = {}
    for name, (model, optimizer) in sharded.items():
        model = unwrap_model(model)
        params = dict(model.named_parameters())
        states[name] = {
            "model": get_model_state_dict(model),
            "grads": {n: torch.zeros_like(params[n]) for n in record[name]["grads"]},
        }
        if optimizer is not None and record[name]["optimizer"]:
            states[name]["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(states, checkpoint_id=folder)
    for name, (model, optimizer) in sharded.items():
        model = unwrap_model(model)
        set_model_state_dict(model, states[name]["model"])
        if "optimizer" in states[name]:
            own_settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            set_optimizer_state_dict(model, optimizer, states[name]["optimizer"])
            for group, settings in zip(optimizer.param_groups, own_settings):
                group.update(settings)  # this run's rates and kernel, as load_optimizer_state keeps them
        grads = states[name]["grads"]
        for param_name, param in model.named_parameters():
            param.grad = grads[param_name] if param_name in grads else None
