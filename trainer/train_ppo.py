"""PPO for a MiniMind policy (chapter 8.4): actor, frozen reference, critic and reward model.

One step, in chapter order: ``ppo_rollout`` samples one answer per prompt with its old log-probs (8.2), scores it
(8.3), takes the reference log-probs and the critic's old values, puts the reward on the last real token and runs
GAE with whitened advantages (8.4.2); ``ppo_update`` runs epochs of shuffled minibatches of the clipped surrogate
+ k3 KL (8.4.3, 8.6) and the clipped value loss (8.4.4), clipping and stepping both models. ``--lam`` is 1.0, not
the chapter's 0.95 (docs/departures.md). ``main`` builds what the step uses, in numbered blocks, then runs the loop.
"The learner's article" is the walk-through of MiniMind's PPO code listed in the README's Sources.

Run: ``python trainer/train_ppo.py`` (the embedded default, CPU); ``--max_steps 50 --kl_coef 0.05``;
``torchrun --nproc_per_node 2 trainer/train_ppo.py``.
"""

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `python trainer/x.py` from any folder imports this checkout's packages

import torch
from torch.utils.data import DataLoader

from dataset.lm_dataset import (
    RLAIFDataset,
    ResumableBatchSampler,
    check_prompt_count,
    count_total_steps,
    resumable_batches,
)
from model.model_minimind import CriticModel
from trainer.grpo_family import rollout_correction
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
    NON_NEGATIVE,
    POSITIVE,
    UNIT_INTERVAL,
    add_bool_flag,
    add_common_rl_args,
    check_common_rl_args,
    flag_groups,
    rollout_engine_kwargs,
)
from trainer.infra.lora import base_model, critic_with_adapters, merged_state_dict, with_adapters
from trainer.infra.metrics import (
    StepLog,
    gpu_memory_metrics,
    open_metrics,
    print_samples,
)
from trainer.step_metrics import ppo_log_line, ppo_metrics
from trainer.infra.optimizer import OptimizerStep, adamw, build_cosine_scheduler, build_policy_optimizer
from trainer.rollout_engine import RolloutRoles, create_rollout_engine, tokenize_prompts
from trainer.speed.chunked_logps import log_prob_forward
from trainer.speed.micro_batches import micro_batch_slices
from trainer.infra.stopping import BadStepGuard, StopSignal, finish_run, nonfinite_on_any_rank
from trainer.trainer_utils import (
    KL_PLACEMENTS,
    calculate_rewards,
    k3_kl,
    kl_penalty_rewards,
    load_reward_model,
    masked_mean,
    masked_var,
    place_sequence_rewards,
)
from trainer.infra.weights import config_from_args, start_weight_path, frozen_copy, load_policy, load_tokenizer


# ----------------------------------------------------------------------------- the math (chapter 8.4)
def normalize_rewards(rewards, eps=1e-8):
    """Batch reward standardisation (r - mean) / (std + eps), biased std (the learner's article, section 5.4).

    rewards: fp32 [B] -> fp32 [B]; equal rewards give 0. With rewards centred, a critic that starts at V = 0
    is an unbiased baseline, so GAE + whitening no longer favours late tokens of every answer.
    """
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


