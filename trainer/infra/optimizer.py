"""The optimizer and its schedule: AdamW with the policy's final-norm group, the cosine learning rate, and the
gradient-accumulation window. The update itself (clip, step, zero_grad) is written out in each training loop.
"""
import math

import torch

from trainer.infra.lora import base_model


def build_policy_optimizer(model, learning_rate, weight_decay, final_norm_learning_rate):
    """AdamW for an RL policy, with the final RMSNorm gain in a parameter group of its own that learns one number,
    the sharpness of the output distribution (an output temperature: the gain multiplies every logit, since the
    LM head is tied to the embeddings and has no bias).

    With ``final_norm_learning_rate`` > 0 the gain (``model.model.norm.weight``) gets that rate, no weight decay,
    and the group flag ``scale_only``, so that ``project_scale_only_gradients`` scales it as a whole; 0 keeps one
    plain AdamW group at ``learning_rate`` (the chapter's optimizer). Why the gain needs its own rate, measured:
    docs/results.md. Both groups follow the same schedule (``build_cosine_scheduler``).

    Args:
        model: a MiniMind causal LM, with LoRA adapters or not (not the DDP wrapper: its parameters are the same
            objects); only the parameters that require grad get AdamW state.
        learning_rate, weight_decay: of every other parameter.
        final_norm_learning_rate: float >= 0.
    Returns:
        torch.optim.AdamW (``adamw``); group 0 holds every other parameter, group 1 (when used) the gain.
    Raises:
        ValueError: a negative ``final_norm_learning_rate``, or a model without ``model.norm.weight``.
    """
    if final_norm_learning_rate < 0:
        raise ValueError(f"final_norm_learning_rate must be >= 0, got {final_norm_learning_rate}")
    model = base_model(model)  # a LoRA policy: the MiniMind model that holds the adapters (infra/lora.py)
    if not final_norm_learning_rate:
        return adamw(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
    final_norm = getattr(getattr(getattr(model, "model", None), "norm", None), "weight", None)
    if final_norm is None:
        raise ValueError(f"{type(model).__name__} has no model.norm.weight for final_norm_learning_rate")
    others = [p for p in model.parameters() if p is not final_norm]
    return adamw([{"params": others, "lr": learning_rate, "weight_decay": weight_decay},
                  {"params": [final_norm], "lr": final_norm_learning_rate, "weight_decay": 0.0, "scale_only": True}],
                 lr=learning_rate)


def adamw(params, **kwargs):
    """``torch.optim.AdamW(params, fused=True, **kwargs)``: AdamW (Loshchilov & Hutter 2019) in one fused kernel,
    the same update as torch's default implementation to float rounding (tests/test_optimizer.py) in fewer passes
    over memory (docs/performance.md). Raises what ``torch.optim.AdamW`` raises."""
    return torch.optim.AdamW(params, fused=True, **kwargs)


def project_scale_only_gradients(optimizer):
    """For every parameter of a ``scale_only`` group (``build_policy_optimizer``): grad <- (grad . w / w . w) w,
    the gradient of the loss with respect to a common factor c of w = c * w_now, put back along w.

    Call it after the backward (and after DDP has averaged the gradients: the projection is linear and every
    rank holds the same w, so all ranks get the same result) and before clipping and ``optimizer.step()``.
    A parameter without a gradient, or with w = 0, is left alone.
    """
    for group in optimizer.param_groups:
        if not group.get("scale_only"):
            continue
        for param in group["params"]:
            if param.grad is None:
                continue
            weight = param.detach()
            norm_sq = (weight * weight).sum()
            if norm_sq > 0:
                param.grad.copy_((param.grad * weight).sum() / norm_sq * weight)


def cosine_lr(step, total_steps, learning_rate, min_lr_ratio=0.1):
    """Cosine decay from ``learning_rate`` to ``min_lr_ratio * learning_rate`` over ``total_steps`` optimizer steps."""
    progress = min(step / max(total_steps, 1), 1.0)
    return learning_rate * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_cosine_scheduler(optimizer, total_steps, start_step=0, min_lr_ratio=0.1):
    """LambdaLR that follows ``cosine_lr`` over ``total_steps`` optimizer steps, from each group's current rate
    (the flags'), placed at ``start_step``: a resumed run builds its schedule at the update it resumes from, so
    the rates are this run's flags on the saved run's position."""
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]  # the peak of this schedule
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_lr(step, total_steps, 1.0, min_lr_ratio), last_epoch=start_step - 1
    )


def accumulation_window_size(step, total_steps, accumulation_steps):
    """How many backward passes the optimizer step that ``step`` (1-based) belongs to accumulates.

    Windows are steps 1..k, k+1..2k, ... (k = ``accumulation_steps``); the last one ends at ``total_steps`` and
    may be shorter. Each loss is divided by its window's size, so that every optimizer step applies the mean
    gradient of its window (the fix transformers PR #39659 and TRL PR #3493 made for the same mistake).
    Example: total 5, k 2 -> sizes 2, 2, 2, 2, 1.
    """
    window_start = (step - 1) // accumulation_steps * accumulation_steps  # steps before this window
    return min(accumulation_steps, total_steps - window_start)
