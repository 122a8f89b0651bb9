"""GRPO for a MiniMind policy (chapter 8.5): rollout -> reward -> group advantage -> CISPO / GRPO loss.

One step, in chapter order: the rollout engine samples G answers per prompt with their old log-probs (8.2); rewards =
rule reward + reward-model score + answer reward (8.3); reference log-probs; advantages = (r - group mean) / (group
std + 1e-4) (8.5.1); the CISPO or clipped loss with beta * k3 KL (8.5.2, 8.6). ``main`` builds what the step uses in
numbered blocks, then runs the loop: loss -> backward -> clip and step (``infra/optimizer.OptimizerStep``). The
members after the chapter (DAPO, Dr. GRPO, GSPO, SAPO, ...) live in ``grpo_family.py``; the estimators beside the
group's (RLOO, REINFORCE++) and DAPO's dynamic sampling and overlong penalty in ``advantage_estimators.py``.

Run (the embedded default: tiny MiniMind, bundled arithmetic prompts, CPU):
    python trainer/train_grpo.py
    python trainer/train_grpo.py --loss_type grpo --max_steps 50
    torchrun --nproc_per_node 2 trainer/train_grpo.py --loss_type cispo
"""

import argparse
import functools
import os
import sys
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `python trainer/x.py` from any folder imports this checkout's packages

import torch
from torch.utils.data import DataLoader

from dataset.lm_dataset import (
    RLAIFDataset,
    ResumableBatchSampler,
    check_prompt_count,
    count_total_steps,
    epoch_batches,
    resumable_batches,
    spare_batches,
)
from trainer.advantage_estimators import (
    add_dapo_sampling_args,
    add_estimator_args,
    build_advantage_config,
    check_estimator_args,
    compute_advantages,
    dynamic_sampling,
    loss_beta,
    overlong_penalty,
)
from trainer.grpo_family import (
    DEFAULT_CISPO_EPSILON_HIGH,
    LOSS_TYPES,
    TOKEN_SUM_LOSS_TYPES,
    add_family_args,
    build_loss_config,
    check_family_args,
    family_loss,
    frac_reward_zero_std,
    rollout_correction,
    update_metrics,
)
from trainer.infra.checkpoints import (
    checkpoint_progress,
    claim_save_dir,
    resume_command,
    save_checkpoint,
    start_or_resume,
)
from trainer.infra.distributed import (
    Logger,
    all_ranks_mean,
    compile_for_training,
    init_distributed_mode,
    mean_over_ranks,
    rank_and_world_size,
    setup_seed,
    shutdown_distributed,
    wrap_ddp,
)
from trainer.infra.dtypes import autocast_context, resolve_train_dtype, reward_model_dtype
from trainer.evaluation import build_evaluator, evaluate_if_due, evaluation_due
from trainer.infra.errors import run_script
from trainer.infra.fsdp import full_tensor, gathered_weights, load_on_rank0, shard_roles
from trainer.infra.flags import (
    AT_LEAST_1,
    AT_LEAST_2,
    NON_NEGATIVE,
    add_bool_flag,
    add_common_rl_args,
    check_common_rl_args,
    flag_groups,
    rollout_engine_kwargs,
)
from trainer.infra.lora import base_model, with_adapters
from trainer.infra.metrics import (
    StepLog,
    gpu_memory_metrics,
    open_metrics,
    print_samples,
)
from trainer.infra.optimizer import OptimizerStep, build_cosine_scheduler, build_policy_optimizer
from trainer.infra.stopping import BadStepGuard, StopSignal, finish_run
from trainer.infra.weights import config_from_args, start_weight_path, frozen_copy, load_policy, load_tokenizer
from trainer.rollout_engine import (
    RolloutResult,
    RolloutRoles,
    create_rollout_engine,
    tokenize_prompts,
)
from trainer.speed.chunked_logps import log_prob_forward
from trainer.speed.micro_batches import micro_batch_slices, micro_batch_weight, rollout_rows
from trainer.speed.shared_prefix import shared_prefix_forward
from trainer.step_metrics import grpo_log_line, grpo_metrics
from trainer.trainer_utils import calculate_rewards, k3_kl, load_reward_model, masked_mean


# ----------------------------------------------------------------------------- the math (chapter 8.5)
# 8.5.1's group advantages are trainer_utils.grpo_advantages (train_agent.py uses them too); 8.5.2 follows.
def sequence_mean_loss(per_token_loss, completion_mask):
    """Mean over each sequence's masked tokens, then mean over sequences (chapter 8.5.2).

    per_token_loss: fp32 [N, R]; completion_mask: [N, R] 0/1 -> scalar. Masked entries never enter the
    sum of the loss value (even inf or huge values there are dropped), and an empty row counts as 0.
    """
    mask = completion_mask.bool()
    per_token_loss = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    return masked_mean(per_token_loss, mask, dim=1).mean()