def compute_gae(token_rewards, values, mask, gamma=1.0, lam=1.0):
    """Generalized Advantage Estimation (Schulman et al. 2016; chapter 8.4.2).

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t);  A_t = delta_t + gamma * lam * A_{t+1};  R_t = A_t + V(s_t).
    Past the last real token V = 0 and A = 0, so no value or reward at a masked position is ever read.

    Args:
        token_rewards: fp32 [B, R]; values: fp32 [B, R], V(s_t) of the old critic; mask: [B, R] 0/1.
        gamma: discount in [0, 1]; lam: GAE lambda in [0, 1] (the chapter: 0.95).
            With gamma = lam = 1 and the reward on the last token, A_t = R - V(s_t).
    Returns:
        (advantages fp32 [B, R], returns fp32 [B, R]), both 0 at masked positions.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    token_rewards = token_rewards * mask
    gen_len = values.size(1)  # R
    lastgaelam = torch.zeros(values.size(0), dtype=values.dtype, device=values.device)  # [B]
    advs_rev = []
    for t in reversed(range(gen_len)):
        next_values = values[:, t + 1] if t < gen_len - 1 else torch.zeros_like(lastgaelam)  # 0 past the end
        delta = token_rewards[:, t] + gamma * next_values - values[:, t]
        next_mask = mask[:, t + 1] if t < gen_len - 1 else torch.zeros_like(lastgaelam)
        lastgaelam = delta + gamma * lam * lastgaelam * next_mask
        advs_rev.append(lastgaelam * mask[:, t])
    advantages = torch.stack(advs_rev[::-1], dim=1)  # [B, R]
    returns = (advantages + values) * mask  # [B, R]
    return advantages, returns


def masked_whiten(values, mask, eps=1e-8):
    """(x - mean) / sqrt(var + eps) with mean and (biased) variance over real tokens only; 0 where masked.

    values: fp32 [B, R]; mask: [B, R] 0/1 -> fp32 [B, R]. A single real token gives 0, not NaN.
    (Chapter 8.4.2, "优势标准化".)
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask.to(values.dtype)


def ppo_policy_loss(
    per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask, clip_epsilon=0.2, kl_coef=0.02
):
    """PPO clipped surrogate plus the k3 reference-KL penalty (Schulman et al. 2017; chapter 8.4.3, 8.6).

    ratio = exp(logp - old_logp);
    policy_loss = masked_mean(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))) + kl_coef * masked_mean(k3).

    Args:
        per_token_logps: fp32 [b, R] (requires grad); old_per_token_logps, ref_per_token_logps: fp32 [b, R];
        advantages: fp32 [b, R] (whitened GAE); mask: [b, R] 0/1.
    Returns:
        (policy_loss scalar, stats dict of detached scalars: approx_kl = 0.5 * masked_mean(log_ratio^2),
        clipfrac = share of real tokens whose ratio was outside [1 - eps, 1 + eps], kl_ref = masked_mean(k3)).
    """
    real = mask.bool()  # [b, R]
    # masked before exp: a padded position's exp could overflow and its gradient be 0 * inf = NaN
    log_ratio = torch.where(real, per_token_logps - old_per_token_logps, torch.zeros_like(per_token_logps))  # [b, R]
    ratio = torch.exp(log_ratio)
    surrogate = -advantages * ratio
    clipped_surrogate = -advantages * torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon)
    kl_ref_penalty = masked_mean(k3_kl(ref_per_token_logps, per_token_logps, real), mask)
    policy_loss = masked_mean(torch.max(surrogate, clipped_surrogate), mask) + kl_coef * kl_ref_penalty
    stats = {
        "approx_kl": 0.5 * masked_mean(log_ratio.detach() ** 2, mask),
        "clipfrac": masked_mean(((ratio.detach() - 1.0).abs() > clip_epsilon).float(), mask),
        "kl_ref": kl_ref_penalty.detach(),
    }
    return policy_loss, stats


def ppo_value_loss(values, old_values, returns, mask, cliprange_value=0.2):
    """Clipped value loss (chapter 8.4.4): 0.5 * masked_mean(max((V - R)^2, (clip(V, V_old +- c) - R)^2)).

    values: fp32 [b, R] (requires grad); old_values, returns: fp32 [b, R]; mask: [b, R] 0/1.
    Returns (value_loss scalar, value_clipfrac: share of real tokens with |V - V_old| > c, before clamping).
    """
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (values_clipped - returns) ** 2
    value_loss = 0.5 * masked_mean(torch.max(loss_unclipped, loss_clipped), mask)
    value_clipfrac = masked_mean(((values.detach() - old_values).abs() > cliprange_value).float(), mask)
    return value_loss, value_clipfrac


