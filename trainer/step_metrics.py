"""What each RL loop logs per step: GRPO's, the agent's and PPO's metrics and their part of the log line, from the
step's rollout and updates; the masked statistics are the chapter's (``trainer_utils.masked_mean``, ``masked_var``).
Names are TRL's where TRL logs the same. The writing (metrics.jsonl, wandb, the log line's frame) is
``infra/metrics.py``.
"""

from trainer.trainer_utils import masked_mean, masked_var


def masked_std(values, mask):
    """Population standard deviation of ``values`` over positions where mask == 1 (a scalar tensor; 0 if none):
    the spread of PPO's whitened advantages (chapter 8.4.2) over real tokens, as the loop logs it."""
    return masked_var(values, mask).sqrt()


def explained_variance(values, returns, mask):
    """1 - Var[returns - values] / Var[returns] over real tokens (1 = perfect critic, <= 0 = no better than a constant):
    how much of the returns PPO's critic (chapter 8.4.4) predicts. values, returns: fp32 [B, R]; mask: [B, R] 0/1.

    NaN when the returns do not vary (e.g. every answer got the same reward): the ratio is undefined then, and a
    clamped denominator would report 1.0 or a huge negative number. Plots and README means skip NaN.
    """
    var_returns = masked_var(returns, mask)
    if var_returns.item() <= 1e-12:
        return float("nan")
    var_residual = masked_var(returns - values, mask)
    return (1.0 - var_residual / var_returns).item()


# ----------------------------------------------------------------------------- each script's step metrics and line
def mean_of_updates(updates):
    """The mean over a step's updates (dicts of floats, one per update on its rollout) of each metric, except
    ``ratio_min`` / ``ratio_max``: the smallest and largest ratio of any update (the step's spread of the ratio)."""
    update_mean = {key: sum(update[key] for update in updates) / len(updates) for key in updates[0]}
    update_mean.update(
        ratio_min=min(update["ratio_min"] for update in updates),
        ratio_max=max(update["ratio_max"] for update in updates),
    )
    return update_mean


def advantage_stats(advantages, completion_mask):
    """(mean, std) of a rollout's advantages as floats: over the answers for [N] (one per answer), over the answer
    tokens for [N, R] (a token-level estimator); the std biased."""
    if advantages.dim() == 1:
        return advantages.mean().item(), advantages.std(unbiased=False).item()
    return masked_mean(advantages, completion_mask).item(), masked_std(advantages, completion_mask).item()


def grpo_metrics(rollout_batch, updates):
    """The step's metrics: the rollout's rewards and advantages, then the mean over the step's updates of each
    update's metrics (one update per rollout: its own), except ``ratio_min`` / ``ratio_max``: the smallest and largest
    ratio of any update; names as TRL's where TRL logs the same."""
    update_mean = mean_of_updates(updates)
    kl_ref = {"kl_ref": update_mean.pop("kl_ref")} if "kl_ref" in update_mean else {}
    update_keys = ("policy_loss", "aux_loss", "ratio_mean")
    parts = rollout_batch.reward_parts
    advantages_mean, advantages_std = advantage_stats(rollout_batch.advantages, rollout_batch.completion_mask)
    return {
        "reward": rollout_batch.rewards.mean().item(),
        "rule_reward": parts["rule_rewards"].mean().item(),
        "reward_model_score": parts["reward_model_scores"].mean().item(),
        "answer_reward": parts["answer_rewards"].mean().item(),
        **({"overlong_penalty": parts["overlong_penalties"].mean().item()} if "overlong_penalties" in parts else {}),
        **kl_ref,
        "advantages_mean": advantages_mean,
        "advantages_std": advantages_std,
        **{key: update_mean.pop(key) for key in update_keys},
        "response_len": rollout_batch.rollout.completion_mask.sum(dim=1).float().mean().item(),
        **rollout_batch.metrics,
        **update_mean,
    }


