"""GRPO for a MiniMind policy (chapter 8.5): rollout -> reward -> group advantage -> CISPO / GRPO loss.

One step, in chapter order:
  1. rollout: each of the B prompts is repeated num_generations (G) times in place (P0,P0,..,P1,P1,..)
     and sampled by the rollout engine, which also records old_per_token_logps (8.2);
  2. rewards [B*G] = rule reward + reward-model score + answer reward (8.3, ``calculate_rewards``);
  3. advantages [B*G] = (r - group mean) / (group std + 1e-4) (8.5.1, ``grpo_advantages``);
  4. ref_per_token_logps from the frozen reference model, per_token_logps from the policy (with grad);
  5. loss: CISPO (default) or the clipped GRPO surrogate, plus beta * k3 KL to the reference
     (8.5.2, 8.6, ``grpo_loss``), then backward and the update, written out in ``main``: grad clip, AdamW step
     (the final RMSNorm gain in a group of its own that learns the output's sharpness, ``build_policy_optimizer``),
     cosine schedule, or no step on any rank when a value was NaN;
  6. one log line + metrics.jsonl (+ wandb), atomic checkpoints, and the held-out evaluation at step 0,
     every ``--eval_interval`` steps and at the end (``trainer/evaluation.py``).

``main`` builds the roles of chapter 8.1 (policy, frozen reference, reward model) and runs the loop.

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
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `python trainer/x.py` from any folder imports this checkout's packages

import copy

import torch

from trainer.checkpoints import load_policy
from trainer.distributed import any_rank, compile_for_training, setup_seed, shutdown_distributed, wrap_ddp
from trainer.flags import add_bool_flag, add_common_rl_args, check_common_rl_args
from trainer.optimizer import (
    accumulation_window_size, build_cosine_scheduler, build_policy_optimizer, project_scale_only_gradients,
)
from trainer.rl_harness import RLRun, nonfinite_parts
from trainer.rollout_engine import compute_group_per_token_logps, compute_per_token_logps, tokenize_prompts
from trainer.trainer_utils import calculate_rewards, k3_kl, load_reward_model, masked_mean

LOSS_TYPES = ("cispo", "grpo")


# ----------------------------------------------------------------------------- the math (chapter 8.5)
def grpo_advantages(rewards, num_generations, eps=1e-4):
    """Group-relative advantages (chapter 8.5.1; Shao et al. 2024, DeepSeekMath, eq. 3).

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps), with the biased (population) std of each group.

    Args:
        rewards: fp32 [B*G], each prompt's G rewards adjacent (P0,P0,..,P1,P1,..).
        num_generations: G >= 2.
    Returns:
        advantages [B*G] in the dtype of ``rewards``; a group of equal rewards gives exactly 0, because the
        group mean and std are computed in fp64 (the mean of G equal fp32 values is then exact, the std 0).
    Raises:
        ValueError: if rewards.numel() is not a multiple of num_generations.
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {num_generations}")
    # fp64 statistics: an fp32 mean of equal values can miss them by one ulp, and ulp / (ulp + eps) is not small
    rewards_fp64 = rewards.double()  # [B*G]
    grouped_rewards = rewards_fp64.view(-1, num_generations)  # [B, G]
    mean_r = grouped_rewards.mean(dim=1).repeat_interleave(num_generations)  # [B*G]
    std_r = grouped_rewards.std(dim=1, unbiased=False).repeat_interleave(num_generations)  # [B*G]
    return ((rewards_fp64 - mean_r) / (std_r + eps)).to(rewards.dtype)  # [B*G]


def sequence_mean_loss(per_token_loss, completion_mask):
    """Mean over each sequence's masked tokens, then mean over sequences (chapter 8.5.2).

    per_token_loss: fp32 [N, R]; completion_mask: [N, R] 0/1 -> scalar. Masked entries never enter the
    sum of the loss value (even inf or huge values there are dropped), and an empty row counts as 0.
    """
    mask = completion_mask.bool()
    per_token_loss = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    return masked_mean(per_token_loss, mask, dim=1).mean()