def grpo_loss(
    per_token_logps,
    old_per_token_logps,
    ref_per_token_logps,
    advantages,
    completion_mask,
    loss_type="cispo",
    epsilon=0.2,
    epsilon_high=None,
    beta=0.1,
):
    """The chapter's two policy losses with the k3 KL penalty, each sequence's mean (chapter 8.5.2, 8.6):
      cispo: -(sg[min(ratio, epsilon_high)] * A * logp - beta * per_token_kl) (MiniMax-M1 2025, eq. 4);
      grpo:  -(min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) - beta * per_token_kl) (PPO's clip).
    ratio = exp(logp - old_logp), 1 where masked; ``epsilon_high`` None: 5.0 for cispo (upstream's), ``epsilon`` for
    grpo (the symmetric clip). Equal to TRL 1.16's ``_compute_loss`` (tests/test_grpo_family.py).

    per_token_logps (requires grad), old_per_token_logps, ref_per_token_logps (None when beta is 0): fp32 [N, R];
    advantages fp32 [N] (one per answer, 8.5.1) or [N, R] (one per token: REINFORCE++, ``advantage_estimators.py``);
    completion_mask [N, R] 0/1. Returns (policy_loss scalar, per_token_kl [N, R], ratio [N, R]),
    the last two detached. Raises ValueError for another loss_type (the family: ``grpo_family.family_loss``).
    """
    mask = completion_mask.bool()  # [N, R]
    if epsilon_high is None:
        epsilon_high = DEFAULT_CISPO_EPSILON_HIGH if loss_type == "cispo" else epsilon
    if ref_per_token_logps is None:
        per_token_kl = torch.zeros_like(per_token_logps)  # [N, R]
    else:
        per_token_kl = k3_kl(ref_per_token_logps, per_token_logps, mask)  # [N, R], 0 where masked
    log_ratio = torch.where(mask, per_token_logps - old_per_token_logps, torch.zeros_like(per_token_logps))
    ratio = torch.exp(log_ratio)  # [N, R]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [N, 1] or [N, R]
    if loss_type == "cispo":
        clamped_ratio = torch.clamp(ratio, max=epsilon_high).detach()  # [N, R], a weight on logp's gradient
        per_token_loss = -(clamped_ratio * advantages * per_token_logps - beta * per_token_kl)
    elif loss_type == "grpo":
        clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # [N, R]
        per_token_loss = -(torch.min(ratio * advantages, clipped_ratio * advantages) - beta * per_token_kl)
    else:
        raise ValueError(
            f"grpo_loss takes the chapter's loss types (cispo, grpo), got {loss_type!r}: the family's "
            f"members are grpo_family.family_loss"
        )
    return sequence_mean_loss(per_token_loss, completion_mask), per_token_kl.detach(), ratio.detach()