def grpo_log_line(metrics, num_iterations=1):
    """GRPO's part of the log line (after the rewards): KL, advantages, loss, entropy, clipping, length, rate; with
    ``num_iterations`` > 1 also the ratio's range over the step's updates, the clipped shares and the approximate KL."""
    kl_ref = f"kl_ref {metrics['kl_ref']:.4f} | " if "kl_ref" in metrics else ""
    clip = next(
        (f" | clipped {metrics[key]:.3f}" for key in ("clip_ratio/region_mean", "cispo_clip_ratio") if key in metrics),
        "",
    )
    if num_iterations > 1:
        if "clip_ratio/low_mean" in metrics:
            clip = f" | clipped low {metrics['clip_ratio/low_mean']:.4f} high {metrics['clip_ratio/high_mean']:.4f}"
        elif "cispo_clip_ratio" in metrics:
            clip = f" | clipped {metrics['cispo_clip_ratio']:.4f}"
        clip += f" | ratio {metrics['ratio_min']:.3f}-{metrics['ratio_max']:.3f} | approx_kl {metrics['approx_kl']:.1e}"
    return (
        f"{kl_ref}adv mean {metrics['advantages_mean']:.3f} std {metrics['advantages_std']:.3f} | "
        f"policy_loss {metrics['policy_loss']:.4f} | entropy {metrics['entropy']:.3f}{clip} | "
        f"len {metrics['response_len']:.1f} | lr {metrics['learning_rate']:.2e}"
    )


AGENT_METRIC_PARTS = {
    "rule_reward": "rule_rewards",
    "reward_model_score": "reward_model_scores",
    "answer_reward": "answer_rewards",
    "call_reward": "call_rewards",
    "tag_penalty": "tag_penalties",
    "unfinished_penalty": "unfinished_penalties",
    "repetition_penalty": "repetition_penalties",
    "accuracy": "accuracy",
}  # metric name -> reward_fn key


def agent_metrics(rollout_batch, updates):
    """The step's metrics: the rewards and their parts, accuracy, tool use, advantages, then the mean of the
    updates' metrics (``ratio_min`` / ``ratio_max``: the extremes over the updates)."""
    update_mean = mean_of_updates(updates)
    parts = rollout_batch.reward_parts
    advantages_mean, advantages_std = advantage_stats(rollout_batch.advantages, rollout_batch.completion_mask)
    return {
        "reward": rollout_batch.rewards.mean().item(),
        **{name: parts[key].mean().item() for name, key in AGENT_METRIC_PARTS.items()},
        "advantages_mean": advantages_mean,
        "advantages_std": advantages_std,
        "response_len": rollout_batch.rollout.completion_mask.sum(dim=1).float().mean().item(),
        **rollout_batch.metrics,
        **update_mean,
    }


def agent_log_line(metrics):
    """The agent's part of the log line (after the rewards): accuracy, tool use, loss, KL, entropy, length, rate."""
    kl_ref = f"kl_ref {metrics['kl_ref']:.4f} | " if "kl_ref" in metrics else ""
    return (
        f"acc {metrics['accuracy']:.2f} | calls {metrics['tool_call_share']:.2f} valid "
        f"{metrics['valid_call_share']:.2f} | turns {metrics['turns']:.2f} | {kl_ref}"
        f"policy_loss {metrics['policy_loss']:.4f} | entropy {metrics['entropy']:.3f} | "
        f"len {metrics['response_len']:.1f} | lr {metrics['learning_rate']:.2e}"
    )


def ppo_metrics(rollout_batch, update, skipped):
    """The step's metrics: reward parts, advantage and critic statistics, lengths, and ``update``'s stats."""
    mask = rollout_batch.completion_mask  # [B, R]
    return {
        "reward": rollout_batch.rewards.mean().item(),
        "rule_reward": rollout_batch.reward_parts["rule_rewards"].mean().item(),
        "reward_model_score": rollout_batch.reward_parts["reward_model_scores"].mean().item(),
        "answer_reward": rollout_batch.reward_parts["answer_rewards"].mean().item(),
        "advantages_mean": masked_mean(rollout_batch.advantages, mask).item(),
        "advantages_std": masked_std(rollout_batch.advantages, mask).item(),
        "explained_variance": explained_variance(rollout_batch.old_resp_values, rollout_batch.returns, mask),
        "response_len": mask.sum(dim=1).float().mean().item(),
        **rollout_batch.rollout_metrics,  # truncated_prompts first
        "skipped_update": float(skipped),
        **update,
    }


def ppo_log_line(metrics):
    """PPO's part of the log line (after the rewards): KLs, clipping, critic, length, learning rates."""
    return (
        f"kl_ref {metrics.get('kl_ref', 0.0):.4f} | approx_kl {metrics.get('approx_kl', 0.0):.4f} | "
        f"clipfrac {metrics.get('clipfrac', 0.0):.3f} | value_loss {metrics.get('value_loss', 0.0):.4f} | "
        f"explained_var {metrics['explained_variance']:.3f} | len {metrics['response_len']:.1f} | "
        f"lr {metrics['learning_rate']:.2e}/{metrics['critic_learning_rate']:.2e}"
    )