def grpo_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, completion_mask,
              loss_type="cispo", epsilon=0.2, epsilon_high=5.0, beta=0.1):
    """Policy loss of GRPO with the CISPO or clipped-surrogate objective and a k3 KL penalty (chapter 8.5.2, 8.6).

    ratio = exp(per_token_logps - old_per_token_logps), per_token_kl = k3(ref, logp).
      cispo: per_token_loss = -(sg[min(ratio, epsilon_high)] * A * logp - beta * per_token_kl)
             (MiniMax-M1 report 2025, CISPO: the clipped ratio is a detached weight on logp's gradient);
      grpo:  per_token_loss = -(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) - beta * per_token_kl)
             (PPO's clipped surrogate, Schulman et al. 2017).
    The loss is ``sequence_mean_loss(per_token_loss, completion_mask)``.

    Args:
        per_token_logps: fp32 [N, R], log pi_theta of the completion tokens (requires grad).
        old_per_token_logps: fp32 [N, R], log pi_old from the rollout (no grad).
        ref_per_token_logps: fp32 [N, R], log pi_ref of the frozen reference (no grad).
        advantages: fp32 [N], one per sequence, broadcast over its tokens.
        completion_mask: [N, R] 0/1.
    Returns:
        (policy_loss scalar, per_token_kl [N, R], ratio [N, R]) -- the last two detached, for logging.
    Raises:
        ValueError: for an unknown loss_type.
    """
    mask = completion_mask.bool()  # [N, R]
    per_token_kl = k3_kl(ref_per_token_logps, per_token_logps, mask)  # [N, R], 0 where masked
    # the log-ratio is masked before exp: a padded position's exp could overflow and its gradient be 0 * inf
    log_ratio = torch.where(mask, per_token_logps - old_per_token_logps, torch.zeros_like(per_token_logps))
    ratio = torch.exp(log_ratio)  # [N, R]
    advantages = advantages.unsqueeze(1)  # [N, 1]
    if loss_type == "cispo":
        clamped_ratio = torch.clamp(ratio, max=epsilon_high).detach()  # [N, R]
        per_token_loss = -(clamped_ratio * advantages * per_token_logps - beta * per_token_kl)
    elif loss_type == "grpo":
        clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)  # [N, R]
        per_token_loss1 = ratio * advantages
        per_token_loss2 = clipped_ratio * advantages
        per_token_loss = -(torch.min(per_token_loss1, per_token_loss2) - beta * per_token_kl)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
    policy_loss = sequence_mean_loss(per_token_loss, completion_mask)
    return policy_loss, per_token_kl.detach(), ratio.detach()


# ----------------------------------------------------------------------------- flags
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind GRPO (Group Relative Policy Optimization)")
    add_common_rl_args(parser)
    parser.add_argument("--save_weight", default="grpo", help="name of the saved weights ({name}_{hidden}.pth)")
    parser.add_argument("--num_generations", type=int, default=6, help="G, answers sampled per prompt")
    parser.add_argument("--accumulation_steps", type=int, default=1,
                        help="steps (rollouts) whose gradients make one optimizer step")
    parser.add_argument("--loss_type", default="cispo", help=f"one of {', '.join(LOSS_TYPES)}")
    parser.add_argument("--beta", type=float, default=0.1, help="weight of the k3 KL to the reference")
    parser.add_argument("--epsilon", type=float, default=0.2, help="clip range of the grpo loss")
    parser.add_argument("--epsilon_high", type=float, default=5.0, help="upper clamp of the CISPO ratio weight")
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
    if args.epsilon_high <= 1:
        parser.error(f"--epsilon_high must be > 1, got {args.epsilon_high}")
    if args.epsilon <= 0:
        parser.error(f"--epsilon must be > 0, got {args.epsilon}")
    if args.beta < 0:
        parser.error(f"--beta must be >= 0, got {args.beta}")
    return args