# ----------------------------------------------------------------------------- flags and the critic
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind PPO (Proximal Policy Optimization)")
    groups = flag_groups(parser)  # --help's groups: the chapter's flags first (infra/flags.py)
    add_common_rl_args(groups)
    # PPO's own defaults (measured on the validation split, docs/results.md): one answer per prompt, so more
    # prompts per step than GRPO; four optimizer steps per rollout at a lower rate than GRPO's one
    parser.set_defaults(batch_size=16, learning_rate=1e-5, final_norm_learning_rate=5e-3, max_steps=150)
    add_bool_flag(
        groups["rewards"],
        "--reward_norm",
        help="1 = standardise the batch's rewards before GAE (the learner's article, 5.4); 0 = raw (the chapter)",
    )
    algorithm = groups["algorithm"]
    algorithm.add_argument(
        "--critic_learning_rate", type=float, default=1e-4, action=POSITIVE, help="AdamW learning rate of the critic"
    )
    algorithm.add_argument("--gamma", type=float, default=1.0, action=UNIT_INTERVAL, help="discount of GAE (8.4.2)")
    algorithm.add_argument(
        "--lam",
        type=float,
        default=1.0,
        action=UNIT_INTERVAL,
        help="GAE lambda (the chapter: 0.95; docs/departures.md says why 1.0)",
    )
    algorithm.add_argument(
        "--clip_epsilon", type=float, default=0.2, action=POSITIVE, help="clip range of the ratio (8.4.3)"
    )
    algorithm.add_argument(
        "--vf_coef", type=float, default=0.5, action=NON_NEGATIVE, help="weight of the value loss in the total loss"
    )
    algorithm.add_argument(
        "--cliprange_value",
        type=float,
        default=0.2,
        action=POSITIVE,
        help="clip range of the new values around the old ones (8.4.4)",
    )
    algorithm.add_argument(
        "--ppo_update_iters", type=int, default=2, action=AT_LEAST_1, help="epochs over each rollout's minibatches"
    )
    algorithm.add_argument(
        "--mini_batch_size", type=int, default=8, action=AT_LEAST_1, help="rollout rows per minibatch update"
    )
    algorithm.add_argument(
        "--early_stop_kl",
        type=float,
        default=0.25,
        action=POSITIVE,
        help="stop the epochs once the approximate KL 0.5 * E[(log ratio)^2] passes this",
    )
    groups["kl"].add_argument(
        "--kl_coef", type=float, default=0.02, action=NON_NEGATIVE, help="weight of the KL to the reference (8.6)"
    )
    groups["kl"].add_argument(
        "--kl_placement",
        default="loss",
        choices=KL_PLACEMENTS,
        help="loss: kl_coef * k3 in the policy loss (the chapter); reward: -kl_coef * (logp - "
        "ref) added to every token's reward before GAE (InstructGPT, the learner's "
        "article, TRL)",
    )
    groups["memory"].add_argument(
        "--minibatch_accumulation_steps",
        "--accumulation_steps",
        type=int,
        default=1,
        action=AT_LEAST_1,
        help="minibatches whose gradients make one optimizer step (--accumulation_steps: "
        "upstream MiniMind's name for the same)",
    )
    groups["run"].add_argument("--save_weight", default="ppo", help="name of the saved weights ({name}_{hidden}.pth)")
    args = parser.parse_args(argv)
    check_common_rl_args(parser, args)
    return args


def build_critic(lm_config, actor, from_sft, device, args):
    """CriticModel initialised from the actor's SFT weights (strict except value_head.*; chapter 8.4.1), fp32 on
    ``device``: ``actor`` is the policy as loaded from ``--from_weight``, before any update (with ``--lora_rank``
    its merged weights: the base, B being 0), and with ``--lora_rank`` adapters of its own (``critic_with_adapters``).
    With ``from_sft`` False (``--from_weight none``) the critic keeps its own random weights."""
    critic = CriticModel(lm_config)
    if from_sft and not next(actor.parameters()).is_meta:  # --fsdp 1: rank 0's critic reaches the others when sharded
        critic.load_actor_state_dict({k: v.detach().float().cpu() for k, v in merged_state_dict(actor).items()})
    return critic_with_adapters(critic.to(device), args)


