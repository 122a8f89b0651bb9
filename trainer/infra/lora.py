"""LoRA RL with peft: ``--lora_rank R`` trains low-rank adapters on the policy's projections, and the reference
policy is the same model with its adapters switched off, so no second copy of the weights is built (TRL's
``GRPOTrainer`` with a ``peft_config`` does the same). The final RMSNorm gain trains beside the adapters (peft's
``modules_to_save``): the default runs' output sharpness lives there (``build_policy_optimizer``), and under
``disable_adapter()`` peft serves the base model's gain, so the reference stays the start. PPO's critic gets adapters
of its own on its own frozen backbone, with the value head trained in full. docs/lora.md.
"""

import contextlib
import os
import warnings

import torch

from trainer.infra.files import weight_path

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # every projection
FINAL_NORM = "model.norm"  # the final RMSNorm, trained beside the adapters (modules_to_save)
VALUE_HEAD = "value_head"  # PPO's critic head, trained in full beside the critic's adapters
ADAPTER_FOLDER_SUFFIX = "_lora"  # {save_dir}/{name}_{hidden}_lora/: the adapters in peft's format, beside the .pth


def add_lora_args(parser):
    """``--lora_rank`` (0 = full fine-tuning, the default), ``--lora_alpha``, ``--lora_dropout``,
    ``--lora_target_modules`` (peft's ``LoraConfig`` names)."""
    parser.add_argument(
        "--lora_rank",
        type=int,
        default=0,
        help="LoRA rank R of the policy's adapters (0: train every weight; docs/lora.md)",
    )
    parser.add_argument(
        "--lora_alpha", type=float, default=None, help="LoRA scale alpha: the update is (alpha / R) B A (default 2 R)"
    )
    parser.add_argument("--lora_dropout", type=float, default=0.0, help="dropout on the adapters' input")
    parser.add_argument(
        "--lora_target_modules",
        default=",".join(LORA_TARGETS),
        help="comma-separated projection names that get adapters (default: every attention and MLP projection)",
    )