# ----------------------------------------------------------------------------- the loop
def rollout_per_token_logps(model, rollout, args, return_aux_loss=False):
    """Log-probs fp32 [B*G, R] of a rollout's completions under ``model`` (chapter 8.2). ``--shared_prefix 1``
    runs each prompt once for its G answers (``compute_group_per_token_logps``), 0 gives every answer its own
    copy of the prompt (``compute_per_token_logps``); both give the same log-probs (tests/test_forward_layouts.py).
    With ``return_aux_loss``, (log-probs, MoE router loss)."""
    if args.shared_prefix:
        num_generations, prompt_len = args.num_generations, rollout.prompt_mask.size(1)
        prompt_ids = rollout.output_ids[::num_generations, :prompt_len]  # [B, P], one row per group
        prompt_mask = rollout.prompt_mask[::num_generations]  # [B, P]
        return compute_group_per_token_logps(model, prompt_ids, prompt_mask, rollout.completion_ids,
                                             rollout.completion_mask, num_generations, args.temperature,
                                             return_aux_loss)
    return compute_per_token_logps(model, rollout.output_ids, rollout.completion_ids.size(1), rollout.attention_mask,
                                   args.temperature, return_aux_loss)


def grpo_step(batch, model, ref_model, rollout_engine, reward_fn, reward_model, tokenizer, args, device, autocast):
    """One turn of the RLHF loop (chapter 8.1) with GRPO (chapter 8.5): rollout, rewards, group advantages,
    loss. Returns (loss to backpropagate, metrics dict, debug dict); the loop divides the loss by the size of
    its gradient-accumulation window (``accumulation_window_size``).

    ``model`` is what the gradient flows through (the DDP wrapper when distributed); ``reward_fn`` is
    ``calculate_rewards`` (chapter 8.3) or a replacement with the same arguments and result; ``autocast`` is the
    forwards' context under ``--dtype`` (``autocast_context``).
    """
    prompts, answers = batch["prompt"], batch["answer"]  # list[str] of length B
    prompt_ids, attention_mask, truncated = tokenize_prompts(tokenizer, prompts, args.max_seq_len, device)

    # 1. rollout: B*G completions and their old log-probs (8.2)
    with autocast:
        rollout = rollout_engine.rollout(prompt_ids, attention_mask, args.num_generations, args.max_gen_len,
                                         args.temperature)
    completion_mask = rollout.completion_mask  # [B*G, R]
    old_per_token_logps = rollout.per_token_logps.detach()  # [B*G, R]

    # 2. rewards (8.3)
    repeated_prompts = [p for p in prompts for _ in range(args.num_generations)]
    repeated_answers = [a for a in answers for _ in range(args.num_generations)]
    reward_parts = reward_fn(repeated_prompts, rollout.completions, repeated_answers, reward_model,
                             args.answer_reward_weight)
    rewards = reward_parts["rewards"].to(device)  # [B*G]

    # 3. group-relative advantages (8.5.1)
    advantages = grpo_advantages(rewards, args.num_generations)  # [B*G]

    # 4. reference and current log-probs (fp32 whatever --dtype is)
    with torch.no_grad(), autocast:
        ref_per_token_logps = rollout_per_token_logps(ref_model, rollout, args)  # [B*G, R]
    with autocast:
        per_token_logps, aux_loss = rollout_per_token_logps(model, rollout, args, return_aux_loss=True)  # [B*G, R]

    # 5. CISPO / GRPO loss with the k3 KL penalty (8.5.2, 8.6)
    policy_loss, per_token_kl, ratio = grpo_loss(
        per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, completion_mask,
        args.loss_type, args.epsilon, args.epsilon_high, args.beta,
    )
    loss = policy_loss + aux_loss  # the loop divides by the size of its accumulation window

    metrics = {
        "reward": rewards.mean().item(),
        "rule_reward": reward_parts["rule_rewards"].mean().item(),
        "reward_model_score": reward_parts["reward_model_scores"].mean().item(),
        "answer_reward": reward_parts["answer_rewards"].mean().item(),
        "kl_ref": masked_mean(per_token_kl, completion_mask).item(),
        "advantages_mean": advantages.mean().item(),
        "advantages_std": advantages.std(unbiased=False).item(),
        "policy_loss": policy_loss.item(),
        "aux_loss": float(aux_loss),
        "ratio_mean": masked_mean(ratio, completion_mask).item(),
        "response_len": completion_mask.sum(dim=1).float().mean().item(),
        "truncated_prompts": truncated,
        **rollout.metrics,
    }
    debug = {"prompts": repeated_prompts, "completions": rollout.completions, "reward_parts": reward_parts}
    return loss, metrics, debug