# ----------------------------------------------------------------------------- the loop
@dataclass
class PPORolloutBatch:
    """What ``ppo_rollout`` hands to ``ppo_update``: B prompts, one answer each (R tokens); then metrics, debug."""

    output_ids: torch.Tensor  # [B, P+R] long, prompt (left-padded) + answer (right-padded)
    full_mask: torch.Tensor  # [B, P+R] 0/1, real prompt and answer tokens
    completion_mask: torch.Tensor  # [B, R] 0/1, answer tokens through the first EOS
    old_per_token_logps: torch.Tensor  # [B, R] fp32, log pi_old of the sampled tokens (8.2)
    ref_per_token_logps: torch.Tensor  # [B, R] fp32, log pi_ref (8.6)
    old_resp_values: torch.Tensor  # [B, R] fp32, V(s_t) of the critic before the update, 0 where masked
    advantages: torch.Tensor  # [B, R] fp32, whitened GAE advantages (8.4.2)
    returns: torch.Tensor  # [B, R] fp32, GAE returns = advantages + values (before whitening)
    rewards: Optional[torch.Tensor] = None  # [B] fp32, the sequence rewards (8.3)
    reward_parts: dict = field(default_factory=dict)  # the reward function's parts, each [B]
    debug: dict = field(default_factory=dict)  # "prompts", "completions": B strings each, for --debug_mode
    rollout_metrics: dict = field(default_factory=dict)  # prompts cut to --max_seq_len, the engine's own metrics


@torch.no_grad()
def ppo_rollout(batch, roles, critic, args, device, autocast):
    """Steps 1-4 of a PPO step (chapter 8.4): rollout, rewards, reference log-probs, old values, GAE.

    ``roles``: a ``RolloutRoles`` whose engine samples from the actor; ``critic`` is the plain module (not a DDP
    wrapper: these forwards have no backward); ``autocast`` is the forwards' context under ``--dtype``. Returns a
    ``PPORolloutBatch`` of B rows.
    """
    tokenizer, ref_model = roles.tokenizer, roles.ref_model
    prompts, answers = batch["prompt"], batch["answer"]  # list[str] of length B
    prompt_ids, attention_mask, truncated = tokenize_prompts(tokenizer, prompts, args.max_seq_len, device)
    with autocast:
        rollout = roles.rollout_engine.rollout(prompt_ids, attention_mask, 1, args.max_gen_len, args.temperature)
    output_ids = rollout.output_ids  # [B, P+R]
    full_mask = rollout.attention_mask  # [B, P+R]
    completion_mask = rollout.completion_mask  # [B, R]
    gen_len = rollout.completion_ids.size(1)  # R

    reward_parts = roles.reward_fn(prompts, rollout.completions, answers, roles.reward_model, args.answer_reward_weight)
    rewards = reward_parts["rewards"].to(device)  # [B]
    critic.eval()
    log_probs = log_prob_forward(args.logprob_chunk_size)  # the chapter's forward, or its logits in chunks
    ref_per_token_logps, old_resp_values = [], []
    with autocast:
        for rows in micro_batch_slices(output_ids.size(0), args.micro_batch_size):  # --micro_batch_size M rows at once
            ref_per_token_logps.append(
                log_probs(ref_model, output_ids[rows], gen_len, full_mask[rows], args.temperature).per_token_logps
            )
            values = critic(output_ids[rows], attention_mask=full_mask[rows]).values  # [M, P+R]
            old_resp_values.append(values[:, -gen_len - 1 : -1])  # [M, R], V(s_t) before each answer token
    ref_per_token_logps = torch.cat(ref_per_token_logps)  # [B, R]
    old_resp_values = torch.cat(old_resp_values)  # [B, R]
    critic.train()

    scores = normalize_rewards(rewards) if args.reward_norm else rewards  # [B]
    token_rewards = place_sequence_rewards(scores, completion_mask)  # [B, R]
    if args.kl_placement == "reward":
        token_rewards = token_rewards + kl_penalty_rewards(
            rollout.per_token_logps, ref_per_token_logps, completion_mask, args.kl_coef
        )  # [B, R]
    advantages, returns = compute_gae(token_rewards, old_resp_values, completion_mask, args.gamma, args.lam)
    advantages = masked_whiten(advantages, completion_mask)  # [B, R]
    # the rollout correction (grpo_family.py): max(-A r, -A clip(r)) w = max(-wA r, -wA clip(r)) for its w >= 0
    importance_sampling_ratio, mismatch_metrics = rollout_correction(  # [B, R] or [B, 1], or None with "none"
        rollout.per_token_logps,
        rollout.sampling_per_token_logps,
        completion_mask,
        args.rollout_correction,
        args.rollout_correction_cap,
    )
    if importance_sampling_ratio is not None:
        advantages = advantages * importance_sampling_ratio  # [B, R]
    return PPORolloutBatch(
        output_ids=output_ids,
        full_mask=full_mask,
        completion_mask=completion_mask,
        old_per_token_logps=rollout.per_token_logps,
        ref_per_token_logps=ref_per_token_logps,
        old_resp_values=old_resp_values * completion_mask,
        advantages=advantages,
        returns=returns,
        rewards=rewards,
        reward_parts=reward_parts,
        debug={"prompts": prompts, "completions": rollout.completions},
        rollout_metrics={"truncated_prompts": truncated, **rollout.metrics, **mismatch_metrics},
    )


