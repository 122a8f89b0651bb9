"""The GRPO family after the chapter: the members of TRL 1.16's ``GRPOTrainer`` beyond 8.5.2's CISPO and clipped GRPO.

A member departs from the chapter's two in three places only: the ratio (per token, or one per answer: GSPO), how it
is bounded (clip-higher, two-sided clip, SAPO's soft gate, VESPO's gamma weight) and how the token losses are summed
(BNPO, DAPO, Dr. GRPO, LUSPO). ``train_grpo.py`` calls ``family_loss`` for every member except the chapter's two at
token level. Names are TRL's; every loss, gradient and logged fraction equals TRL's (tests/test_grpo_family.py), with
the departures listed in docs/grpo_family.md.

After the members, TRL's correction of rollouts an SGLang server sampled (``--rollout_correction``: the weight
pi_trainer / pi_server per token or per answer, truncated or masked at a cap; TRL 1.16's
``vllm_importance_sampling_*``, verl's TIS / MIS), which PPO and the agent script take too: docs/sglang.md.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from trainer.advantage_estimators import token_advantages
from trainer.infra.flags import ROLLOUT_CORRECTIONS, add_bool_flag
from trainer.trainer_utils import k3_kl

LOSS_TYPES = ("cispo", "grpo", "bnpo", "dr_grpo", "dapo", "sapo", "luspo", "vespo")  # TRL's GRPOConfig.loss_type
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped surrogate, with their own sums
TOKEN_SUM_LOSS_TYPES = ("dapo", "vespo")  # a token sum over the accumulation window's tokens of every process
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
DEFAULT_CISPO_EPSILON_HIGH = 5.0  # upstream MiniMind's --epsilon_high: CISPO's clamp of the ratio weight
# the flags each member reads besides --loss_type and --beta (a member refuses a flag it would ignore)
MEMBER_FLAGS = {
    "cispo": ("epsilon_high", "importance_sampling_level"),
    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg", "importance_sampling_level"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
    **{member: ("epsilon", "epsilon_high", "delta", "importance_sampling_level") for member in CLIPPED_LOSS_TYPES},
}
FAMILY_DEFAULTS = {
    "epsilon": 0.2,
    "importance_sampling_level": "token",
    "delta": None,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,  # TRL's defaults
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
}


@dataclass(frozen=True)
class LossConfig:
    """The policy loss's config, built once from the flags (``build_loss_config``); TRL's names and defaults."""

    loss_type: str = "cispo"
    beta: float = 0.1  # weight of the k3 KL to the reference
    epsilon: float = 0.2  # clipped family: ratio >= 1 - epsilon
    epsilon_high: float = DEFAULT_CISPO_EPSILON_HIGH  # cispo: the clamp; clipped family: ratio <= 1 + epsilon_high
    importance_sampling_level: str = "token"  # "sequence": one ratio per answer (GSPO)
    delta: Optional[float] = None  # two-sided clip: the unclipped ratio capped at delta
    sapo_temperatures: tuple = (1.0, 1.05)  # SAPO's gate temperature where A > 0, where A <= 0
    vespo_gamma: tuple = (2.0, 3.0, 3.0, 2.0)  # VESPO's (k_pos, lambda_pos, k_neg, lambda_neg)
    max_completion_length: Optional[int] = None  # dr_grpo's constant (--max_gen_len)

    @property
    def is_chapter_loss(self):
        """True for the chapter's two objectives as 8.5.2 writes them (``train_grpo.grpo_loss``)."""
        return self.loss_type in ("cispo", "grpo") and self.importance_sampling_level == "token" and self.delta is None