# ----------------------------------------------------------------------------- flags
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind GRPO (Group Relative Policy Optimization)")
    groups = flag_groups(parser)  # --help's groups: the chapter's flags first (infra/flags.py)
    add_common_rl_args(groups)
    groups["rollout"].add_argument(
        "--num_generations", type=int, default=6, action=AT_LEAST_2, help="G, answers sampled per prompt"
    )
    algorithm = groups["algorithm"]
    algorithm.add_argument(
        "--loss_type",
        default="cispo",
        help=f"one of {', '.join(LOSS_TYPES)} (TRL's names): the chapter's cispo (default) and "
        "grpo, then the family after it (docs/grpo_family.md)",
    )
    algorithm.add_argument(
        "--epsilon",
        type=float,
        default=None,
        help="clipped family (grpo, bnpo, dr_grpo, dapo, luspo): lower clip 1 - epsilon (0.2)",
    )
    algorithm.add_argument(
        "--epsilon_high",
        type=float,
        default=None,
        help="cispo: the clamp of the ratio weight (5.0, upstream MiniMind's); clipped family: "
        "upper clip 1 + epsilon_high (default --epsilon; DAPO 0.28)",
    )
    algorithm.add_argument(
        "--num_iterations",
        type=int,
        default=1,
        action=AT_LEAST_1,
        help="mu: updates on each rollout (1: the chapter's; from the second the ratio leaves 1)",
    )
    groups["kl"].add_argument(
        "--beta",
        type=float,
        default=0.1,
        action=NON_NEGATIVE,
        help="weight of the k3 KL to the reference (0: no reference model is built)",
    )
    add_family_args(groups["family"])  # the loss members after the chapter (grpo_family.py)
    add_estimator_args(groups["family"])  # --advantage_estimator, --kl_placement (advantage_estimators.py)
    add_dapo_sampling_args(groups["family"])  # --dynamic_sampling, --overlong_buffer_len
    groups["memory"].add_argument(
        "--accumulation_steps",
        type=int,
        default=1,
        action=AT_LEAST_1,
        help="steps (rollouts) whose gradients make one optimizer step",
    )
    add_bool_flag(
        groups["memory"],
        "--shared_prefix",
        help="1: the forwards run each prompt once for its G answers (same log-probs; the default for "
        "dense models); 0: every answer with its own copy of the prompt (the default with --use_moe 1, "
        "--gradient_checkpointing 1 or --fsdp 1)",
    )
    groups["run"].add_argument("--save_weight", default="grpo", help="name of the saved weights ({name}_{hidden}.pth)")
    # the default run: 120 steps, the final norm's gain at 2e-2 (docs/departures.md: GRPO's default run)
    known = parser.parse_known_args(argv)[0]
    parser.set_defaults(
        max_steps=120,
        final_norm_learning_rate=2e-2,
        eval_interval=60,
        shared_prefix=0 if known.use_moe or known.gradient_checkpointing or known.fsdp else 1,
    )
    args = parser.parse_args(argv)
    check_common_rl_args(parser, args)
    if args.shared_prefix and args.use_moe:
        parser.error(
            "--shared_prefix 1 is for dense models: with --use_moe 1 the router loss of its two forwards "
            "(prompts, then answers) is not the loss of the full rows; leave --shared_prefix out (or 0)"
        )
    if args.shared_prefix and args.fsdp:
        parser.error(
            "--shared_prefix 1 with --fsdp 1: its second forward runs only on a rank whose answers are longer than one "
            "token, and under --fsdp 1 every forward gathers weights with the other ranks, which would wait for it; "
            "leave --shared_prefix out (it is 0 with --fsdp 1)"
        )
    if args.shared_prefix and args.gradient_checkpointing:
        parser.error(
            "--shared_prefix 1 with --gradient_checkpointing 1: the shared prefix writes the prompts' keys and values "
            "into a KV cache during the forward, and a checkpointed block recomputed in the backward would write "
            "them again; leave --shared_prefix out (it is 0 with --gradient_checkpointing 1)"
        )
    if args.shared_prefix and args.micro_batch_size % args.num_generations:
        parser.error(
            f"--micro_batch_size {args.micro_batch_size} with --shared_prefix 1: a micro-batch holds whole groups "
            f"(each prompt runs once for its G answers), so it must be a multiple of --num_generations "
            f"{args.num_generations}; or pass --shared_prefix 0"
        )
    if args.num_iterations > 1 and args.accumulation_steps > 1:
        parser.error("--num_iterations > 1 updates once per iteration: use it with --accumulation_steps 1")
    check_family_args(parser, args)  # the loss's flags: a flag the chosen member ignores is refused
    check_estimator_args(parser, args)  # the estimator's flags, the KL's placement, DAPO's sampling
    return args


# ----------------------------------------------------------------------------- the forwards of a rollout
def group_policy_forward(
    model, rollout, num_generations, temperature=1.0, shared_prefix=True, compute_entropy=True, logprob_chunk_size=0
):
    """``PolicyForward`` of a rollout's B*G answers under ``model`` (chapter 8.2, 8.5): per_token_logps fp32
    [B*G, R], the MoE router loss, token entropies [B*G, R] (or None). Every answer with its own copy of the prompt
    (the chapter's), or with ``shared_prefix`` each prompt's forward once for its G answers (``speed/shared_prefix.py``:
    the same log-probs); ``logprob_chunk_size`` C > 0: the logits of C tokens at a time (``speed/chunked_logps.py``,
    the same log-probs without [B*G, R, V]). Raises ValueError under ``shared_prefix`` when the rows are not groups of
    ``num_generations``."""
    if shared_prefix and rollout.completion_ids.size(0) % num_generations != 0:
        raise ValueError(f"{rollout.completion_ids.size(0)} completions are not groups of {num_generations}")
    if shared_prefix:
        return shared_prefix_forward(model, rollout, num_generations, temperature, compute_entropy, logprob_chunk_size)
    return log_prob_forward(logprob_chunk_size)(
        model, rollout.output_ids, rollout.completion_ids.size(1), rollout.attention_mask, temperature, compute_entropy
    )