def grpo_log_line(metrics):
    """GRPO's part of the log line (after the rewards): KL, advantages, loss, length, learning rate."""
    return (f"kl_ref {metrics['kl_ref']:.4f} | "
            f"adv mean {metrics['advantages_mean']:.3f} std {metrics['advantages_std']:.3f} | "
            f"policy_loss {metrics['policy_loss']:.4f} | len {metrics['response_len']:.1f} | "
            f"lr {metrics['learning_rate']:.2e}")


def main(argv=None, reward_fn=calculate_rewards, run_class=RLRun):
    """Train with GRPO: the roles of chapter 8.1 without a critic, then rollout -> reward -> group advantage ->
    loss -> update, step after step (8.5). ``reward_fn`` replaces the chapter's rewards and ``run_class`` the
    harness (tests)."""
    args = parse_args(argv)
    run = run_class.build(args, "grpo", __file__, argv)  # processes, seed, tokenizer, prompts, evaluator
    # the roles (chapter 8.1): the policy is trained, the reference and the reward model stay frozen
    model = load_policy(run.lm_config, args, run.tokenizer, run.device)  # pi_theta, from --from_weight
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # pi_ref: the starting policy
    reward_model = load_reward_model(args, run.device, run.reward_dtype)  # None with --reward_model_path none
    setup_seed(args.seed + run.rank)  # from here on every rank samples its own answers
    optimizer = build_policy_optimizer(model, args.learning_rate, args.weight_decay, args.final_norm_learning_rate)
    num_updates = -(-run.total_steps // args.accumulation_steps)  # ceil: the last window may be shorter
    scheduler = build_cosine_scheduler(optimizer, num_updates)
    ddp_model = compile_for_training(wrap_ddp(model, run.device, run.local_rank), args.use_compile)
    run.start(model, {"model": model, "optimizer": optimizer, "scheduler": scheduler}, {args.save_weight: model},
              f"GRPO: {run.total_steps} steps, {args.batch_size} prompts x {args.num_generations} answers per "
              f"step, loss {args.loss_type}", grpo_log_line)
    ddp_model.train()
    problems = []  # names of what was non-finite since the last optimizer step
    for step, batch in run.batches():
        learning_rate = optimizer.param_groups[0]["lr"]  # the rate this step's update uses (read before stepping)
        loss, metrics, debug = grpo_step(batch, ddp_model, ref_model, run.rollout_engine, reward_fn, reward_model,
                                         run.tokenizer, args, run.device, run.autocast)
        run.print_samples_if_due(step, debug["prompts"], debug["completions"], debug["reward_parts"],
                                 args.num_generations)
        problems += nonfinite_parts(rewards=debug["reward_parts"]["rewards"], loss=loss)
        (loss / accumulation_window_size(step, run.total_steps, args.accumulation_steps)).backward()
        if step % args.accumulation_steps == 0 or step == run.total_steps:  # the update
            project_scale_only_gradients(optimizer)  # the final norm gain learns one number (its own group)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), args.grad_clip))
            problems += nonfinite_parts(gradients=grad_norm)
            skipped = any_rank(bool(problems), run.device)  # a NaN or inf on any rank: no rank updates
            if not skipped:
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            metrics.update(grad_norm=grad_norm, skipped_update=float(skipped))
            run.guard.record(step, skipped, problems)
            problems = []
            run.rollout_engine.update_policy(model)
        run.log(step, metrics, {"learning_rate": learning_rate})
        run.save_if_due(step)
    run.close()
    del ddp_model  # free the DDP wrapper while the process group is alive (see shutdown_distributed)
    shutdown_distributed()


if __name__ == "__main__":
    main()