def add_family_args(parser):
    """The flags of the members after the chapter, TRL's names; unset flags stay None (``build_loss_config``)."""
    add_bool_flag(
        parser,
        "--mask_truncated_completions",
        help="1: answers cut at --max_gen_len (no EOS) are left out of the loss (DAPO)",
    )
    parser.add_argument(
        "--importance_sampling_level",
        default=None,
        choices=IMPORTANCE_SAMPLING_LEVELS,
        help="token: a ratio per token (default, the chapter's); sequence: one per answer (GSPO)",
    )
    parser.add_argument(
        "--delta",
        type=float,
        default=None,
        help="two-sided clip of the clipped family: the unclipped ratio is capped at delta",
    )
    for flag, meaning in (
        ("sapo_temperature_pos", "sapo: gate temperature where A > 0"),
        ("sapo_temperature_neg", "sapo: gate temperature where A <= 0"),
        ("vespo_k_pos", "vespo: the gamma weight's power where A >= 0"),
        ("vespo_lambda_pos", "vespo: the gamma weight's decay where A >= 0"),
        ("vespo_k_neg", "vespo: the gamma weight's power where A < 0"),
        ("vespo_lambda_neg", "vespo: the gamma weight's decay where A < 0"),
    ):
        parser.add_argument(f"--{flag}", type=float, default=None, help=f"{meaning} ({FAMILY_DEFAULTS[flag]})")


def check_family_args(parser, args):
    """``parser.error`` naming the flag when ``build_loss_config`` refuses the flags; a note when --epsilon_high >= 1
    is a clipped member's upper clip (TRL's meaning), not CISPO's clamp."""
    try:
        build_loss_config(args)
    except ValueError as error:
        parser.error(str(error))
    if args.loss_type in CLIPPED_LOSS_TYPES and (args.epsilon_high or 0) >= 1:
        print(
            f"note: --loss_type {args.loss_type} clips the ratio to [1 - epsilon, 1 + {args.epsilon_high}]: "
            f"--epsilon_high is the upper clip here (TRL's meaning), CISPO's clamp only with --loss_type cispo",
            flush=True,
        )