# ----------------------------------------------------------------------------- one step
@dataclass
class ScoredRollout:
    """Steps 1-2 of a GRPO step for B prompts: G answers each and their rewards (what dynamic sampling keeps)."""

    rollout: RolloutResult  # output_ids, completion_ids, masks and the old log-probs of the sampler (8.2)
    completion_mask: torch.Tensor  # [B*G, R] 0/1, the loss's tokens (--mask_truncated_completions: cut answers out)
    reward_parts: dict  # the reward function's parts, each [B*G]; "rewards" is their total
    prompts: list  # B*G prompts, each repeated G times
    truncated: int  # prompts cut to --max_seq_len


@dataclass
class GRPORolloutBatch:
    """What ``grpo_rollout`` hands to the updates: one rollout of B prompts x G answers and what the loss needs."""

    rollout: RolloutResult  # output_ids, completion_ids, masks and the old log-probs of the sampler (8.2)
    completion_mask: torch.Tensor  # [B*G, R] 0/1, the loss's tokens (--mask_truncated_completions: cut answers out)
    advantages: torch.Tensor  # [B*G] fp32 (8.5.1), or [B*G, R] for --advantage_estimator reinforce_pp
    ref_per_token_logps: Optional[torch.Tensor]  # [B*G, R] fp32 (8.6), None with --beta 0
    rewards: torch.Tensor  # [B*G] fp32 (8.3)
    reward_parts: dict  # the reward function's parts, each [B*G]
    num_items_in_batch: float  # answer tokens of every process's batch / processes (TRL's dapo normaliser)
    debug: dict  # "prompts", "completions": B*G strings each, for --debug_mode
    metrics: dict  # the rollout's own: prompts cut, groups of equal rewards, the engine's metrics
    importance_sampling_ratio: Optional[torch.Tensor] = None  # [B*G, R] or [B*G, 1], --rollout_correction's weights
    data_position: Optional[dict] = None  # --dynamic_sampling: the data position after the last prompts drawn


@torch.no_grad()
def sample_and_score(batch, roles, args, device, autocast):
    """Steps 1-2 of a GRPO step (chapter 8.2, 8.3): G answers per prompt of ``batch`` from ``roles.rollout_engine``
    with their old log-probs, and their rewards (``roles.reward_fn``; with ``--overlong_buffer_len`` DAPO's overlong
    penalty added). -> ScoredRollout."""
    tokenizer = roles.tokenizer
    prompts, answers = batch["prompt"], batch["answer"]  # list[str] of length B
    prompt_ids, attention_mask, truncated = tokenize_prompts(tokenizer, prompts, args.max_seq_len, device)

    # 1. rollout: B*G completions and their old log-probs (8.2)
    with autocast:
        rollout = roles.rollout_engine.rollout(
            prompt_ids, attention_mask, args.num_generations, args.max_gen_len, args.temperature
        )
    completion_mask = rollout.completion_mask  # [B*G, R]
    if args.mask_truncated_completions:  # DAPO: an answer cut at --max_gen_len teaches nothing about its end
        ended = (rollout.completion_ids == tokenizer.eos_token_id).any(dim=1, keepdim=True)  # [B*G, 1]
        completion_mask = completion_mask * ended

    # 2. rewards (8.3)
    repeated_prompts = [p for p in prompts for _ in range(args.num_generations)]
    repeated_answers = [a for a in answers for _ in range(args.num_generations)]
    reward_parts = roles.reward_fn(
        repeated_prompts, rollout.completions, repeated_answers, roles.reward_model, args.answer_reward_weight
    )
    if args.overlong_buffer_len:  # DAPO's soft overlong punishment (advantage_estimators.py)
        penalties = overlong_penalty(
            rollout.completion_mask.sum(dim=1).cpu(),
            args.max_gen_len,
            args.overlong_buffer_len,
            args.overlong_penalty_factor,
        ).to(reward_parts["rewards"].device)  # [B*G]
        reward_parts = {**reward_parts, "rewards": reward_parts["rewards"] + penalties, "overlong_penalties": penalties}
    return ScoredRollout(rollout, completion_mask, reward_parts, repeated_prompts, truncated)


