"""GRPO for a MiniMind policy (chapter 8.5): rollout -> reward -> group advantage -> CISPO / GRPO loss.

One step (``grpo_step``), in chapter order: the rollout engine samples G answers per prompt and records their old
log-probs (8.2); rewards = rule reward + reward-model score + answer reward (8.3); advantages = (r - group mean) /
(group std + 1e-4) (8.5.1); reference and policy log-probs; the CISPO or clipped loss with beta * k3 KL (8.5.2, 8.6).
``main`` builds what the step uses, in numbered blocks, then runs the loop with the update written out: backward,
clip, AdamW step, cosine schedule (or no step on any rank when a value was NaN), the log line, checkpoints.

Run (the embedded default: tiny MiniMind, bundled arithmetic prompts, CPU):
    python trainer/train_grpo.py
Other examples:
    python trainer/train_grpo.py --loss_type grpo --max_steps 50
    torchrun --nproc_per_node 2 trainer/train_grpo.py --loss_type cispo
    python trainer/train_grpo.py --hidden_size 768 --num_hidden_layers 8 --from_weight full_sft \\
        --data_path dataset/rlaif.jsonl --tokenizer_path model --max_gen_len 1024 --learning_rate 3e-7 \\
        --final_norm_learning_rate 0
"""
import argparse
import copy
import os
import sys
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `python trainer/x.py` from any folder imports this checkout's packages

import torch
from torch.utils.data import DataLoader

from dataset.lm_dataset import (
    RLAIFDataset, ResumableBatchSampler, check_prompt_count, count_total_steps, resumable_batches,
)
from model.model_minimind import KVCache
from trainer.infra.checkpoints import claim_save_dir, resume_command, save_checkpoint, start_or_resume
from trainer.infra.distributed import (
    Logger, all_ranks_mean, any_rank, compile_for_training, init_distributed_mode, mean_over_ranks,
    rank_and_world_size, setup_seed, shutdown_distributed, unwrap_model, wrap_ddp,
)
from trainer.infra.dtypes import autocast_context, resolve_train_dtype, reward_model_dtype
from trainer.infra.evaluation import build_evaluator, evaluate_if_due
from trainer.infra.flags import add_bool_flag, add_common_rl_args, check_common_rl_args, rollout_engine_kwargs
from trainer.infra.metrics import StepLog, gpu_memory_metrics, open_metrics, print_samples
from trainer.infra.optimizer import (
    accumulation_window_size, build_cosine_scheduler, build_policy_optimizer, project_scale_only_gradients,
)
from trainer.rollout_engine import (
    PolicyForward, RolloutResult, create_rollout_engine, policy_forward, selective_log_softmax, token_entropies,
    tokenize_prompts,
)
from trainer.infra.stopping import BadStepGuard, StopSignal, nonfinite_parts
from trainer.trainer_utils import calculate_rewards, k3_kl, load_reward_model, masked_mean
from trainer.infra.weights import build_config, load_policy, load_tokenizer, weight_path

LOSS_TYPES = ("cispo", "grpo", "bnpo", "dr_grpo", "dapo", "sapo")  # TRL's names (GRPOConfig.loss_type)
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # PPO's clipped surrogate, with their own sums
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
DEFAULT_CISPO_EPSILON_HIGH = 5.0  # upstream MiniMind's --epsilon_high: CISPO's clamp of the ratio weight


# ----------------------------------------------------------------------------- the math (chapter 8.5)
def grpo_advantages(rewards, num_generations, eps=1e-4, scale_rewards="group"):
    """Group-relative advantages (chapter 8.5.1; Shao et al. 2024, DeepSeekMath, eq. 3).

    A_i = (r_i - mean(r_group)) / (std + eps), with the biased (population) std of each group (``scale_rewards``
    "group", the chapter's), of the whole batch ("batch", Hu et al. 2025, REINFORCE++), or no division ("none",
    Liu et al. 2025, Dr. GRPO, eq. 8: the std of a group favours easy and hard prompts). TRL's ``scale_rewards``
    has the same three values; TRL divides by the unbiased std, and its batch std spans every process (here: the
    process's own batch).

    Args:
        rewards: fp32 [B*G], each prompt's G rewards adjacent (P0,P0,..,P1,P1,..).
        num_generations: G >= 2.
    Returns:
        advantages [B*G] in the dtype of ``rewards``; a group of equal rewards gives exactly 0, because the
        statistics are computed in fp64 (the mean of G equal fp32 values is then exact, the std 0).
    Raises:
        ValueError: if rewards.numel() is not a multiple of num_generations, or for an unknown ``scale_rewards``.
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {num_generations}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; valid: {', '.join(SCALE_REWARDS)}")
    # fp64 statistics: an fp32 mean of equal values can miss them by one ulp, and ulp / (ulp + eps) is not small
    rewards_fp64 = rewards.double()  # [B*G]
    grouped_rewards = rewards_fp64.view(-1, num_generations)  # [B, G]
    mean_r = grouped_rewards.mean(dim=1).repeat_interleave(num_generations)  # [B*G]
    if scale_rewards == "none":
        return (rewards_fp64 - mean_r).to(rewards.dtype)  # [B*G]
    if scale_rewards == "batch":
        std_r = rewards_fp64.std(unbiased=False).expand_as(rewards_fp64)  # [B*G]
    else:
        std_r = grouped_rewards.std(dim=1, unbiased=False).repeat_interleave(num_generations)  # [B*G]
    return ((rewards_fp64 - mean_r) / (std_r + eps)).to(rewards.dtype)  # [B*G]


def frac_reward_zero_std(rewards, num_generations):
    """Share of the groups whose G rewards are all equal (TRL's ``frac_reward_zero_std``): their advantages are 0,
    so they teach nothing (DAPO, Yu et al. 2025, drops and resamples them). rewards: fp32 [B*G] -> float."""
    grouped_rewards = rewards.double().view(-1, num_generations)  # [B, G]
    return (grouped_rewards.std(dim=1, unbiased=False) == 0).double().mean().item()


def default_epsilon_high(loss_type, epsilon):
    """``epsilon_high`` when none is given: CISPO's clamp 5.0 (upstream MiniMind's) for cispo, else ``epsilon``
    (the symmetric clip of the chapter's grpo)."""
    return DEFAULT_CISPO_EPSILON_HIGH if loss_type == "cispo" else epsilon


def importance_ratio(per_token_logps, old_per_token_logps, completion_mask, importance_sampling_level="token"):
    """The importance ratio pi_theta / pi_old of the policy loss (chapter 8.5.2), per token or per sequence.

    token: ratio = exp(logp - old_logp) per token [N, R] (the chapter's, GRPO, DAPO, CISPO);
    sequence: ratio = exp(mean over the sequence's tokens of (logp - old_logp)) [N, 1], one per answer (Zheng et al.
    2025, GSPO, eq. 7; TRL's ``importance_sampling_level="sequence"``).
    The log-ratio is set to 0 at masked positions before ``exp``: a padded position's exp could overflow and its
    gradient be 0 * inf.

    Args:
        per_token_logps: fp32 [N, R] (requires grad); old_per_token_logps: fp32 [N, R]; completion_mask: [N, R] 0/1.
    Returns:
        (log_ratio fp32 [N, R], 0 where masked; ratio fp32 [N, R] or [N, 1]).
    Raises:
        ValueError: for an unknown ``importance_sampling_level``.
    """
    mask = completion_mask.bool()  # [N, R]
    log_ratio = torch.where(mask, per_token_logps - old_per_token_logps, torch.zeros_like(per_token_logps))
    if importance_sampling_level == "token":
        return log_ratio, torch.exp(log_ratio)  # [N, R]
    if importance_sampling_level == "sequence":
        sequence_log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return log_ratio, torch.exp(sequence_log_ratio)  # [N, 1]
    raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; "
                     f"valid: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")


