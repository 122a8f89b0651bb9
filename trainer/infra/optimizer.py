"""The optimizer, its schedule and its step: AdamW with the policy's final-norm group, the cosine learning rate, the
gradient-accumulation window, and ``OptimizerStep``, the one update every RL loop calls after its backward.
"""

import math

import torch

from trainer.infra.distributed import any_rank
from trainer.infra.fsdp import full_tensor
from trainer.infra.lora import base_model
from trainer.infra.stopping import nonfinite_parts


def build_policy_optimizer(model, learning_rate, weight_decay, final_norm_learning_rate, optimizer="adamw"):
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
        optimizer: ``OPTIMIZERS``' name (``adamw``: the moments in fp32; ``adamw_8bit``: in 8 bits).
    Returns:
        the optimizer of ``adamw``; group 0 holds every other parameter, group 1 (when used) the gain.
    Raises:
        ValueError: a negative ``final_norm_learning_rate``, or a model without ``model.norm.weight``.
    """
    if final_norm_learning_rate < 0:
        raise ValueError(f"final_norm_learning_rate must be >= 0, got {final_norm_learning_rate}")
    model = base_model(model)  # a LoRA policy: the MiniMind model that holds the adapters (infra/lora.py)
    if not final_norm_learning_rate:
        return adamw(model.parameters(), optimizer, lr=learning_rate, weight_decay=weight_decay)
    final_norm = getattr(getattr(getattr(model, "model", None), "norm", None), "weight", None)
    if final_norm is None:
        raise ValueError(f"{type(model).__name__} has no model.norm.weight for final_norm_learning_rate")
    others = [p for p in model.parameters() if p is not final_norm]
    return adamw(
        [
            {"params": others, "lr": learning_rate, "weight_decay": weight_decay},
            {"params": [final_norm], "lr": final_norm_learning_rate, "weight_decay": 0.0, "scale_only": True},
        ],
        optimizer,
        lr=learning_rate,
    )


OPTIMIZERS = ("adamw", "adamw_8bit")  # --optimizer


def adamw(params, optimizer="adamw", **kwargs):
    """AdamW (Loshchilov & Hutter 2019) over ``params`` with ``kwargs`` (lr, weight_decay):

      adamw: ``torch.optim.AdamW(fused=True)``, one fused kernel, the same update as torch's default implementation to
        float rounding (tests/test_optimizer.py) in fewer passes over memory (docs/performance.md); its two moments
        take 8 bytes per parameter;
      adamw_8bit: torchao's ``AdamW8bit``, the two moments quantized blockwise to 8 bits (Dettmers et al. 2022,
        "8-bit optimizers via block-wise quantization"): about 2 bytes per parameter, the largest term of a full
        fine-tune's memory cut by 4 (docs/memory.md); tensors under 4,096 values keep fp32 moments. Its step is
        compiled per parameter shape on first use (seconds per shape).

    Raises:
        ValueError: another name. ImportError naming the pip command when torchao is not installed.
    """
    if optimizer == "adamw":
        return torch.optim.AdamW(params, fused=True, **kwargs)
    if optimizer != "adamw_8bit":
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    try:
        from torchao.optim import AdamW8bit
    except ImportError as err:
        raise ImportError(f"--optimizer adamw_8bit needs torchao: pip install torchao==0.18.0 ({err})") from None
    return AdamW8bit(params, **kwargs)


def project_scale_only_gradients(optimizer):
    """For every parameter of a ``scale_only`` group (``build_policy_optimizer``): grad <- (grad . w / w . w) w,
    the gradient of the loss with respect to a common factor c of w = c * w_now, put back along w.

    Call it after the backward (and after DDP has averaged the gradients: the projection is linear and every
    rank holds the same w, so all ranks get the same result) and before clipping and ``optimizer.step()``. Under
    ``--fsdp 1`` w and its gradient are shards: the two dot products are summed over every rank's shard first (a
    collective), and each rank projects its own shard. A parameter without a gradient, or with w = 0, is left alone.
    """
    for group in optimizer.param_groups:
        if not group.get("scale_only"):
            continue
        for param in group["params"]:
            if param.grad is None:
                continue
            weight = param.detach()
            norm_sq = full_tensor((weight * weight).sum())  # fp32 scalar, summed over the shards of a DTensor
            if norm_sq > 0:
                param.grad.copy_(weight * float(full_tensor((param.grad * weight).sum()) / norm_sq))


def cosine_lr(step, total_steps, learning_rate, min_lr_ratio=0.1):
    """Cosine decay from ``learning_rate`` to ``min_lr_ratio * learning_rate`` over ``total_steps`` optimizer steps."""
    progress = min(step / max(total_steps, 1), 1.0)
    return learning_rate * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_cosine_scheduler(optimizer, total_steps, start_step=0, min_lr_ratio=0.1):
    """LambdaLR that follows ``cosine_lr`` over ``total_steps`` optimizer steps, from each group's current rate
    (the flags'), placed at ``start_step``: a resumed run builds its schedule at the update it resumes from, so
    the rates are this run's flags on the saved run's position."""
    for group in optimizer.param_groups:
        group["initial_lr"] = float(group["lr"])  # the peak of this schedule (a tensor lr is filled in place)
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


def scale_gradients(parameters, factor):
    """Multiply every gradient by ``factor`` in place: dapo and vespo divide the window's summed token losses by its
    tokens, known once the window ends (TRL's ``num_items_in_batch`` spans the whole accumulation window)."""
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.mul_(factor)


class OptimizerStep:
    """The one optimizer step of the RL loops: GRPO's and the agent's steps and PPO's minibatches each run
    loss -> backward -> ``clip_and_step``; at the end of each accumulation window of ``accumulation_steps`` steps
    (the last one ends at ``total_steps``) it

      1. (``token_sum``: dapo, vespo) scales the gradients by window / the window's tokens (``begin_step``'s counts);
      2. keeps the final-norm gain's gradient along itself (``project_scale_only_gradients``);
      3. clips each model's gradient norm to ``grad_clip``, each model on its own (PPO: the actor and the critic),
         the norm of the whole model's gradient (under ``--fsdp 1`` summed over every rank's shards);
      4. steps every optimizer and scheduler, unless a checked value (rewards, loss) or a gradient norm was NaN or inf
         on any rank, in which case no rank steps (one all_reduce); ``guard`` counts such skips;
      5. zeroes the gradients either way.

    ``models``: the modules whose parameters the optimizers hold (DDP wrappers or not). ``state``: a resumed run's
    progress, whose "window_num_items" is the open window's token count (``state()`` writes it into the resume file).
    """

    def __init__(
        self,
        models,
        optimizers,
        grad_clip,
        device,
        accumulation_steps,
        total_steps,
        schedulers=(),
        guard=None,
        token_sum=False,
        state=None,
    ):
        self.models, self.optimizers, self.schedulers = list(models), list(optimizers), list(schedulers)
        self.grad_clip, self.device, self.guard, self.token_sum = grad_clip, device, guard, token_sum
        self.accumulation_steps, self.total_steps = accumulation_steps, total_steps
        self.window_num_items = (state or {}).get("window_num_items", 0.0)  # the window's tokens / processes
        self.problems = []  # names of what was non-finite since the last optimizer step

    def begin_step(self, step, num_items_in_batch=0.0):
        """Start ``step`` (1-based): count its answer tokens into its window (a new window starts from 0). Returns the
        window's size, the number its losses are divided by (``accumulation_window_size``)."""
        if (step - 1) % self.accumulation_steps == 0:
            self.window_num_items = 0.0
        self.window_num_items += num_items_in_batch
        return accumulation_window_size(step, self.total_steps, self.accumulation_steps)

    def update_due(self, step):
        """True when ``step`` ends its accumulation window."""
        return step % self.accumulation_steps == 0 or step == self.total_steps

    def clip_and_step(self, step, **checked):
        """After a backward of ``step``: note which of ``checked`` (tensors or floats, e.g. rewards=, loss=) are not
        finite; at the window's end apply the update (the class's 1-5). Returns {} inside a window, else
        {"grad_norm": the first model's norm before clipping, "skipped_update": 1.0 or 0.0}."""
        self.problems += nonfinite_parts(**checked)
        if not self.update_due(step):
            return {}
        parameters = [list(model.parameters()) for model in self.models]
        if self.token_sum:  # the window's token sum / its tokens (TRL's num_items_in_batch)
            window = accumulation_window_size(step, self.total_steps, self.accumulation_steps)
            scale_gradients([p for params in parameters for p in params], window / self.window_num_items)
        for optimizer in self.optimizers:
            project_scale_only_gradients(optimizer)  # the final norm gain learns one number (its own group)
        grad_norms = [  # a sharded model's norm is a DTensor over every rank's shards: read it whole
            float(full_tensor(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))) for params in parameters
        ]
        self.problems += nonfinite_parts(gradients=torch.tensor(grad_norms))
        skipped = any_rank(bool(self.problems), self.device)  # a NaN or inf on any rank: no rank updates
        if not skipped:
            for optimizer in self.optimizers:
                optimizer.step()
            for scheduler in self.schedulers:
                scheduler.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.guard is not None:
            self.guard.record(step, skipped, self.problems)  # stops the run after --max_bad_steps in a row
        self.problems = []
        return {"grad_norm": grad_norms[0], "skipped_update": float(skipped)}

    def state(self):
        """What a checkpoint saves of the update: the open window's token count."""
        return {"window_num_items": self.window_num_items}