@torch.no_grad()
def grpo_rollout(batch, roles, args, device, autocast, more_batches=None):
    """Steps 1-4 of a GRPO step (chapter 8.1, 8.5): rollout, rewards, reference log-probs, advantages.

    ``roles``: a ``RolloutRoles`` (its ``ref_model`` None with ``--beta 0``: then no reference forward runs);
    ``autocast`` is the forwards' context under ``--dtype``; ``more_batches``: an iterator of (data position, batch)
    that ``--dynamic_sampling`` draws from. Returns a ``GRPORolloutBatch`` of B*G rows.
    """
    # 1-2. rollout and rewards (8.2, 8.3)
    scored = sample_and_score(batch, roles, args, device, autocast)
    sampling_metrics = {
        "frac_reward_zero_std": frac_reward_zero_std(scored.reward_parts["rewards"], args.num_generations)
    }
    data_position = None
    if args.dynamic_sampling:  # DAPO: groups of equal rewards are replaced by new prompts' groups
        score = functools.partial(sample_and_score, roles=roles, args=args, device=device, autocast=autocast)
        scored, sampling_metrics, data_position = dynamic_sampling(
            scored, more_batches, score, args, device, roles.tokenizer.pad_token_id
        )
    rollout, completion_mask = scored.rollout, scored.completion_mask  # [B*G, R] each
    rewards = scored.reward_parts["rewards"].to(device)  # [B*G]

    # 3. reference log-probs (fp32 whatever --dtype is)
    ref_per_token_logps = None
    if roles.ref_model is not None:  # --micro_batch_size M: M answers per forward
        group_size = args.num_generations if args.shared_prefix else 1
        slices = micro_batch_slices(rollout.completion_ids.size(0), args.micro_batch_size, group_size)
        with autocast:
            ref_per_token_logps = torch.cat(
                [
                    group_policy_forward(
                        roles.ref_model,
                        rollout_rows(rollout, rows),
                        args.num_generations,
                        args.temperature,
                        args.shared_prefix,
                        compute_entropy=False,
                        logprob_chunk_size=args.logprob_chunk_size,
                    ).per_token_logps
                    for rows in slices
                ]
            )  # [B*G, R]

    # 4. advantages: the group's (8.5.1), or --advantage_estimator's (advantage_estimators.py)
    advantage_config = build_advantage_config(args)
    advantages, kl_rewards = compute_advantages(
        rewards, completion_mask, advantage_config, rollout.per_token_logps, ref_per_token_logps
    )  # [B*G] or [B*G, R]
    importance_sampling_ratio, mismatch_metrics = rollout_correction(  # grpo_family.py: [B*G, R] or [B*G, 1] or None
        rollout.per_token_logps,
        rollout.sampling_per_token_logps,
        completion_mask,
        args.rollout_correction,
        args.rollout_correction_cap,
    )  # the rollout correction (beyond the chapter): trainer against server
    kl_metrics = {"kl_reward": kl_rewards.mean().item()} if advantage_config.kl_placement == "reward" else {}
    return GRPORolloutBatch(
        rollout=rollout,
        completion_mask=completion_mask,
        advantages=advantages,
        ref_per_token_logps=ref_per_token_logps,
        rewards=rewards,
        reward_parts=scored.reward_parts,
        num_items_in_batch=all_ranks_mean(completion_mask.sum().double(), device),
        debug={"prompts": scored.prompts, "completions": rollout.completions},
        metrics={
            "truncated_prompts": scored.truncated,
            **rollout.metrics,
            **sampling_metrics,
            **kl_metrics,
            **mismatch_metrics,
        },
        importance_sampling_ratio=importance_sampling_ratio,
        data_position=data_position,
    )


class PolicyLossOutputs(NamedTuple):
    """What ``grpo_policy_loss`` returns besides the loss, detached, for the metrics (``grpo_update_metrics``)."""

    policy_loss: float  # the loss as logged (a token sum divided by the window's tokens)
    aux_loss: float  # the MoE router loss (0 for a dense model)
    per_token_logps: torch.Tensor  # [n, R] fp32, the rows of this (micro-)batch
    per_token_kl: torch.Tensor  # [n, R]
    ratio: torch.Tensor  # [n, R]
    entropies: torch.Tensor  # [n, R]