def policy_objective(ratio, per_token_logps, advantages, loss_type, epsilon, epsilon_high, delta=None,
                     sapo_temperature_pos=1.0, sapo_temperature_neg=1.05):
    """The per-token objective J_t that the policy loss maximises (chapter 8.5.2 and the family after it).

      cispo:  sg[min(ratio, epsilon_high)] * A * logp (MiniMax-M1 report 2025, eq. 4: the clamped ratio is a detached
              weight on logp's gradient; epsilon_high 5.0 by default, upstream MiniMind's);
      grpo, bnpo, dr_grpo, dapo: min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) (PPO's clipped
              surrogate, Schulman et al. 2017, eq. 7; epsilon_high > epsilon is DAPO's "clip-higher", Yu et al. 2025,
              eq. 10), with ``delta``: the unclipped term's ratio capped at delta (two-sided clip, INTELLECT-2 2025);
      sapo:   sigmoid(tau * (ratio - 1)) * 4 / tau * A, tau = ``sapo_temperature_pos`` where A > 0 and
              ``sapo_temperature_neg`` elsewhere (a soft gate instead of a clip; SAPO, Gao et al. 2025, eq. 6).
    These are the expressions of TRL 1.16's ``GRPOTrainer._compute_loss``.

    Args:
        ratio: fp32 [N, R] or [N, 1] (``importance_ratio``); per_token_logps: fp32 [N, R]; advantages: fp32 [N, 1].
    Returns:
        fp32 [N, R] (or [N, 1] for a sequence ratio without logp: grpo family, sapo): broadcast over the tokens.
    Raises:
        ValueError: for an unknown ``loss_type``.
    """
    if loss_type == "cispo":
        clamped_ratio = torch.clamp(ratio, max=epsilon_high).detach()  # [N, R]
        return clamped_ratio * advantages * per_token_logps
    if loss_type in CLIPPED_LOSS_TYPES:
        clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # [N, R]
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)
        per_token_loss1 = ratio * advantages
        per_token_loss2 = clipped_ratio * advantages
        return torch.min(per_token_loss1, per_token_loss2)
    if loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)  # [N, 1]
        return torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages
    raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")


def sequence_mean_loss(per_token_loss, completion_mask):
    """Mean over each sequence's masked tokens, then mean over sequences (chapter 8.5.2).

    per_token_loss: fp32 [N, R]; completion_mask: [N, R] 0/1 -> scalar. Masked entries never enter the
    sum of the loss value (even inf or huge values there are dropped), and an empty row counts as 0.
    """
    mask = completion_mask.bool()
    per_token_loss = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    return masked_mean(per_token_loss, mask, dim=1).mean()