@dataclass(frozen=True)
class PPOLearners:
    """PPO's two trained models with their optimizers and schedules (chapter 8.4.3-8.4.4), what ``ppo_update``
    steps."""

    actor: torch.nn.Module  # the policy, its DDP wrapper when distributed
    critic: torch.nn.Module  # V(s_t), its DDP wrapper when distributed
    optimizers: tuple  # (the actor's, the critic's)
    schedulers: tuple  # (the actor's, the critic's), stepped once per rollout


def ppo_update(rollout_batch, learners, args, device, generator, autocast):
    """Step 5: ``ppo_update_iters`` epochs over shuffled minibatches of ``rollout_batch`` (chapter 8.4.3-8.4.4).

    ``learners``: ``PPOLearners``, the actor and the critic and their optimizers and schedules. Every rank draws the
    same permutation from ``generator``, and the approx-KL early stop uses the mean over ranks, so all ranks stop on the
    same minibatch. ``--minibatch_accumulation_steps`` minibatches make one optimizer step
    (``OptimizerStep.clip_and_step``: each model clipped on its own, both stepped, or neither when a gradient is NaN or
    inf on any rank); each minibatch's loss is divided by the size of its window, so every optimizer step applies a mean
    gradient; an early stop drops the window it interrupts. The schedules step once per rollout that made an optimizer
    step. ``autocast``: the forwards' context under ``--dtype``. Returns a dict of stats averaged over minibatches,
    early_stop (0/1), optimizer_steps, skipped_steps.
    """
    actor, critic, optimizers, schedulers = learners.actor, learners.critic, learners.optimizers, learners.schedulers
    batch_size = rollout_batch.output_ids.size(0)
    gen_len = rollout_batch.completion_mask.size(1)
    accumulation = args.minibatch_accumulation_steps
    kl_coef = args.kl_coef if args.kl_placement == "loss" else 0.0  # in the rewards otherwise (ppo_rollout)
    total_micro = args.ppo_update_iters * -(-batch_size // args.mini_batch_size)  # minibatches without early stop
    optimizer_step = OptimizerStep([actor, critic], optimizers, args.grad_clip, device, accumulation, total_micro)
    sums, count, optimizer_steps, skipped_steps, stop_ppo, micro = {}, 0, 0, 0, False, 0
    for _ in range(args.ppo_update_iters):
        permutation = torch.randperm(batch_size, generator=generator)
        for start in range(0, batch_size, args.mini_batch_size):
            inds = permutation[start : start + args.mini_batch_size].to(device)
            mask = rollout_batch.completion_mask[inds]  # [mb, R]
            with autocast:
                per_token_logps, aux_loss, _ = log_prob_forward(args.logprob_chunk_size)(
                    actor, rollout_batch.output_ids[inds], gen_len, rollout_batch.full_mask[inds], args.temperature
                )  # [mb, R], the chapter's mb_resp_logp; the MoE router loss
            policy_loss, stats = ppo_policy_loss(
                per_token_logps,
                rollout_batch.old_per_token_logps[inds],
                rollout_batch.ref_per_token_logps[inds],
                rollout_batch.advantages[inds],
                mask,
                args.clip_epsilon,
                kl_coef,
            )
            approx_kl = all_ranks_mean(stats["approx_kl"], device)
            if approx_kl > args.early_stop_kl:
                stop_ppo = True  # this minibatch and the rest of the epochs are skipped
                break
            with autocast:
                critic_out = critic(rollout_batch.output_ids[inds], attention_mask=rollout_batch.full_mask[inds])
            mb_resp_values = critic_out.values[:, -gen_len - 1 : -1]  # [mb, R], V(s_t) before each answer token
            value_loss, value_clipfrac = ppo_value_loss(
                mb_resp_values,
                rollout_batch.old_resp_values[inds],
                rollout_batch.returns[inds],
                mask,
                args.cliprange_value,
            )
            # both MoE load-balancing losses (0 for dense models): the actor's and the critic's own routers
            loss = policy_loss + args.vf_coef * value_loss + aux_loss + critic_out.aux_loss
            micro += 1
            (loss / optimizer_step.begin_step(micro)).backward()  # divided by its accumulation window's size
            update = optimizer_step.clip_and_step(micro)  # at the window's end: clip each model, step both
            optimizer_steps += int(update.get("skipped_update") == 0.0)
            skipped_steps += int(update.get("skipped_update") == 1.0)
            for key, value in {
                "policy_loss": policy_loss,
                "value_loss": value_loss,
                "value_clipfrac": value_clipfrac,
                "approx_kl": stats["approx_kl"],
                "clipfrac": stats["clipfrac"],
                "kl_ref": stats["kl_ref"],
            }.items():
                sums[key] = sums.get(key, 0.0) + float(value.detach())
            count += 1
        if stop_ppo:
            break
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)  # an early stop drops its partial accumulation
    if optimizer_steps:  # a rollout whose every update was skipped leaves the schedules where they were
        for scheduler in schedulers:
            scheduler.step()
    result = {k: v / max(count, 1) for k, v in sums.items()}
    result["early_stop"] = float(stop_ppo)
    result["optimizer_steps"] = float(optimizer_steps)
    result["skipped_steps"] = float(skipped_steps)
    return result