def build_loss_config(args):
    """``LossConfig`` from the parsed flags: unset flags take the member's default (``epsilon_high``: 5.0 for
    cispo, else ``epsilon``).

    Raises:
        ValueError: naming the flag: an unknown --loss_type, a flag the chosen member ignores, a value out of range.
    """
    if args.loss_type not in LOSS_TYPES:
        raise ValueError(f"--loss_type {args.loss_type!r} is unknown; valid: {', '.join(LOSS_TYPES)}")
    for flag in ("epsilon", "epsilon_high", *FAMILY_DEFAULTS):
        if getattr(args, flag) is not None and flag not in MEMBER_FLAGS[args.loss_type]:
            raise ValueError(
                f"--{flag} is not read by --loss_type {args.loss_type} (it reads "
                f"{', '.join('--' + f for f in MEMBER_FLAGS[args.loss_type])}): drop --{flag}"
            )
    value = {
        flag: FAMILY_DEFAULTS[flag] if getattr(args, flag) is None else getattr(args, flag) for flag in FAMILY_DEFAULTS
    }
    epsilon_high = args.epsilon_high
    if epsilon_high is None:
        epsilon_high = DEFAULT_CISPO_EPSILON_HIGH if args.loss_type == "cispo" else value["epsilon"]
    if args.loss_type == "cispo" and epsilon_high <= 1:
        raise ValueError(f"--epsilon_high is CISPO's clamp of the ratio weight and must be > 1, got {epsilon_high}")
    if epsilon_high <= 0 or not 0 < value["epsilon"] < 1:
        raise ValueError(
            f"--epsilon must be in (0, 1) and --epsilon_high > 0, got {value['epsilon']} and {epsilon_high}"
        )
    if value["delta"] is not None and value["delta"] <= 1 + epsilon_high:
        raise ValueError(f"--delta must be > 1 + --epsilon_high ({1 + epsilon_high:g}), got {value['delta']}")
    if min(value["sapo_temperature_pos"], value["sapo_temperature_neg"]) <= 0:
        raise ValueError("--sapo_temperature_pos and --sapo_temperature_neg must be > 0")
    if args.loss_type in TOKEN_SUM_LOSS_TYPES and args.use_moe:
        raise ValueError(
            f"--loss_type {args.loss_type} scales the summed gradient by the window's tokens, which would "
            f"scale the MoE router loss too: use another --loss_type with --use_moe 1"
        )
    return LossConfig(
        loss_type=args.loss_type,
        beta=args.beta,
        epsilon=value["epsilon"],
        epsilon_high=epsilon_high,
        importance_sampling_level=value["importance_sampling_level"],
        delta=value["delta"],
        sapo_temperatures=(value["sapo_temperature_pos"], value["sapo_temperature_neg"]),
        vespo_gamma=tuple(value[f"vespo_{name}"] for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")),
        max_completion_length=args.max_gen_len,
    )


# ----------------------------------------------------------------------------- the ratio and its bounds
def importance_ratio(per_token_logps, old_per_token_logps, completion_mask, importance_sampling_level="token"):
    """pi_theta / pi_old per token, exp(logp - old_logp), or per answer (GSPO, Zheng et al. 2025, eq. 7): exp of the
    mean log-ratio over its tokens, repeated over them. The log-ratio is 0 where masked (no exp overflow there).

    per_token_logps (requires grad), old_per_token_logps: fp32 [N, R]; completion_mask: [N, R] 0/1 -> fp32 [N, R].
    Raises ValueError for an unknown ``importance_sampling_level``.
    """
    mask = completion_mask.bool()  # [N, R]
    log_ratio = torch.where(mask, per_token_logps - old_per_token_logps, torch.zeros_like(per_token_logps))
    if importance_sampling_level == "token":
        return torch.exp(log_ratio)  # [N, R]
    if importance_sampling_level == "sequence":
        sequence_log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return torch.exp(sequence_log_ratio).expand_as(per_token_logps)  # [N, R], one value per row
    raise ValueError(
        f"unknown importance_sampling_level {importance_sampling_level!r}; "
        f"valid: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"
    )


@torch.no_grad()
def vespo_gamma_weights(
    per_token_logps, old_per_token_logps, advantages, completion_mask, vespo_gamma, importance_sampling_ratio=None
):
    """VESPO's detached weight phi(w) = exp(lambda) w^k exp(-lambda w) of each answer, w = exp(sum of its log-ratios)
    (log-ratios clamped to [-20, 20], log w to [log 1e-8, 20]); (k, lambda) by the sign of A (A >= 0: the _pos pair).
    ``importance_sampling_ratio`` (the rollout correction's per-token weights [N, R], ``rollout_correction``):
    log w also sums their logs, each clamped to [log 1e-8, 20], so w is pi_theta / pi_server.
    Source: VESPO (2026), TRL's ``get_gamma_weights``. advantages [N, 1] -> fp32 [N, 1], 0 where not finite."""
    k_pos, lambda_pos, k_neg, lambda_neg = vespo_gamma
    log_ratio = torch.clamp(per_token_logps - old_per_token_logps, -20.0, 20.0)  # [N, R]
    sequence_log_ratio = (log_ratio * completion_mask).sum(dim=-1, keepdim=True)  # [N, 1]
    if importance_sampling_ratio is not None:  # log(pi_theta / pi_server) = log(pi_theta / pi_old) + log(w_correction)
        sequence_log_ratio = sequence_log_ratio + torch.clamp(
            torch.log(importance_sampling_ratio), math.log(1e-8), 20.0
        ).sum(dim=-1, keepdim=True)
    log_w = torch.clamp(sequence_log_ratio, math.log(1e-8), 20.0)  # [N, 1]
    k = torch.where(advantages >= 0, k_pos, k_neg)  # [N, 1]
    lam = torch.where(advantages >= 0, lambda_pos, lambda_neg).clamp(min=1e-4)  # [N, 1]
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def policy_objective(
    ratio, per_token_logps, old_per_token_logps, advantages, completion_mask, config, importance_sampling_ratio=None
):
    """The per-token objective J_t each member maximises (TRL 1.16's ``_compute_loss``):
      cispo: sg[min(ratio, eps_high)] A logp (MiniMax-M1 2025, eq. 4);
      clipped family: min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A), the first ratio capped at ``delta`` when
        set (PPO, Schulman et al. 2017, eq. 7; clip-higher: DAPO, Yu et al. 2025, eq. 10; two-sided: INTELLECT-2);
      sapo: sigmoid(tau (ratio - 1)) 4 / tau A, tau by the sign of A (SAPO, Gao et al. 2025, eq. 6);
      vespo: sg[phi(w)] A logp (``vespo_gamma_weights``, which reads the rollout correction's
        ``importance_sampling_ratio`` [N, R] when given).
    ratio [N, R]; per_token_logps, old_per_token_logps [N, R]; advantages [N, 1] (or [N, R]: REINFORCE++) -> fp32
    [N, R].
    """
    loss_type = config.loss_type
    if loss_type == "cispo":
        return torch.clamp(ratio, max=config.epsilon_high).detach() * advantages * per_token_logps
    if loss_type in CLIPPED_LOSS_TYPES:
        clipped_ratio = torch.clamp(ratio, 1 - config.epsilon, 1 + config.epsilon_high)  # [N, R]
        if config.delta is not None:
            ratio = torch.clamp(ratio, max=config.delta)
        return torch.min(ratio * advantages, clipped_ratio * advantages)
    if loss_type == "sapo":
        temperatures = torch.where(advantages > 0, *config.sapo_temperatures)  # [N, 1]
        return torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages
    if loss_type == "vespo":
        phi = vespo_gamma_weights(
            per_token_logps,
            old_per_token_logps,
            advantages,
            completion_mask,
            config.vespo_gamma,
            importance_sampling_ratio,
        )  # [N, 1]
        return phi * advantages * per_token_logps
    raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")


# ----------------------------------------------------------------------------- the sums
def aggregate_loss(per_token_loss, completion_mask, loss_type, max_completion_length=None, num_items_in_batch=None):
    """One loss from the token losses, each member's sum (TRL's); masked entries never enter it:
      cispo, grpo, sapo: each answer's mean, then the mean over answers (the chapter's 8.5.2);
      bnpo: one mean over the batch's answer tokens (Xiao et al. 2025);
      dapo, vespo: the token sum / ``num_items_in_batch`` (DAPO, Yu et al. 2025, eq. 8; default: this batch's tokens);
      dr_grpo: the token sum / (rows x ``max_completion_length``) (Liu et al. 2025, eq. 8);
      luspo: each answer's token sum, then the mean over answers (LUSPO, 2026).
    per_token_loss fp32 [N, R], completion_mask [N, R] 0/1 -> scalar. Raises ValueError for an unknown loss_type.
    """
    mask = completion_mask.bool()  # [N, R]
    per_token_loss = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    if loss_type in ("cispo", "grpo", "sapo"):
        return (per_token_loss.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if loss_type == "luspo":
        return per_token_loss.sum(dim=1).mean()
    if loss_type == "bnpo":
        return per_token_loss.sum() / mask.sum().clamp(min=1)
    if loss_type in TOKEN_SUM_LOSS_TYPES:
        normalizer = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        return per_token_loss.sum() / normalizer.clamp(min=1)
    if loss_type == "dr_grpo":
        return per_token_loss.sum() / (per_token_loss.size(0) * max_completion_length)
    raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")


def family_loss(
    per_token_logps,
    old_per_token_logps,
    ref_per_token_logps,
    advantages,
    completion_mask,
    config,
    num_items_in_batch=None,
    importance_sampling_ratio=None,
):
    """Policy loss of any member with beta x k3 KL (8.5.2, 8.6): -(``policy_objective`` - beta k3), then
    ``aggregate_loss``. Equals TRL 1.16's ``_compute_loss`` (``use_bias_correction_kl=False``; cispo on answers of
    equal length: TRL sums cispo's tokens like dapo's).

    fp32 [N, R] log-probs (``ref_per_token_logps`` None when beta is 0), advantages fp32 [N] (or [N, R]: a token-level
    estimator, ``advantage_estimators.py``), completion_mask [N, R].
    ``importance_sampling_ratio``: the rollout correction's weights, fp32 [N, R] or [N, 1] (``rollout_correction``),
    multiplying the objective (not the KL) as TRL does; vespo reads them inside its gamma weight instead.
    Returns (policy_loss scalar, per_token_kl [N, R] detached, ratio [N, R] detached).
    """
    mask = completion_mask.bool()  # [N, R]
    per_token_kl = (
        torch.zeros_like(per_token_logps)
        if ref_per_token_logps is None
        else k3_kl(ref_per_token_logps, per_token_logps, mask)
    )  # [N, R]
    ratio = importance_ratio(per_token_logps, old_per_token_logps, completion_mask, config.importance_sampling_level)
    objective = policy_objective(
        ratio,
        per_token_logps,
        old_per_token_logps,
        token_advantages(advantages),
        completion_mask,
        config,
        importance_sampling_ratio,
    )  # [N, R]
    if importance_sampling_ratio is not None and config.loss_type != "vespo":
        objective = objective * importance_sampling_ratio  # [N, R], the rollout correction
    per_token_loss = -(objective - config.beta * per_token_kl)  # [N, R]
    policy_loss = aggregate_loss(
        per_token_loss, completion_mask, config.loss_type, config.max_completion_length, num_items_in_batch
    )
    return policy_loss, per_token_kl.detach(), ratio.detach()


# ----------------------------------------------------------------------------- what TRL logs, over every process
def global_masked_mean(values, completion_mask, per_sequence=False):
    """TRL's ``global_masked_mean``: sum over every process's answer tokens / their count (a token-weighted mean); with
    ``per_sequence`` one value per row (``values[:, 0]``), every row counted. values, mask [N, R] -> float."""
    if per_sequence:
        total, count = values[:, 0].double().sum(), float(values.size(0))
    else:
        total, count = (values * completion_mask).sum(), completion_mask.sum()
    if dist.is_initialized():
        totals = torch.stack(
            [
                torch.as_tensor(total, dtype=torch.float64, device=values.device),
                torch.as_tensor(count, dtype=torch.float64, device=values.device),
            ]
        )
        dist.all_reduce(totals)
        total, count = totals[0], totals[1]
    return float(torch.as_tensor(total) / torch.as_tensor(count).clamp(min=1))


def global_extremes(values, completion_mask):
    """(min, max) of ``values`` over every process's answer tokens, (1.0, 1.0) when there are none. [N, R] -> floats."""
    real = completion_mask.bool()
    low = values[real].min() if real.any() else torch.tensor(math.inf, device=values.device)
    high = values[real].max() if real.any() else torch.tensor(-math.inf, device=values.device)
    extremes = torch.stack([low.double(), -high.double()])  # min of both
    if dist.is_initialized():
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
    low, high = float(extremes[0]), -float(extremes[1])
    return (low, high) if math.isfinite(low) else (1.0, 1.0)


def clip_fractions(ratio, advantages, completion_mask, config):
    """The share of answer tokens (of answers at the sequence level) whose objective the bound acts on, as TRL logs
    it over every process: ``clip_ratio/low_mean`` (ratio < 1 - eps, A < 0), ``clip_ratio/high_mean``
    (ratio > 1 + eps_high, A > 0) and ``clip_ratio/region_mean`` for the clipped family; ``cispo_clip_ratio``
    (ratio > eps_high, A > 0) for cispo; none for sapo and vespo. ratio fp32 [N, R], advantages [N] or [N, R] ->
    dict."""
    advantages = token_advantages(advantages)  # [N, 1], or [N, R] for a token-level estimator
    per_sequence = config.importance_sampling_level == "sequence"
    if per_sequence and advantages.size(1) > 1:  # one ratio per answer: the sign of its mean token advantage
        mask = completion_mask.to(advantages.dtype)
        advantages = (advantages * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    if config.loss_type == "cispo":
        clipped = ((ratio > config.epsilon_high) & (advantages > 0)).float()  # [N, R]
        return {"cispo_clip_ratio": global_masked_mean(clipped, completion_mask, per_sequence)}
    if config.loss_type not in CLIPPED_LOSS_TYPES:
        return {}
    low = ((ratio < 1 - config.epsilon) & (advantages < 0)).float()  # [N, R]
    high = ((ratio > 1 + config.epsilon_high) & (advantages > 0)).float()  # [N, R]
    return {
        "clip_ratio/low_mean": global_masked_mean(low, completion_mask, per_sequence),
        "clip_ratio/high_mean": global_masked_mean(high, completion_mask, per_sequence),
        "clip_ratio/region_mean": global_masked_mean(low + high, completion_mask, per_sequence),
    }


def update_metrics(per_token_logps, old_per_token_logps, per_token_kl, ratio, entropies, rollout_batch, loss_config):
    """What one update logs, over every process (TRL's names where TRL logs the same): ``kl_ref`` (with a reference),
    ``ratio_mean``, ``entropy``, ``approx_kl`` to the sampler (0.5 E[log ratio^2], 0 at the first update),
    ``ratio_min`` / ``ratio_max`` and the clip fractions. Tensors [B*G, R] detached; rollout_batch: GRPORolloutBatch."""
    completion_mask = rollout_batch.completion_mask  # [B*G, R]
    log_ratio = (per_token_logps - old_per_token_logps) * completion_mask  # [B*G, R]
    metrics = (
        {}
        if rollout_batch.ref_per_token_logps is None
        else {"kl_ref": global_masked_mean(per_token_kl, completion_mask)}
    )
    ratio_min, ratio_max = global_extremes(ratio, completion_mask)
    metrics.update(
        ratio_mean=global_masked_mean(ratio, completion_mask),
        entropy=global_masked_mean(entropies, completion_mask),
        approx_kl=0.5 * global_masked_mean(log_ratio**2, completion_mask),
        ratio_min=ratio_min,
        ratio_max=ratio_max,
        **clip_fractions(ratio, rollout_batch.advantages, completion_mask, loss_config),
    )
    return metrics


def frac_reward_zero_std(rewards, num_generations):
    """Share of the groups whose G rewards are all equal (TRL's ``frac_reward_zero_std``): their advantages are 0
    and they teach nothing (DAPO's dynamic sampling drops them). rewards fp32 [B*G] -> float."""
    grouped_rewards = rewards.double().view(-1, num_generations)  # [B, G]
    return (grouped_rewards.std(dim=1, unbiased=False) == 0).double().mean().item()


# ----------------------------------------------------------------------------- the rollout correction
# The server samples the answers from pi_server (its kernels, often bf16); the loss treats them as drawn from pi_old.
# With a correction the old log-probs are the trainer's (TRL's construction) and the server's enter only the weight
# pi_old / pi_server multiplying each token's policy loss (Yao et al. 2025, "Your efficient RL framework secretly
# brings you off-policy RL training").
def rollout_correction(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, cap):
    """``--rollout_correction``'s (importance_sampling_ratio, metrics) of one rollout: ``rollout_correction_weights``
    and ``rollout_mismatch_metrics``; (None, {}) for "none". Tensors fp32 [N, R], mask [N, R] 0/1."""
    if mode == "none":
        return None, {}
    return (
        rollout_correction_weights(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, cap),
        rollout_mismatch_metrics(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, cap),
    )


def rollout_correction_weights(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, cap):
    """The importance weight of the trainer's policy against the server's (TRL 1.16's
    ``vllm_importance_sampling_ratio``):
      token_*:    w_t = exp(logp_old_t - logp_server_t), one per token;
      sequence_*: w = exp(sum over the answer's tokens of (logp_old_t - logp_server_t)), one per answer;
      *_truncate: min(w, cap) (TIS); *_mask: w where w <= cap, else 0 (MIS).
    The log difference is 0 on masked tokens and where the server gave no log-prob (NaN), so there w_t is 1.

    old_per_token_logps (the trainer's), sampling_per_token_logps (the server's): fp32 [N, R]; completion_mask [N, R]
    0/1. Returns fp32 [N, R] (token modes) or [N, 1] (sequence modes), detached; None for "none". Raises
    ValueError for an unknown mode.
    """
    if mode == "none":
        return None
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; valid: {', '.join(ROLLOUT_CORRECTIONS)}")
    mask = completion_mask.to(old_per_token_logps.dtype)  # [N, R]
    per_token_logps_diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)  # [N, 1]
    else:
        logps_diff = per_token_logps_diff  # [N, R]
    importance_sampling_ratio = torch.exp(logps_diff)  # [N, R] or [N, 1]
    if mode.endswith("truncate"):
        return torch.clamp(importance_sampling_ratio, max=cap).detach()
    return importance_sampling_ratio.masked_fill(importance_sampling_ratio > cap, 0.0).detach()


@torch.no_grad()
def rollout_mismatch_metrics(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, cap):
    """What the mismatch of one rollout looks like, over every process, on the answer tokens (answers in sequence
    modes):
      ``sampling/sampling_logp_difference/mean|max``: |logp_old - logp_server| (TRL's names);
      ``sampling/importance_sampling_ratio/min|mean|max``: the weights as the loss uses them (TRL's names);
      ``sampling/kl_server_trainer``: k3 estimate of KL(pi_server || pi_trainer) per token, on the server's samples;
      ``sampling/corrected_share``: the share of weights above the cap, so truncated or masked (0 with "none").
    Tensors as ``rollout_correction_weights``; mode "none" gives the first three only. -> dict of floats."""
    mask = completion_mask.to(old_per_token_logps.dtype)  # [N, R]
    delta = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps).abs(), nan=0.0)  # [N, R]
    known = mask * (~torch.isnan(sampling_per_token_logps)).to(mask.dtype)  # [N, R], tokens the server scored
    sampling = torch.where(known.bool(), sampling_per_token_logps, old_per_token_logps)  # [N, R], no NaN
    metrics = {
        "sampling/sampling_logp_difference/mean": global_masked_mean(delta, known),
        "sampling/sampling_logp_difference/max": global_extremes(delta, known)[1],
        "sampling/kl_server_trainer": global_masked_mean(k3_kl(old_per_token_logps, sampling, known), known),
    }
    if mode == "none":
        return metrics
    weights = rollout_correction_weights(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, cap)
    raw = rollout_correction_weights(
        old_per_token_logps, sampling_per_token_logps, completion_mask, mode.split("_")[0] + "_truncate", math.inf
    )  # the weights before the cap
    if mode.startswith("sequence"):
        per_row = torch.ones_like(mask)  # every answer counted once, its weight in column 0
        weights, raw = weights.expand_as(mask), raw.expand_as(mask)
        low, high = global_extremes(weights[:, :1], per_row[:, :1])
        metrics.update(
            {
                "sampling/importance_sampling_ratio/min": low,
                "sampling/importance_sampling_ratio/mean": global_masked_mean(weights, per_row, True),
                "sampling/importance_sampling_ratio/max": high,
                "sampling/corrected_share": global_masked_mean((raw > cap).to(mask.dtype), per_row, True),
            }
        )
        return metrics
    low, high = global_extremes(weights, mask)
    metrics.update(
        {
            "sampling/importance_sampling_ratio/min": low,
            "sampling/importance_sampling_ratio/mean": global_masked_mean(weights, mask),
            "sampling/importance_sampling_ratio/max": high,
            "sampling/corrected_share": global_masked_mean((raw > cap).to(mask.dtype), mask),
        }
    )
    return metrics