def aggregate_loss(per_token_loss, completion_mask, loss_type, max_completion_length=None, num_items_in_batch=None):
    """Sum the token losses of a batch into one loss (chapter 8.5.2), as each member of the family does (TRL's sums).

      cispo, grpo, sapo: each sequence's mean, then the mean over sequences (``sequence_mean_loss``, the chapter's;
             TRL sums CISPO's tokens over the batch instead, as for dapo: equal on rows of equal length);
      bnpo:  one mean over every answer token of the batch (Xiao et al. 2025, BNPO);
      dapo:  the token sum over ``num_items_in_batch`` (DAPO, Yu et al. 2025, eq. 8, "token-level loss"): TRL passes
             the answer tokens of the whole batch over all processes divided by the number of processes, so that
             the gradient DDP averages is the global token mean; default: this batch's tokens (= bnpo);
      dr_grpo: the token sum over rows x ``max_completion_length`` (Liu et al. 2025, Dr. GRPO, eq. 8: a constant,
             so a long answer's tokens weigh as much as a short one's).
    Masked entries never enter the sum (inf or NaN there are dropped).

    Args:
        per_token_loss: fp32 [N, R]; completion_mask: [N, R] 0/1.
        max_completion_length: the longest answer allowed (``--max_gen_len``), for dr_grpo.
        num_items_in_batch: float, for dapo (see above).
    Returns:
        the loss, a scalar.
    Raises:
        ValueError: an unknown ``loss_type``, or dr_grpo without ``max_completion_length``.
    """
    mask = completion_mask.bool()  # [N, R]
    if loss_type in ("cispo", "grpo", "sapo"):
        return sequence_mean_loss(per_token_loss, completion_mask)
    token_sum = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss)).sum()
    if loss_type == "bnpo":
        return token_sum / mask.sum().clamp(min=1)
    if loss_type == "dapo":
        normalizer = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        return token_sum / normalizer.clamp(min=1)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo divides by rows x max_completion_length: pass max_completion_length")
        return token_sum / (per_token_loss.size(0) * max_completion_length)
    raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")


def grpo_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, completion_mask,
              loss_type="cispo", epsilon=0.2, epsilon_high=None, beta=0.1, importance_sampling_level="token",
              delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, max_completion_length=None,
              num_items_in_batch=None):
    """Policy loss of GRPO and its family, with a k3 KL penalty (chapter 8.5.2, 8.6; TRL's parameter names).

    ratio = ``importance_ratio`` (per token, or per sequence: GSPO), per_token_kl = k3(ref, logp),
    per_token_loss = -(``policy_objective`` - beta * per_token_kl), loss = ``aggregate_loss``. The chapter's two:
      cispo: -(sg[min(ratio, epsilon_high)] * A * logp - beta * per_token_kl), then each sequence's mean;
      grpo:  -(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) - beta * per_token_kl), then each sequence's mean.
    The loss and its gradient equal TRL 1.16's ``GRPOTrainer._compute_loss`` with ``use_bias_correction_kl=False``
    (TRL's default multiplies the KL by the ratio) for every loss type, CISPO on rows of equal length.

    Args:
        per_token_logps: fp32 [N, R], log pi_theta of the completion tokens (requires grad).
        old_per_token_logps: fp32 [N, R], log pi_old from the rollout (no grad).
        ref_per_token_logps: fp32 [N, R], log pi_ref of the frozen reference (no grad), or None when beta is 0.
        advantages: fp32 [N], one per sequence, broadcast over its tokens.
        completion_mask: [N, R] 0/1.
        epsilon, epsilon_high: the clip range [1 - epsilon, 1 + epsilon_high] of the clipped family; None for
            epsilon_high: ``epsilon`` (symmetric, the chapter's grpo), and CISPO's clamp 5.0 (upstream's).
        delta, sapo_temperature_pos, sapo_temperature_neg: see ``policy_objective``;
        max_completion_length, num_items_in_batch: see ``aggregate_loss``.
    Returns:
        (policy_loss scalar, per_token_kl [N, R], ratio [N, R]) -- the last two detached, for logging (a sequence
        ratio is repeated over its tokens).
    Raises:
        ValueError: for an unknown loss_type or importance_sampling_level, or no reference log-probs with beta > 0.
    """
    mask = completion_mask.bool()  # [N, R]
    if epsilon_high is None:
        epsilon_high = default_epsilon_high(loss_type, epsilon)
    if ref_per_token_logps is None:
        if beta:
            raise ValueError(f"beta {beta} needs the reference log-probs (ref_per_token_logps is None)")
        per_token_kl = torch.zeros_like(per_token_logps)  # [N, R]
    else:
        per_token_kl = k3_kl(ref_per_token_logps, per_token_logps, mask)  # [N, R], 0 where masked
    _, ratio = importance_ratio(per_token_logps, old_per_token_logps, completion_mask, importance_sampling_level)
    advantages = advantages.unsqueeze(1)  # [N, 1]
    objective = policy_objective(ratio, per_token_logps, advantages, loss_type, epsilon, epsilon_high, delta,
                                 sapo_temperature_pos, sapo_temperature_neg)
    per_token_loss = -(objective - beta * per_token_kl)  # [N, R]
    policy_loss = aggregate_loss(per_token_loss, completion_mask, loss_type, max_completion_length, num_items_in_batch)
    return policy_loss, per_token_kl.detach(), ratio.detach().expand_as(per_token_logps)


def clip_fractions(ratio, advantages, completion_mask, loss_type, epsilon, epsilon_high):
    """Share of answer tokens whose objective the clip bounds, as TRL logs it: ``clip_ratio/low_mean`` (ratio below
    1 - epsilon where A < 0), ``clip_ratio/high_mean`` (above 1 + epsilon_high where A > 0) and their sum
    ``clip_ratio/region_mean`` for the clipped family; ``cispo_clip_ratio`` (ratio above epsilon_high where A > 0)
    for cispo; {} for sapo (no clip). With one update per rollout the ratio is 1 and every fraction 0.

    ratio: fp32 [N, R] (detached); advantages: fp32 [N]; completion_mask: [N, R] 0/1 -> dict of floats.
    """
    advantages = advantages.unsqueeze(1)  # [N, 1]
    if loss_type == "cispo":
        return {"cispo_clip_ratio": masked_mean(((ratio > epsilon_high) & (advantages > 0)).float(),
                                                completion_mask).item()}
    if loss_type not in CLIPPED_LOSS_TYPES:
        return {}
    low = ((ratio < 1 - epsilon) & (advantages < 0)).float()  # [N, R]
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()  # [N, R]
    return {"clip_ratio/low_mean": masked_mean(low, completion_mask).item(),
            "clip_ratio/high_mean": masked_mean(high, completion_mask).item(),
            "clip_ratio/region_mean": masked_mean(low + high, completion_mask).item()}