def main(argv=None, reward_fn=calculate_rewards):
    """Train with PPO: the four roles of chapter 8.1, then rollout -> reward -> GAE -> minibatch updates of actor
    and critic, step after step (8.4).
    ``reward_fn``: your own rewards, with the arguments and result of ``calculate_rewards``."""
    args = parse_args(argv)

    # 1. processes, seed and dtype
    local_rank, device = init_distributed_mode(args.device, cpu_collectives=args.fsdp and args.fsdp_cpu_offload)
    rank, world_size = rank_and_world_size()
    setup_seed(args.seed)  # identical initial weights on every rank
    train_dtype = resolve_train_dtype(args.dtype, device)  # "auto": bfloat16 on a GPU that has it, else float32
    autocast = autocast_context(device, train_dtype)  # the context of every training forward

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
    run_lock = claim_save_dir(args, "ppo", total_steps)  # one run per checkpoint files; an unfinished one kept

    # 3. the roles (8.1): actor and critic are trained; the reference and the reward model stay frozen
    lm_config = config_from_args(args)  # the architecture flags, or the model folder's config.json
    actor = load_on_rank0(  # pi_theta (--fsdp 1: read on rank 0 alone, the other ranks' copy empty until sharded)
        lambda: load_policy(lm_config, args.from_weight, args.save_dir, tokenizer, device), lm_config, args.fsdp
    )
    ref_model = None if args.lora_rank else frozen_copy(actor, args.ref_dtype)  # pi_ref: the start, in --ref_dtype
    if args.gradient_checkpointing:  # recompute each block in the backward (transformers' convention, non-reentrant)
        actor.activation_checkpointing_enable({"use_reentrant": False})
    actor, ref_model = with_adapters(actor, ref_model, args)  # --lora_rank: pi_ref = the adapters off (infra/lora.py)
    reward_model = load_reward_model(args, device, reward_model_dtype(args.reward_dtype, args.reward_device or device))
    setup_seed(args.seed + rank)  # from here on every rank draws its own samples
    critic = build_critic(lm_config, actor, args.from_weight != "none", device, args)  # V(s_t): actor + new head
    if args.gradient_checkpointing:
        base_model(critic).activation_checkpointing_enable({"use_reentrant": False})
    actor, critic, ref_model = shard_roles(args, device, train_dtype, actor, critic, ref_model)  # --fsdp 1: 1/N each
    Logger(
        f"PPO: {sum(p.numel() for p in actor.parameters()) / 1e6:.2f}M parameters, {len(train_ds)} prompts, "
        f"world size {world_size}, device {device}, dtype {train_dtype}"
    )

    # 4. optimizers
    actor_optimizer = build_policy_optimizer(
        actor, args.learning_rate, args.weight_decay, args.final_norm_learning_rate, args.optimizer
    )
    critic_optimizer = adamw(
        critic.parameters(), args.optimizer, lr=args.critic_learning_rate, weight_decay=args.weight_decay
    )
    optimizers = (actor_optimizer, critic_optimizer)  # ppo_update steps both
    ddp_actor = compile_for_training(wrap_ddp(actor, device, local_rank), args.use_compile)
    ddp_critic = compile_for_training(wrap_ddp(critic, device, local_rank), args.use_compile)
    minibatch_generator = torch.Generator().manual_seed(args.seed)  # the minibatch order, the same on every rank

    # 5. resume (--from_resume 1): weights, optimizer states, data position, random states; then both schedules
    #    at the resumed rollout (one schedule step per rollout)
    trained = {
        "model": actor,
        "optimizer": actor_optimizer,
        "critic": critic,
        "critic_optimizer": critic_optimizer,
        "minibatch_generator": minibatch_generator,
    }
    progress, engine_state = start_or_resume(args, "ppo", trained, len(loader), device, rank, world_size)
    actor_scheduler = build_cosine_scheduler(actor_optimizer, total_steps, progress["lr_schedule_step"])
    critic_scheduler = build_cosine_scheduler(critic_optimizer, total_steps, progress["lr_schedule_step"])
    schedulers = (actor_scheduler, critic_scheduler)
    learners = PPOLearners(ddp_actor, ddp_critic, optimizers, schedulers)  # what ppo_update steps

    # 6. the rollout engine (8.2), made after the resume: the SGLang engine pushes the policy to its server
    rollout_engine = create_rollout_engine(args.rollout_engine, actor, tokenizer, **rollout_engine_kwargs(args))
    rollout_engine.load_resume_state(engine_state)
    roles = RolloutRoles(rollout_engine, tokenizer, reward_fn, reward_model, ref_model)  # what the rollout uses

    # 7. the held-out evaluation (step 0, every --eval_interval steps, the end), the stop requests, the NaN guard
    evaluator = build_evaluator(args, tokenizer, device)  # None with --eval_interval 0 or a user's data
    stop_signal = StopSignal()  # from here on Ctrl-C / SIGTERM wait for a safe point
    guard = BadStepGuard(args.max_bad_steps, progress["bad_steps_in_a_row"])
    at_start = not progress["step"] and evaluation_due(evaluator, 0, total_steps, args.eval_interval)
    with gathered_weights(actor, args.fsdp_reshard_after_forward, at_start):  # --fsdp 1: whole, once per evaluation
        start_metrics = (
            {}
            if progress["step"]
            else evaluate_if_due(evaluator, actor, 0, total_steps, args.eval_interval, lambda: stop_signal.received)
        )

    # 8. metrics: metrics.jsonl (+ wandb) and the log line
    run_dir, writer = open_metrics(args, progress)
    Logger(
        f"PPO: {total_steps} steps, {args.batch_size} prompts per step, {args.ppo_update_iters} epochs of "
        f"minibatches of {args.mini_batch_size}, metrics in {run_dir}"
    )
    if start_metrics:
        writer.log({"step": 0, **start_metrics})
    step_log = StepLog(writer, total_steps, args.log_interval, ppo_log_line, start_step=progress["step"])

    # 9. the loop (a stop requested during the set-up or the step-0 evaluation ends the run before its first step)
    ddp_actor.train()
    ddp_critic.train()
    step, stop = progress["step"], stop_signal.requested(device)
    batches = [] if stop else resumable_batches(loader, batch_sampler, progress, args.epochs, total_steps)
    for step, position, batch in batches:
        # the rates this step's updates use (the schedules step at the end of ppo_update)
        learning_rates = {
            "learning_rate": float(actor_optimizer.param_groups[0]["lr"]),
            "critic_learning_rate": float(critic_optimizer.param_groups[0]["lr"]),
        }
        with gathered_weights(
            actor, args.fsdp_reshard_after_forward, frozen=[ref_model]
        ):  # --fsdp 1: the whole actor to sample from
            rollout_batch = ppo_rollout(batch, roles, critic, args, device, autocast)  # steps 1-4 (8.4)
        if args.debug_mode and step % args.debug_interval == 0:
            print_samples(
                step, rollout_batch.debug["prompts"], rollout_batch.debug["completions"], rollout_batch.reward_parts, 1
            )
        problems, skipped = nonfinite_on_any_rank(device, rewards=rollout_batch.rewards)  # GAE would spread a NaN
        if skipped:
            update = {"optimizer_steps": 0.0, "skipped_steps": float(args.ppo_update_iters)}
        else:
            update = ppo_update(
                rollout_batch,
                learners,
                args,
                device,
                minibatch_generator,
                autocast,
            )
            skipped = bool(update["skipped_steps"])
            problems = ["gradients"] if skipped else []
        metrics = ppo_metrics(rollout_batch, update, skipped)
        guard.record(step, skipped, problems)  # stops the run after --max_bad_steps skipped in a row
        rollout_engine.update_policy(actor)

        metrics = mean_over_ranks(metrics, device)
        metrics["final_norm_gain"] = full_tensor(base_model(actor).model.norm.weight).mean().item()  # sharpness
        metrics.update(gpu_memory_metrics(device))
        due = evaluation_due(evaluator, step, total_steps, args.eval_interval)
        with gathered_weights(actor, args.fsdp_reshard_after_forward, due):  # --fsdp 1: whole, once per evaluation
            metrics.update(
                evaluate_if_due(evaluator, actor, step, total_steps, args.eval_interval, lambda: stop_signal.received)
            )
        step_log.write(step, position["epoch"], metrics, learning_rates, batch["index"].tolist())
        stop = stop_signal.requested(device)  # agreed by every rank
        if step % args.save_interval == 0 or step == total_steps or stop:
            saved = checkpoint_progress(step, total_steps, position, actor_scheduler, run_dir, writer, guard)
            save_checkpoint(
                args,
                "ppo",
                lm_config,
                dict(trained, rollout_engine=rollout_engine),
                saved,
                {args.save_weight: actor, f"{args.save_weight}_critic": critic},
            )
        if stop:
            break

    finish_run(
        stop_signal, step if stop else None, resume_command(__file__, argv, world_size), evaluator, writer, run_lock
    )  # the stop line, the before/after lines; the metrics and the save folder released
    del ddp_actor, ddp_critic, learners  # free the DDP wrappers (learners holds them) while the group is alive
    shutdown_distributed()


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