def grpo_policy_loss(model, rollout_batch, loss_config, args, autocast):
    """Step 5 of a GRPO step (chapter 8.5.2, 8.6), once per update: the policy's log-probs of the rollout through
    ``model`` (the DDP wrapper when distributed) and the loss of ``loss_config`` with the k3 KL penalty.
    Returns (loss to backpropagate, ``PolicyLossOutputs``); the loop divides the loss by its accumulation window
    (and, with ``--micro_batch_size``, weights each micro-batch's, ``grpo_micro_batches``)."""
    rollout, completion_mask = rollout_batch.rollout, rollout_batch.completion_mask
    old_per_token_logps = rollout.per_token_logps.detach()  # [B*G, R]
    with autocast:
        per_token_logps, aux_loss, entropies = group_policy_forward(
            model,
            rollout,
            args.num_generations,
            args.temperature,
            args.shared_prefix,
            logprob_chunk_size=args.logprob_chunk_size,
        )
    inputs = (
        per_token_logps,
        old_per_token_logps,
        rollout_batch.ref_per_token_logps,
        rollout_batch.advantages,
        completion_mask,
    )  # each [B*G, R], advantages [B*G]
    if loss_config.is_chapter_loss and rollout_batch.importance_sampling_ratio is None:  # 8.5.2: CISPO or clipped
        policy_loss, per_token_kl, ratio = grpo_loss(
            *inputs,
            loss_type=loss_config.loss_type,
            epsilon=loss_config.epsilon,
            epsilon_high=loss_config.epsilon_high,
            beta=loss_config.beta,
        )
        logged_policy_loss = policy_loss.item()
    else:  # the family (grpo_family.py), also under a correction; a token sum's normaliser waits for the window's end
        token_sum = loss_config.loss_type in TOKEN_SUM_LOSS_TYPES
        policy_loss, per_token_kl, ratio = family_loss(
            *inputs, loss_config, 1.0 if token_sum else None, rollout_batch.importance_sampling_ratio
        )
        logged_policy_loss = policy_loss.item() / (rollout_batch.num_items_in_batch if token_sum else 1.0)
    loss = policy_loss + aux_loss  # the loop divides by the size of its accumulation window
    outputs = PolicyLossOutputs(
        logged_policy_loss, float(aux_loss), per_token_logps.detach(), per_token_kl, ratio, entropies
    )
    return loss, outputs


def grpo_micro_batches(rollout_batch, micro_batch_size, group_size, loss_type):
    """The update's (micro-batch, weight) pairs (``speed/micro_batches.py``): ``micro_batch_size`` answers each, in
    whole groups of ``group_size``; 0 gives one pair, the whole batch with weight 1.0 (the chapter's update). The
    weighted losses add up to the whole batch's loss (``micro_batch_weight``)."""
    num_rows = rollout_batch.completion_mask.size(0)
    total_tokens = float(rollout_batch.completion_mask.sum())
    importance = rollout_batch.importance_sampling_ratio  # [B*G, R] or [B*G, 1], or None
    pairs = []
    for rows in micro_batch_slices(num_rows, micro_batch_size, group_size):
        micro_batch = replace(
            rollout_batch,
            rollout=rollout_rows(rollout_batch.rollout, rows),
            completion_mask=rollout_batch.completion_mask[rows],
            advantages=rollout_batch.advantages[rows],
            ref_per_token_logps=None
            if rollout_batch.ref_per_token_logps is None
            else rollout_batch.ref_per_token_logps[rows],
            rewards=rollout_batch.rewards[rows],
            importance_sampling_ratio=None if importance is None else importance[rows],
        )
        rows_in = micro_batch.completion_mask.size(0)
        tokens = float(micro_batch.completion_mask.sum())
        pairs.append((micro_batch, micro_batch_weight(loss_type, rows_in, num_rows, tokens, total_tokens)))
    return pairs


def grpo_update_metrics(outputs, weights, rollout_batch, loss_config):
    """One update's metrics from its micro-batches' ``PolicyLossOutputs`` and weights: the loss and router loss as
    the weighted sums the gradient saw, and KL, entropy, the ratio's range and clipping (``update_metrics``) on the
    micro-batches' tensors put back together: the whole batch's."""
    names = ("per_token_logps", "per_token_kl", "ratio", "entropies")
    joined = {name: torch.cat([getattr(output, name) for output in outputs]) for name in names}  # [B*G, R] each
    metrics = {
        "policy_loss": sum(w * o.policy_loss for o, w in zip(outputs, weights)),
        "aux_loss": sum(w * o.aux_loss for o, w in zip(outputs, weights)),
    }
    metrics.update(
        update_metrics(
            joined["per_token_logps"],
            rollout_batch.rollout.per_token_logps.detach(),
            joined["per_token_kl"],
            joined["ratio"],
            joined["entropies"],
            rollout_batch,
            loss_config,
        )
    )  # KL, entropy, the ratio's range and clipping
    return metrics