# ----------------------------------------------------------------------------- flags
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind GRPO (Group Relative Policy Optimization)")
    add_common_rl_args(parser)
    parser.add_argument("--save_weight", default="grpo", help="name of the saved weights ({name}_{hidden}.pth)")
    parser.add_argument("--num_generations", type=int, default=6, help="G, answers sampled per prompt")
    parser.add_argument("--accumulation_steps", type=int, default=1,
                        help="steps (rollouts) whose gradients make one optimizer step")
    parser.add_argument("--loss_type", default="cispo",
                        help=f"one of {', '.join(LOSS_TYPES)} (TRL's names): the chapter's cispo (default) and grpo, "
                             "then bnpo, dr_grpo, dapo, sapo (docs/grpo_family.md)")
    parser.add_argument("--beta", type=float, default=0.1,
                        help="weight of the k3 KL to the reference (0: no reference model is built, as DAPO, Dr. GRPO)")
    parser.add_argument("--epsilon", type=float, default=0.2, help="lower clip: ratio >= 1 - epsilon (clipped family)")
    parser.add_argument("--epsilon_high", type=float, default=None,
                        help="cispo: the clamp of the ratio weight (default 5.0, upstream MiniMind's); clipped family "
                             "(grpo, bnpo, dr_grpo, dapo): upper clip 1 + epsilon_high (default --epsilon; DAPO 0.28)")
    parser.add_argument("--delta", type=float, default=None,
                        help="two-sided clip of the clipped family: the unclipped ratio is capped at delta (> 1 + eps)")
    parser.add_argument("--importance_sampling_level", default="token", choices=IMPORTANCE_SAMPLING_LEVELS,
                        help="token: a ratio per token (the chapter's); sequence: one per answer, exp of its mean "
                             "log-ratio (GSPO)")
    parser.add_argument("--sapo_temperature_pos", type=float, default=1.0, help="sapo's gate temperature where A > 0")
    parser.add_argument("--sapo_temperature_neg", type=float, default=1.05, help="sapo's gate temperature where A <= 0")
    parser.add_argument("--scale_rewards", default="group", choices=SCALE_REWARDS,
                        help="advantage scale: the group's std (the chapter's), the batch's, or none (Dr. GRPO)")
    parser.add_argument("--num_iterations", type=int, default=1,
                        help="mu: updates on each rollout against its old log-probs (1: the chapter's; from the second "
                             "the ratio leaves 1 and the clip acts)")
    add_bool_flag(parser, "--mask_truncated_completions",
                  help="1: answers cut at --max_gen_len (no EOS) are left out of the loss (DAPO)")
    add_bool_flag(parser, "--shared_prefix", default=None,
                  help="1: the reference and policy forwards run each prompt once for its G answers (same log-probs; "
                       "default for dense models); 0: every answer with its own copy of the prompt, as in the chapter "
                       "(the default with --use_moe 1)")
    args = parser.parse_args(argv)
    check_common_rl_args(parser, args)
    if args.shared_prefix is None:
        args.shared_prefix = 0 if args.use_moe else 1
    elif args.shared_prefix and args.use_moe:
        parser.error("--shared_prefix 1 is for dense models: with --use_moe 1 the router loss of its two forwards "
                     "(prompts, then answers) is not the loss of the full rows; leave --shared_prefix out (or 0)")
    if args.accumulation_steps < 1:
        parser.error(f"--accumulation_steps must be >= 1, got {args.accumulation_steps}")
    if args.num_generations < 2:
        parser.error(f"--num_generations must be >= 2 for group advantages, got {args.num_generations}")
    if args.loss_type not in LOSS_TYPES:
        parser.error(f"--loss_type {args.loss_type!r} is unknown; valid: {', '.join(LOSS_TYPES)}")
    if args.epsilon_high is None:
        args.epsilon_high = default_epsilon_high(args.loss_type, args.epsilon)
    if args.loss_type == "cispo" and args.epsilon_high <= 1:
        parser.error(f"--epsilon_high is CISPO's clamp of the ratio weight and must be > 1, got {args.epsilon_high}")
    if args.epsilon_high <= 0 or not 0 < args.epsilon < 1:
        parser.error(f"--epsilon must be in (0, 1) and --epsilon_high > 0, got {args.epsilon} and {args.epsilon_high}")
    if args.loss_type in CLIPPED_LOSS_TYPES and args.epsilon_high >= 1:
        print(f"note: --loss_type {args.loss_type} clips the ratio to [1 - {args.epsilon}, 1 + {args.epsilon_high}]: "
              f"--epsilon_high is the upper clip here (TRL's meaning; DAPO uses 0.28), CISPO's clamp only with "
              f"--loss_type cispo", flush=True)
    if args.delta is not None and args.delta <= 1 + args.epsilon_high:
        parser.error(f"--delta must be > 1 + --epsilon_high ({1 + args.epsilon_high:g}), got {args.delta}")
    if min(args.sapo_temperature_pos, args.sapo_temperature_neg) <= 0:
        parser.error("--sapo_temperature_pos and --sapo_temperature_neg must be > 0")
    if args.num_iterations < 1:
        parser.error(f"--num_iterations must be >= 1, got {args.num_iterations}")
    if args.num_iterations > 1 and args.accumulation_steps > 1:
        parser.error("--num_iterations > 1 updates once per iteration: use it with --accumulation_steps 1")
    if args.beta < 0:
        parser.error(f"--beta must be >= 0, got {args.beta}")
    return args