def check_lora_args(parser, args):
    """argparse-style errors (exit 2) for the LoRA flags, before any model is built; fills ``--lora_alpha``'s
    default and turns ``--lora_target_modules`` into a tuple."""
    if args.lora_rank < 0 or args.lora_rank > args.hidden_size:
        parser.error(f"--lora_rank must be in [0, --hidden_size {args.hidden_size}] (0 = off), got {args.lora_rank}")
    targets = tuple(name.strip() for name in args.lora_target_modules.split(",") if name.strip())
    unknown = [name for name in targets if name not in LORA_TARGETS]
    if args.lora_rank and (unknown or not targets):
        parser.error(
            f"--lora_target_modules {args.lora_target_modules!r}: {', '.join(unknown) or 'nothing'} matches "
            f"no projection of the model; valid: {', '.join(LORA_TARGETS)}"
        )
    args.lora_target_modules = targets
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_rank
    if args.lora_rank and args.lora_alpha <= 0:
        parser.error(f"--lora_alpha must be > 0, got {args.lora_alpha}")
    if not 0 <= args.lora_dropout < 1:
        parser.error(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lora_rank and args.use_moe:
        parser.error("--lora_rank is for dense models (--use_moe 0): the experts' projections have other names")


def add_adapters(model, rank, alpha, dropout, target_modules, trained_in_full=(FINAL_NORM,), base_path=None):
    """``model`` with peft LoRA adapters (``peft.get_peft_model``): B initialised to 0, so the first forward equals
    the base model's; only the adapters and the modules of ``trained_in_full`` (peft's ``modules_to_save``: the
    final norm's gain, and the critic's value head) require grad. ``base_path``: the start weights' file, recorded
    as ``base_model_name_or_path`` in the adapter folder's adapter_config.json. Returns the ``PeftModel``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        modules_to_save=list(trained_in_full),
        bias="none",
    )
    model.name_or_path = base_path  # what get_peft_model records as base_model_name_or_path
    with peft_quiet():
        return get_peft_model(model, config)


def start_weight_path(args):
    """The file ``--from_weight`` resolves to (``weights.weight_path``), the folder itself for a model folder (one
    holding config.json), or None for ``--from_weight none``."""
    if args.from_weight == "none":
        return None
    if os.path.isfile(os.path.join(args.from_weight, "config.json")):
        return os.path.abspath(args.from_weight)
    return os.path.abspath(weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe))


def with_adapters(model, ref_model, args, reference=True):
    """The policy and the reference of an RL run (chapter 8.1) under ``--lora_rank``: (``model``, ``ref_model``) as
    they are when it is 0; else (the policy with adapters, ``add_adapters``; the reference as ``AdaptersOff`` of it,
    or None when ``reference`` is False, e.g. ``--beta 0``), where the caller made no reference copy."""
    if not args.lora_rank:
        return model, ref_model
    policy = add_adapters(
        model,
        args.lora_rank,
        args.lora_alpha,
        args.lora_dropout,
        args.lora_target_modules,
        base_path=start_weight_path(args),
    )
    return policy, (AdaptersOff(policy) if reference else None)


def critic_with_adapters(critic, args):
    """PPO's critic (chapter 8.4.1) under ``--lora_rank``: adapters of the policy's rank, alpha and projections on
    the critic's own backbone (initialised from the start weights, then frozen), and the value head and final norm
    trained in full. Without it the critic keeps gradients and two AdamW moments for every weight, three times its
    weights' memory (docs/lora.md, the memory table). ``critic`` itself when ``--lora_rank`` is 0."""
    if not args.lora_rank:
        return critic
    return add_adapters(
        critic,
        args.lora_rank,
        args.lora_alpha,
        args.lora_dropout,
        args.lora_target_modules,
        trained_in_full=(FINAL_NORM, VALUE_HEAD),
        base_path=start_weight_path(args),
    )


def has_adapters(model):
    """Whether ``model`` (not a DDP wrapper) is a peft model with adapters."""
    return hasattr(model, "get_base_model")


def base_model(model):
    """The MiniMind causal LM inside a ``PeftModel`` (its weights carry the adapters), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class AdaptersOff(torch.nn.Module):
    """The reference policy of a LoRA run (chapter 8.1, 8.6): a forward of ``model`` under ``disable_adapter()``,
    the base weights and the base final norm. Holds no weights of its own; ``forward`` takes the model's arguments."""

    def __init__(self, model):
        super().__init__()
        self.policy = [model]  # a list: not registered as a submodule, so no parameter is counted twice

    def forward(self, *args, **kwargs):
        model = self.policy[0]
        with model.disable_adapter(), torch.no_grad():
            return model(*args, **kwargs)

    def __getattr__(self, name):
        if name in ("policy", "training") or name.startswith("_"):
            return super().__getattr__(name)
        return getattr(base_model(self.policy[0]), name)


def adapter_folder(weight_file):
    """Where the adapters of the weights ``{name}_{hidden}[_moe].pth`` go: ``{name}_{hidden}[_moe]_lora/``."""
    return os.path.splitext(weight_file)[0] + ADAPTER_FOLDER_SUFFIX


def save_adapters(model, folder):
    """Write a LoRA model's adapters in peft's format into ``folder``: adapter_config.json (rank, alpha, targets,
    the start weights' file as ``base_model_name_or_path``) and adapter_model.safetensors (the A and B matrices and
    the modules trained in full), the files ``PeftModel.from_pretrained`` and ``scripts/convert_model.py merge_lora``
    read. Raises what peft's ``save_pretrained`` raises (OSError for the folder)."""
    with peft_quiet():
        model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)  # never adapted


@contextlib.contextmanager
def peft_quiet():
    """A context without transformers' FutureWarning about ``is_gradient_checkpointing``, a name peft reads."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


@torch.no_grad()
def merged_state_dict(model):
    """The state dict of a MiniMind model with the adapters merged in, W + (alpha / R) B A, and the trained final
    norm's gain: MiniMind's own keys, loadable by ``MiniMindForCausalLM`` and upstream's format. A model without
    adapters gives its own state dict."""
    if not hasattr(model, "get_base_model"):
        return model.state_dict()
    merged = {}
    for name, module in base_model(model).named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):  # a LoRA-wrapped projection
            merged[f"{name}.weight"] = module.base_layer.weight + module.get_delta_weight("default")
        elif hasattr(module, "modules_to_save"):  # the trained copy of the final norm
            for key, value in module.modules_to_save["default"].state_dict().items():
                merged[f"{name}.{key}"] = value
    for key, value in base_model(model).state_dict().items():
        plain = key.replace(".base_layer.", ".").replace(".original_module.", ".")
        if "lora_" in key or ".modules_to_save." in key or plain in merged:
            continue
        merged[plain] = value
    return merged