def main(argv=None, reward_fn=calculate_rewards):
    """Train with GRPO: the roles of chapter 8.1 without a critic, then rollout -> reward -> group advantage ->
    loss -> update, step after step (8.5).
    ``reward_fn``: your own rewards, with the arguments and result of ``calculate_rewards``."""
    args = parse_args(argv)

    # 1. processes, seed and dtype
    local_rank, device = init_distributed_mode(args.device, cpu_collectives=args.fsdp and args.fsdp_cpu_offload)
    rank, world_size = rank_and_world_size()
    setup_seed(args.seed)  # identical initial weights on every rank
    train_dtype = resolve_train_dtype(args.dtype, device)  # "auto": bfloat16 on a GPU that has it, else float32
    autocast = autocast_context(device, train_dtype)  # the context of every training forward
    loss_config = build_loss_config(args)  # the policy loss's settings (8.5.2; the family: grpo_family.py)
    loss_config = replace(loss_config, beta=loss_beta(build_advantage_config(args)))  # 0: the KL is in the rewards

    # 2. tokenizer, prompts and their loader
    start_weight = start_weight_path(args)  # the .pth the tokenizer is checked against (None: random, a folder)
    tokenizer = load_tokenizer(args.tokenizer_path, start_weight, args.tokenizer_path_named)  # checked against them
    train_ds = RLAIFDataset(args.data_path, tokenizer, thinking_ratio=args.thinking_ratio, seed=args.seed)
    check_prompt_count(
        train_ds, args.data_path, args.batch_size, world_size, args.max_seq_len, args.answer_reward_weight
    )
    batch_sampler = ResumableBatchSampler(train_ds, args.batch_size, world_size, rank, args.seed)
    loader = DataLoader(
        train_ds,
        batch_sampler=batch_sampler,
        num_workers=args.num_workers,
        generator=torch.Generator().manual_seed(args.seed),
    )  # its own generator: exact resume
    total_steps = count_total_steps(args.max_steps, args.epochs, len(loader))
    run_lock = claim_save_dir(args, "grpo", total_steps)  # one run per checkpoint files; an unfinished one kept

    # 3. the roles (8.1): the policy is trained; the reference and the reward model stay frozen
    lm_config = config_from_args(args)  # the architecture flags, or the model folder's config.json
    model = load_on_rank0(  # pi_theta (--fsdp 1: read on rank 0 alone, the other ranks' copy empty until sharded)
        lambda: load_policy(lm_config, args.from_weight, args.save_dir, tokenizer, device), lm_config, args.fsdp
    )
    ref_model = frozen_copy(model, args.ref_dtype) if args.beta and not args.lora_rank else None  # --ref_dtype
    if args.gradient_checkpointing:  # recompute each block in the backward (transformers' convention, non-reentrant)
        model.activation_checkpointing_enable({"use_reentrant": False})
    model, ref_model = with_adapters(model, ref_model, args, args.beta > 0)  # --lora_rank: pi_ref = adapters off
    model, ref_model = shard_roles(args, device, train_dtype, model, ref_model)  # --fsdp 1: 1/N of each per rank
    reward_model = load_reward_model(args, device, reward_model_dtype(args.reward_dtype, args.reward_device or device))
    setup_seed(args.seed + rank)  # from here on every rank samples its own answers
    Logger(
        f"GRPO: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(train_ds)} prompts, "
        f"world size {world_size}, device {device}, dtype {train_dtype}"
    )

    # 4. optimizer
    optimizer = build_policy_optimizer(
        model, args.learning_rate, args.weight_decay, args.final_norm_learning_rate, args.optimizer
    )
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
    roles = RolloutRoles(rollout_engine, tokenizer, reward_fn, reward_model, ref_model)  # what the rollout uses

    # 7. the held-out evaluation (step 0, every --eval_interval steps, the end), the stop requests, the NaN guard
    evaluator = build_evaluator(args, tokenizer, device)  # None with --eval_interval 0 or a user's data
    stop_signal = StopSignal()  # from here on Ctrl-C / SIGTERM wait for a safe point
    guard = BadStepGuard(args.max_bad_steps, progress["bad_steps_in_a_row"])
    optimizer_step = OptimizerStep(  # clip and step (infra/optimizer.py): the update after every backward
        [ddp_model],
        [optimizer],
        args.grad_clip,
        device,
        args.accumulation_steps,
        total_steps,
        [scheduler],
        guard,
        token_sum=loss_config.loss_type in TOKEN_SUM_LOSS_TYPES,
        state=progress,
    )
    at_start = not progress["step"] and evaluation_due(evaluator, 0, total_steps, args.eval_interval)
    with gathered_weights(model, args.fsdp_reshard_after_forward, at_start):  # --fsdp 1: whole, once per evaluation
        start_metrics = (
            {}
            if progress["step"]
            else evaluate_if_due(evaluator, model, 0, total_steps, args.eval_interval, lambda: stop_signal.received)
        )

    # 8. metrics: metrics.jsonl (+ wandb) and the log line
    run_dir, writer = open_metrics(args, progress)
    Logger(
        f"GRPO: {total_steps} steps, {args.batch_size} prompts x {args.num_generations} answers per step, "
        f"loss {args.loss_type}, metrics in {run_dir}"
    )
    if start_metrics:
        writer.log({"step": 0, **start_metrics})
    step_log = StepLog(
        writer,
        total_steps,
        args.log_interval,
        lambda metrics: grpo_log_line(metrics, args.num_iterations),
        start_step=progress["step"],
    )

    # 9. the loop (a stop requested during the set-up or the step-0 evaluation ends the run before its first step)
    ddp_model.train()
    group_size = args.num_generations if args.shared_prefix else 1  # a micro-batch's rows come in whole groups of this
    step, stop = progress["step"], stop_signal.requested(device)
    data = epoch_batches(loader, batch_sampler, progress, args.epochs)  # (position, batch), also DAPO's draws
    batches = [] if stop else resumable_batches(loader, batch_sampler, progress, args.epochs, total_steps, data)
    for step, position, batch in batches:
        learning_rate = float(
            optimizer.param_groups[0]["lr"]
        )  # the rate this step's update uses (read before stepping)
        more_batches = spare_batches(data, position, args.epochs, batch_sampler, total_steps - step)  # DAPO's draws
        with gathered_weights(
            model, args.fsdp_reshard_after_forward, frozen=[ref_model]
        ):  # --fsdp 1: the whole policy to sample from
            rollout_batch = grpo_rollout(batch, roles, args, device, autocast, more_batches)  # steps 1-4 (8.2-8.5)
        position = rollout_batch.data_position or position  # after the prompts --dynamic_sampling drew
        if args.debug_mode and step % args.debug_interval == 0:
            print_samples(
                step,
                rollout_batch.debug["prompts"],
                rollout_batch.debug["completions"],
                rollout_batch.reward_parts,
                args.num_generations,
            )
        window = optimizer_step.begin_step(step, rollout_batch.num_items_in_batch)  # its accumulation window's size
        updates = []  # the metrics of each update on this rollout
        micro_batches = grpo_micro_batches(rollout_batch, args.micro_batch_size, group_size, loss_config.loss_type)
        for _ in range(args.num_iterations):  # mu updates on one rollout (1: the chapter's)
            outputs, total_loss = [], 0.0
            for micro_batch, weight in micro_batches:  # --micro_batch_size M: M answers at a time (0: one, all)
                loss, micro_outputs = grpo_policy_loss(ddp_model, micro_batch, loss_config, args, autocast)  # step 5
                (loss * weight / window).backward()
                outputs.append(micro_outputs)
                total_loss = total_loss + loss.detach() * weight
            this_update = grpo_update_metrics(outputs, [w for _, w in micro_batches], rollout_batch, loss_config)
            this_update.update(optimizer_step.clip_and_step(step, rewards=rollout_batch.rewards, loss=total_loss))
            updates.append(this_update)
        if optimizer_step.update_due(step):
            rollout_engine.update_policy(model)  # the next rollout samples from the updated policy
        metrics = grpo_metrics(rollout_batch, updates)

        metrics = mean_over_ranks(metrics, device)
        metrics["final_norm_gain"] = full_tensor(base_model(model).model.norm.weight).mean().item()  # sharpness
        metrics.update(gpu_memory_metrics(device))
        due = evaluation_due(evaluator, step, total_steps, args.eval_interval)
        with gathered_weights(model, args.fsdp_reshard_after_forward, due):  # --fsdp 1: whole, once per evaluation
            metrics.update(
                evaluate_if_due(evaluator, model, step, total_steps, args.eval_interval, lambda: stop_signal.received)
            )
        step_log.write(step, position["epoch"], metrics, {"learning_rate": learning_rate}, batch["index"].tolist())
        stop = stop_signal.requested(device)  # agreed by every rank
        if step % args.save_interval == 0 or step == total_steps or stop:
            saved = checkpoint_progress(step, total_steps, position, scheduler, run_dir, writer, guard, optimizer_step)
            save_checkpoint(
                args, "grpo", lm_config, dict(trained, rollout_engine=rollout_engine), saved, {args.save_weight: model}
            )
        if stop:
            break

    finish_run(
        stop_signal, step if stop else None, resume_command(__file__, argv, world_size), evaluator, writer, run_lock
    )  # the stop line, the before/after lines; the metrics and the save folder released
    del ddp_model, optimizer_step  # free the DDP wrapper (it holds one too) while the process group is alive
    shutdown_distributed()


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