# ----------------------------------------------------------------------------- the forwards of a rollout
def rollout_per_token_logps(model, rollout, args):
    """``PolicyForward`` of a rollout's completions under ``model``: log-probs fp32 [B*G, R], the MoE router loss
    and the token entropies (8.2). ``--shared_prefix 1`` runs each prompt once for its G answers
    (``group_policy_forward``), 0 gives every answer its own copy of the prompt; both give the same log-probs
    (tests/test_forward_layouts.py)."""
    if args.shared_prefix:
        num_generations, prompt_len = args.num_generations, rollout.prompt_mask.size(1)
        prompt_ids = rollout.output_ids[::num_generations, :prompt_len]  # [B, P], one row per group
        prompt_mask = rollout.prompt_mask[::num_generations]  # [B, P]
        return group_policy_forward(model, prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask,
                                    num_generations, args.temperature)
    return policy_forward(model, rollout.output_ids, rollout.completion_ids.size(1), rollout.attention_mask,
                          args.temperature)


def group_policy_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, num_generations,
                         temperature=1.0):
    """``policy_forward`` for a rollout's groups, each prompt's forward done once (chapter 8.2, 8.5).

    The G answers of a prompt share its P tokens, and the keys and values of those tokens do not depend on the
    answers (causal attention). So the prompts run once, [B, P], their keys and values are repeated for the G
    answers of each (``KVCache.repeat_interleave``), and the answers run on top, [B*G, R - 1]: the same
    log-probs as the [B*G, P + R] forward, with the prompt tokens computed B times instead of B*G. The
    gradient of the repeated keys and values sums over the G answers, as it does when the rows are separate
    (the "shared-prefix forward" of Prefix Grouper, Liu et al. 2025).

    Args:
        model: a dense MiniMind causal LM (or its DDP wrapper; both forwards go through it). With MoE the
            router loss would differ from the padded batch's (each forward's loss is a mean over its own
            tokens), which is why ``train_grpo.py`` refuses ``--shared_prefix 1 --use_moe 1``.
        prompt_ids, prompt_mask: long [B, P], the left-padded prompts before repetition.
        completion_ids, completion_mask: long [B*G, R], each prompt's G answers adjacent (P0,P0,..,P1,..),
            the mask 1 through the first EOS (``RolloutResult``).
        num_generations: G.
        temperature: as in ``compute_per_token_logps``.
    Returns:
        ``PolicyForward``: per_token_logps fp32 [B*G, R] (entries after a row's EOS finite but meaningless), aux_loss
        (the two forwards' router losses added), entropies fp32 [B*G, R].
    Raises:
        ValueError: if completion_ids does not have B * num_generations rows.
    """
    batch, num_completion_tokens = prompt_ids.size(0), completion_ids.size(1)
    if completion_ids.size(0) != batch * num_generations:
        raise ValueError(f"{completion_ids.size(0)} completions for {batch} prompts x {num_generations} generations")
    if num_completion_tokens == 0:
        return policy_forward(model, completion_ids, 0)
    cache = KVCache(unwrap_model(model).config.num_hidden_layers)
    prompt_out = model(prompt_ids, attention_mask=prompt_mask, past_key_values=cache,
                       logits_to_keep=1)  # logits [B, 1, V]: the prompt's last position predicts answer token 0
    first_logits = prompt_out.logits.repeat_interleave(num_generations, dim=0)  # [B*G, 1, V]
    first_logps = selective_log_softmax(first_logits, completion_ids[:, :1], temperature)  # [B*G, 1]
    first_entropies = token_entropies(first_logits, temperature)  # [B*G, 1]
    aux_loss = prompt_out.aux_loss
    if num_completion_tokens == 1:  # nothing after answer token 0 to predict from
        return PolicyForward(first_logps, aux_loss, first_entropies)
    cache = cache.repeat_interleave(num_generations, extra_capacity=num_completion_tokens - 1)
    repeated_prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # [B*G, P]
    full_mask = torch.cat([repeated_prompt_mask, completion_mask[:, :-1]], dim=1)  # [B*G, P + R - 1]
    completion_out = model(completion_ids[:, :-1], attention_mask=full_mask,
                           past_key_values=cache)  # logits [B*G, R - 1, V]: answer token t predicts t + 1
    rest_logps = selective_log_softmax(completion_out.logits, completion_ids[:, 1:], temperature)  # [B*G, R - 1]
    per_token_logps = torch.cat([first_logps, rest_logps], dim=1)  # [B*G, R]
    entropies = torch.cat([first_entropies, token_entropies(completion_out.logits, temperature)], dim=1)  # [B*G, R]
    return PolicyForward(per_token_logps, aux_loss + completion_out.aux_loss, entropies)


# ----------------------------------------------------------------------------- one step
@dataclass
class GRPORolloutBatch:
    """What ``grpo_rollout`` hands to the updates: one rollout of B prompts x G answers and what the loss needs."""
    rollout: RolloutResult  # output_ids, completion_ids, masks and the old log-probs of the sampler (8.2)
    completion_mask: torch.Tensor  # [B*G, R] 0/1, the tokens of the loss (truncated answers out with
    #                                --mask_truncated_completions 1)
    advantages: torch.Tensor  # [B*G] fp32 (8.5.1)
    ref_per_token_logps: Optional[torch.Tensor]  # [B*G, R] fp32 (8.6), None with --beta 0
    rewards: torch.Tensor  # [B*G] fp32 (8.3)
    reward_parts: dict  # the reward function's parts, each [B*G]
    debug: dict  # "prompts", "completions": B*G strings each, for --debug_mode
    metrics: dict  # the rollout's own: prompts cut, groups of equal rewards, the engine's metrics


@torch.no_grad()
def grpo_rollout(batch, ref_model, rollout_engine, reward_fn, reward_model, tokenizer, args, device, autocast):
    """Steps 1-4 of a GRPO step (chapter 8.1, 8.5): rollout, rewards, group advantages, reference log-probs.

    ``reward_fn`` is ``calculate_rewards`` (chapter 8.3) or a replacement with the same arguments and result;
    ``ref_model`` is None with ``--beta 0`` (then no reference forward runs); ``autocast`` is the forwards' context
    under ``--dtype``. Returns a ``GRPORolloutBatch`` of B*G rows.
    """
    prompts, answers = batch["prompt"], batch["answer"]  # list[str] of length B
    prompt_ids, attention_mask, truncated = tokenize_prompts(tokenizer, prompts, args.max_seq_len, device)

    # 1. rollout: B*G completions and their old log-probs (8.2)
    with autocast:
        rollout = rollout_engine.rollout(prompt_ids, attention_mask, args.num_generations, args.max_gen_len,
                                         args.temperature)
    completion_mask = rollout.completion_mask  # [B*G, R]
    if args.mask_truncated_completions:  # DAPO: an answer cut at --max_gen_len teaches nothing about its end
        ended = (rollout.completion_ids == tokenizer.eos_token_id).any(dim=1, keepdim=True)  # [B*G, 1]
        completion_mask = completion_mask * ended

    # 2. rewards (8.3)
    repeated_prompts = [p for p in prompts for _ in range(args.num_generations)]
    repeated_answers = [a for a in answers for _ in range(args.num_generations)]
    reward_parts = reward_fn(repeated_prompts, rollout.completions, repeated_answers, reward_model,
                             args.answer_reward_weight)
    rewards = reward_parts["rewards"].to(device)  # [B*G]

    # 3. group-relative advantages (8.5.1)
    advantages = grpo_advantages(rewards, args.num_generations, scale_rewards=args.scale_rewards)  # [B*G]

    # 4. reference log-probs (fp32 whatever --dtype is)
    ref_per_token_logps = None
    if ref_model is not None:
        with autocast:
            ref_per_token_logps = rollout_per_token_logps(ref_model, rollout, args).per_token_logps  # [B*G, R]
    return GRPORolloutBatch(
        rollout=rollout, completion_mask=completion_mask, advantages=advantages,
        ref_per_token_logps=ref_per_token_logps, rewards=rewards, reward_parts=reward_parts,
        debug={"prompts": repeated_prompts, "completions": rollout.completions},
        metrics={"truncated_prompts": truncated, **rollout.metrics,
                 "frac_reward_zero_std": frac_reward_zero_std(rewards, args.num_generations)},
    )


def grpo_policy_loss(model, rollout_batch, args, autocast):
    """Step 5 of a GRPO step (chapter 8.5.2, 8.6): the policy's log-probs of the rollout and the loss of
    ``--loss_type`` with the k3 KL penalty; run once per update (``--num_iterations`` times per rollout).

    ``model`` is what the gradient flows through (the DDP wrapper when distributed). Returns (loss to backpropagate,
    metrics of this update); the loop divides the loss by the size of its gradient-accumulation window.
    """
    rollout, completion_mask = rollout_batch.rollout, rollout_batch.completion_mask
    old_per_token_logps = rollout.per_token_logps.detach()  # [B*G, R]
    with autocast:
        per_token_logps, aux_loss, entropies = rollout_per_token_logps(model, rollout, args)  # [B*G, R] each
    policy_loss, per_token_kl, ratio = grpo_loss(
        per_token_logps, old_per_token_logps, rollout_batch.ref_per_token_logps, rollout_batch.advantages,
        completion_mask, args.loss_type, args.epsilon, args.epsilon_high, args.beta, args.importance_sampling_level,
        args.delta, args.sapo_temperature_pos, args.sapo_temperature_neg, args.max_gen_len,
        num_items_in_batch(completion_mask, rollout.output_ids.device) if args.loss_type == "dapo" else None,
    )
    loss = policy_loss + aux_loss  # the loop divides by the size of its accumulation window

    log_ratio = (per_token_logps.detach() - old_per_token_logps) * completion_mask  # [B*G, R], vs the sampler
    real = completion_mask.bool()
    metrics = {} if rollout_batch.ref_per_token_logps is None else {
        "kl_ref": masked_mean(per_token_kl, completion_mask).item()}
    metrics.update(
        policy_loss=policy_loss.item(),
        aux_loss=float(aux_loss),
        ratio_mean=masked_mean(ratio, completion_mask).item(),
        entropy=masked_mean(entropies, completion_mask).item(),
        approx_kl=0.5 * masked_mean(log_ratio ** 2, completion_mask).item(),  # to the sampler, 0 at the first update
        ratio_min=ratio[real].min().item() if real.any() else 1.0,
        ratio_max=ratio[real].max().item() if real.any() else 1.0,
        **clip_fractions(ratio, rollout_batch.advantages, completion_mask, args.loss_type, args.epsilon,
                         args.epsilon_high),
    )
    return loss, metrics


def num_items_in_batch(completion_mask, device):
    """The answer tokens of every process's batch over the number of processes (TRL's normalizer of dapo): with
    DDP averaging gradients, each process's token sum over it makes the global token mean. A collective."""
    tokens = completion_mask.sum().double().to(device)
    return all_ranks_mean(tokens, device)


def grpo_metrics(rollout_batch, updates):
    """The step's metrics: the rollout's rewards and advantages, then the mean over the step's updates of each
    update's metrics (one update per rollout: its own), except ``ratio_min`` / ``ratio_max``: the smallest and largest
    ratio of any update; names as TRL's where TRL logs the same."""
    update_mean = {key: sum(update[key] for update in updates) / len(updates) for key in updates[0]}
    update_mean.update(ratio_min=min(update["ratio_min"] for update in updates),  # the step's spread of the ratio
                       ratio_max=max(update["ratio_max"] for update in updates))
    kl_ref = {"kl_ref": update_mean.pop("kl_ref")} if "kl_ref" in update_mean else {}
    update_keys = ("policy_loss", "aux_loss", "ratio_mean")
    return {
        "reward": rollout_batch.rewards.mean().item(),
        "rule_reward": rollout_batch.reward_parts["rule_rewards"].mean().item(),
        "reward_model_score": rollout_batch.reward_parts["reward_model_scores"].mean().item(),
        "answer_reward": rollout_batch.reward_parts["answer_rewards"].mean().item(),
        **kl_ref,
        "advantages_mean": rollout_batch.advantages.mean().item(),
        "advantages_std": rollout_batch.advantages.std(unbiased=False).item(),
        **{key: update_mean.pop(key) for key in update_keys},
        "response_len": rollout_batch.rollout.completion_mask.sum(dim=1).float().mean().item(),
        **rollout_batch.metrics,
        **update_mean,
    }


def grpo_log_line(metrics, num_iterations=1):
    """GRPO's part of the log line (after the rewards): KL, advantages, loss, entropy, clipping, length, rate.

    With ``num_iterations`` > 1 the ratio leaves 1, and the line also shows its range over the step's updates, the
    approximate KL to the sampler and the clipped share of tokens below and above the clip range."""
    kl_ref = f"kl_ref {metrics['kl_ref']:.4f} | " if "kl_ref" in metrics else ""
    clip = next((f" | clipped {metrics[key]:.3f}" for key in ("clip_ratio/region_mean", "cispo_clip_ratio")
                 if key in metrics), "")
    if num_iterations > 1:
        if "clip_ratio/low_mean" in metrics:
            clip = f" | clipped low {metrics['clip_ratio/low_mean']:.4f} high {metrics['clip_ratio/high_mean']:.4f}"
        elif "cispo_clip_ratio" in metrics:
            clip = f" | clipped {metrics['cispo_clip_ratio']:.4f}"
        clip += f" | ratio {metrics['ratio_min']:.3f}-{metrics['ratio_max']:.3f} | approx_kl {metrics['approx_kl']:.1e}"
    return (f"{kl_ref}adv mean {metrics['advantages_mean']:.3f} std {metrics['advantages_std']:.3f} | "
            f"policy_loss {metrics['policy_loss']:.4f} | entropy {metrics['entropy']:.3f}{clip} | "
            f"len {metrics['response_len']:.1f} | lr {metrics['learning_rate']:.2e}")


def main(argv=None, reward_fn=calculate_rewards):
    """Train with GRPO: the roles of chapter 8.1 without a critic, then rollout -> reward -> group advantage ->
    loss -> update, step after step (8.5). ``reward_fn`` replaces the chapter's rewards (tests)."""
    args = parse_args(argv)

    # 1. processes, seed and dtype
    local_rank, device = init_distributed_mode(args.device)
    rank, world_size = rank_and_world_size()
    setup_seed(args.seed)  # identical initial weights on every rank
    args.dtype = resolve_train_dtype(args.dtype, device)  # "auto": bfloat16 on a GPU that has it, else float32
    autocast = autocast_context(device, args.dtype)  # the context of every training forward

    # 2. tokenizer, prompts and their loader
    start_weight = None if args.from_weight == "none" else weight_path(args.from_weight, args.save_dir,
                                                                        args.hidden_size, args.use_moe)
    tokenizer = load_tokenizer(args.tokenizer_path, start_weight, args.tokenizer_path_named)  # checked against them
    train_ds = RLAIFDataset(args.data_path, tokenizer, thinking_ratio=args.thinking_ratio, seed=args.seed)
    check_prompt_count(train_ds, args.data_path, args.batch_size, world_size, args.max_seq_len,
                       args.answer_reward_weight)
    batch_sampler = ResumableBatchSampler(train_ds, args.batch_size, world_size, rank, args.seed)
    loader = DataLoader(train_ds, batch_sampler=batch_sampler, num_workers=args.num_workers,
                        generator=torch.Generator().manual_seed(args.seed))  # its own generator: exact resume
    total_steps = count_total_steps(args.max_steps, args.epochs, len(loader))
    run_lock = claim_save_dir(args, "grpo", total_steps)  # one run per checkpoint files; an unfinished one kept

    # 3. the roles (8.1): the policy is trained; the reference and the reward model stay frozen
    lm_config = build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
    model = load_policy(lm_config, args.from_weight, args.save_dir, tokenizer, device)  # pi_theta
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.beta else None  # pi_ref: the start
    reward_model = load_reward_model(args, device, reward_model_dtype(args.reward_dtype, args.reward_device or device))
    setup_seed(args.seed + rank)  # from here on every rank samples its own answers
    Logger(f"GRPO: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(train_ds)} prompts, "
           f"world size {world_size}, device {device}, dtype {args.dtype}")

    # 4. optimizer
    optimizer = build_policy_optimizer(model, args.learning_rate, args.weight_decay, args.final_norm_learning_rate)
    ddp_model = compile_for_training(wrap_ddp(model, device, local_rank), args.use_compile)

    # 5. resume (--from_resume 1): weights, optimizer state, data position, random state; then the schedule at
    #    the resumed update (a cosine over the run's updates: the last window may be shorter; mu per rollout)
    trained = {"model": model, "optimizer": optimizer}
    progress, engine_state = start_or_resume(args, "grpo", trained, len(loader), device, rank, world_size)
    num_updates = -(-total_steps // args.accumulation_steps) * args.num_iterations
    scheduler = build_cosine_scheduler(optimizer, num_updates, progress["lr_schedule_step"])

    # 6. the rollout engine (8.2), made after the resume: the SGLang engine pushes the policy to its server
    rollout_engine = create_rollout_engine(args.rollout_engine, model, tokenizer, **rollout_engine_kwargs(args))
    rollout_engine.load_resume_state(engine_state)

    # 7. the held-out evaluation (step 0, every --eval_interval steps, the end), the stop requests, the NaN guard
    evaluator = build_evaluator(args, tokenizer, device)  # None with --eval_interval 0 or a user's data
    stop_signal = StopSignal()  # from here on Ctrl-C / SIGTERM wait for a safe point
    guard = BadStepGuard(args.max_bad_steps, progress["bad_steps_in_a_row"])
    start_metrics = {} if progress["step"] else evaluate_if_due(evaluator, model, 0, total_steps, args.eval_interval,
                                                                 lambda: stop_signal.received)

    # 8. metrics: metrics.jsonl (+ wandb) and the log line
    run_dir, writer = open_metrics(args, progress)
    Logger(f"GRPO: {total_steps} steps, {args.batch_size} prompts x {args.num_generations} answers per step, "
           f"loss {args.loss_type}, metrics in {run_dir}")
    if start_metrics:
        writer.log({"step": 0, **start_metrics})
    step_log = StepLog(writer, total_steps, args.log_interval,
                       lambda metrics: grpo_log_line(metrics, args.num_iterations), start_step=progress["step"])

    # 9. the loop (a stop requested during the set-up or the step-0 evaluation ends the run before its first step)
    ddp_model.train()
    problems = []  # names of what was non-finite since the last optimizer step
    step, stop = progress["step"], stop_signal.requested(device)
    batches = [] if stop else resumable_batches(loader, batch_sampler, progress, args.epochs, total_steps)
    for step, position, batch in batches:
        learning_rate = optimizer.param_groups[0]["lr"]  # the rate this step's update uses (read before stepping)
        rollout_batch = grpo_rollout(batch, ref_model, rollout_engine, reward_fn, reward_model, tokenizer, args,
                                     device, autocast)  # steps 1-4: rollout, rewards, advantages, reference
        if args.debug_mode and step % args.debug_interval == 0:
            print_samples(step, rollout_batch.debug["prompts"], rollout_batch.debug["completions"],
                          rollout_batch.reward_parts, args.num_generations)
        update_due = step % args.accumulation_steps == 0 or step == total_steps
        updates = []  # the metrics of each update on this rollout
        for _ in range(args.num_iterations):  # mu updates on one rollout (1: the chapter's)
            loss, update_metrics = grpo_policy_loss(ddp_model, rollout_batch, args, autocast)  # step 5
            problems += nonfinite_parts(rewards=rollout_batch.reward_parts["rewards"], loss=loss)
            (loss / accumulation_window_size(step, total_steps, args.accumulation_steps)).backward()
            if update_due:  # the update
                project_scale_only_gradients(optimizer)  # the final norm gain learns one number (its own group)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), args.grad_clip))
                problems += nonfinite_parts(gradients=grad_norm)
                skipped = any_rank(bool(problems), device)  # a NaN or inf on any rank: no rank updates
                if not skipped:
                    optimizer.step()
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                update_metrics.update(grad_norm=grad_norm, skipped_update=float(skipped))
                guard.record(step, skipped, problems)  # stops the run after --max_bad_steps skipped in a row
                problems = []
            updates.append(update_metrics)
        if update_due:
            rollout_engine.update_policy(model)  # the next rollout samples from the updated policy
        metrics = grpo_metrics(rollout_batch, updates)

        metrics = mean_over_ranks(metrics, device)
        metrics["final_norm_gain"] = model.model.norm.weight.mean().item()  # the output's sharpness
        metrics.update(gpu_memory_metrics(device))
        metrics.update(evaluate_if_due(evaluator, model, step, total_steps, args.eval_interval,
                                       lambda: stop_signal.received))
        step_log.write(step, position["epoch"], metrics, {"learning_rate": learning_rate}, batch["index"].tolist())
        stop = stop_signal.requested(device)  # agreed by every rank
        if step % args.save_interval == 0 or step == total_steps or stop:
            checkpoint_progress = {"step": step, "total_steps": total_steps, **position,
                                   "lr_schedule_step": scheduler.last_epoch, "run_dir": run_dir,
                                   "wandb_id": writer.wandb_id, "bad_steps_in_a_row": guard.in_a_row}
            save_checkpoint(args, "grpo", lm_config, dict(trained, rollout_engine=rollout_engine), checkpoint_progress,
                            {args.save_weight: model})
        if stop:
            break

    if stop:
        Logger(stop_signal.stopped_message(step, resume_command(__file__, argv, world_size)))
    for line in evaluator.summary_lines() if evaluator is not None else []:
        Logger(line)
    writer.close()
    stop_signal.restore()
    if run_lock is not None:
        run_lock.close()  # another run may use these checkpoint files now
    del ddp_model  # free the DDP wrapper while the process group is alive (see shutdown_distributed)
    shutdown_distributed()


if __name__ == "__main__":
    main()
