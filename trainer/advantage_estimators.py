"""Advantage estimators beside GRPO's group baseline (8.5.1), and DAPO's batch-side techniques.

Every estimator turns one rollout's rewards into the advantages the policy loss weighs each answer token by; the
loss (8.5.2, ``grpo_family.py``) is the same for all of them. ``--advantage_estimator`` picks one:

    grpo                   (r_i - mean of the group) / (std of the group + 1e-4)        [B*G]   the chapter's, 8.5.1
    rloo                   r_i - mean of the other G - 1 rewards of the group            [B*G]   RLOO
    opo                    r_i - the group's length-weighted mean reward                  [B*G]   OPO
    reinforce_pp           token returns of rewards holding -beta * k1 per token,        [B*G, R] REINFORCE++
                           whitened over every answer token of the batch
    reinforce_pp_baseline  (r_i - mean of the group), whitened over the batch's tokens   [B*G]   REINFORCE++-baseline

Sources: RLOO (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et al. 2024), TRL
1.16's ``RLOOTrainer``; OPO (Hao et al. 2025, arXiv:2505.23585), verl's ``compute_opo_outcome_advantage``;
REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262), verl's
``compute_reinforce_plus_plus_outcome_advantage`` / ``..._baseline_outcome_advantage``. The statistics over "the
batch" are over every process's answers (all_reduce), as the peers compute them on the whole gathered batch.

``--kl_placement reward`` puts the KL to the reference into the rewards (``trainer_utils.kl_penalty_rewards``, k1
per token, as PPO's): per token for ``reinforce_pp``, summed over each answer for the sequence estimators (TRL's
RLOO subtracts beta times the summed k1 from each reward).

DAPO (Yu et al. 2025, arXiv:2503.14476) adds two techniques on the batch side, here too: the soft overlong
punishment (``overlong_penalty``) and dynamic sampling (``dynamic_sampling``: groups whose G rewards agree carry
no gradient and are replaced by new prompts' groups; ``train_grpo.grpo_rollout`` calls it).
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from trainer.infra.distributed import any_rank
from trainer.infra.flags import add_bool_flag
from trainer.trainer_utils import KL_PLACEMENTS, grpo_advantages, kl_penalty_rewards, place_sequence_rewards

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "opo", "reinforce_pp", "reinforce_pp_baseline")
TOKEN_LEVEL_ESTIMATORS = ("reinforce_pp",)  # advantages [B*G, R], one per token
RLOO_NORMALIZE_EPS = 1e-4  # TRL's RLOOTrainer: (A - mean) / (std + 1e-4)
WHITEN_EPS = 1e-8  # verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


@dataclass(frozen=True)
class AdvantageConfig:
    """The settings of ``compute_advantages``, built once from the flags (``build_advantage_config``)."""

    estimator: str = "grpo"
    num_generations: int = 6  # G
    scale_rewards: str = "group"  # grpo: the group's std, the batch's, or none (Dr. GRPO)
    normalize_advantages: bool = False  # rloo: (A - batch mean) / (batch std + 1e-4), TRL's
    gamma: float = 1.0  # reinforce_pp: the discount of the token returns
    kl_placement: str = "loss"  # "reward": -beta * k1 in the rewards, no KL term in the loss
    beta: float = 0.1  # the KL's weight


# ----------------------------------------------------------------------------- statistics over every process
def global_sums(*values):
    """The float64 sums of ``values`` (tensors or floats, on one device) over every process, as a [K] tensor; the
    values themselves when not distributed. One all_reduce for all of them (on the values' device: gloo or NCCL)."""
    device = next((v.device for v in values if torch.is_tensor(v)), torch.device("cpu"))
    sums = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])  # [K]
    if dist.is_initialized():
        dist.all_reduce(sums)
    return sums


def global_masked_whiten(values, mask, eps=WHITEN_EPS):
    """verl's ``masked_whiten`` over every process's tokens: (x - mean) / sqrt(var + eps), mean and variance over the
    entries where ``mask`` is 1, the variance unbiased (times count / (count - 1), verl's ``masked_var``).

    values: [N, R] or [N]; mask: the same shape, 0/1 (a per-row weight is allowed: a row's token count). Returns
    float64 of values' shape; 0 where the mask is 0. Statistics in float64 (verl's are in the values' dtype: the two
    agree to about 1e-7 in fp32). One token in the whole batch: the variance is 0 and the result is 0, not NaN.
    """
    values, weights = values.double(), mask.double()
    total, count = global_sums((values * weights).sum(), weights.sum())
    mean = total / count.clamp(min=1)
    (squares,) = global_sums((((values - mean) ** 2) * weights).sum())
    variance = squares / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(variance + eps) * (weights > 0)


# ----------------------------------------------------------------------------- the estimators
def rloo_advantages(rewards, num_generations):
    """RLOO's leave-one-out advantage A_i = r_i - (sum of the group - r_i) / (G - 1) (Kool et al. 2019; TRL's
    ``RLOOTrainer``, verl's ``compute_rloo_outcome_advantage``): each answer's baseline is the mean of its group's
    other answers, so it is independent of the answer and the estimate unbiased.

    rewards: fp32 [B*G], each prompt's G rewards adjacent -> advantages [B*G] in the rewards' dtype (float64
    statistics: a group of equal rewards gives exactly 0). Raises ValueError when G < 2 or rewards.numel() is not a
    multiple of G.
    """
    if num_generations < 2 or rewards.numel() % num_generations != 0:
        raise ValueError(f"rloo needs groups of G >= 2 rewards, got {rewards.numel()} rewards with G {num_generations}")
    grouped_rewards = rewards.double().view(-1, num_generations)  # [B, G]
    baseline = (grouped_rewards.sum(dim=1, keepdim=True) - grouped_rewards) / (num_generations - 1)  # [B, G]
    return (grouped_rewards - baseline).view(-1).to(rewards.dtype)  # [B*G]


def opo_advantages(rewards, num_generations, completion_mask):
    """OPO's baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"; verl's
    ``compute_opo_outcome_advantage``): A_i = r_i - sum_j L_j r_j / sum_j L_j over the answers j of i's group, L_j
    the answer's tokens (the variance-optimal baseline when the gradient's size grows with the length); no division.

    rewards: fp32 [B*G]; completion_mask [B*G, R] 0/1 -> advantages [B*G] in the rewards' dtype (float64 statistics).
    A group without tokens has baseline 0.
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {num_generations}")
    grouped_rewards = rewards.double().view(-1, num_generations)  # [B, G]
    lengths = completion_mask.sum(dim=1).double().view(-1, num_generations)  # [B, G]
    baseline = (lengths * grouped_rewards).sum(dim=1, keepdim=True) / lengths.sum(dim=1, keepdim=True).clamp(min=1)
    return (grouped_rewards - baseline).view(-1).to(rewards.dtype)  # [B*G]


def normalize_over_batch(advantages, eps=RLOO_NORMALIZE_EPS):
    """TRL's ``normalize_advantages``: (A - mean) / (std + eps) over every process's answers, the std unbiased
    (torch's default, as TRL's ``advantages.std()``). advantages [N] -> [N] in their dtype."""
    values = advantages.double()
    total, count = global_sums(values.sum(), float(values.numel()))
    mean = total / count
    (squares,) = global_sums(((values - mean) ** 2).sum())
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    return ((values - mean) / (std + eps)).to(advantages.dtype)


def discounted_returns(token_rewards, completion_mask, gamma=1.0):
    """G_t = r_t + gamma * G_t', t' the next token of the answer whose mask is 1 (REINFORCE++'s return).

    Tokens with mask 0 are not the model's (padding after the EOS; a tool's reply in the agent script): their
    rewards are ignored, they are not discounted over, and the return carries across them to the model's earlier
    tokens. On a mask of ones then zeros this is verl's loop, which resets the return at every masked token.

    token_rewards: fp32 [N, R]; completion_mask: [N, R] 0/1 -> returns fp32 [N, R], 0 where masked.
    """
    mask = completion_mask.bool()  # [N, R]
    rewards = torch.where(mask, token_rewards.float(), torch.zeros_like(token_rewards, dtype=torch.float32))
    returns = torch.zeros_like(rewards)  # [N, R]
    running = torch.zeros(rewards.size(0), dtype=rewards.dtype, device=rewards.device)  # [N]
    for t in reversed(range(rewards.size(1))):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def reinforce_pp_advantages(token_rewards, completion_mask, gamma=1.0):
    """REINFORCE++ (Hu et al. 2025, eq. 7-9; verl's ``compute_reinforce_plus_plus_outcome_advantage``): the token
    returns (``discounted_returns``) whitened over every answer token of the batch (``global_masked_whiten``).

    token_rewards: fp32 [N, R], the answer's reward on its last token plus -beta * k1 on every token
    (``--kl_placement reward``); completion_mask [N, R] 0/1. Returns (advantages fp32 [N, R], returns fp32 [N, R]),
    both 0 where masked.
    """
    returns = discounted_returns(token_rewards, completion_mask, gamma)  # [N, R]
    advantages = global_masked_whiten(returns, completion_mask).float()  # [N, R]
    return advantages, returns


def reinforce_pp_baseline_advantages(rewards, num_generations, completion_mask):
    """REINFORCE++-baseline (Hu et al. 2025; verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``): the
    group mean subtracted from each answer's reward, then whitened over every answer token of the batch (each
    answer weighs as many times as it has tokens), one value per answer.

    rewards: fp32 [B*G] (with ``--kl_placement reward`` already holding -beta * the answer's summed k1);
    completion_mask [B*G, R] 0/1 -> advantages fp32 [B*G]; a row without tokens gets 0.
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {num_generations}")
    grouped_rewards = rewards.double().view(-1, num_generations)  # [B, G]
    centered = (grouped_rewards - grouped_rewards.mean(dim=1, keepdim=True)).view(-1)  # [B*G]
    token_counts = completion_mask.sum(dim=1).double()  # [B*G], each answer's weight in the whitening
    return global_masked_whiten(centered, token_counts).float()  # [B*G]


def compute_advantages(rewards, completion_mask, config, old_per_token_logps=None, ref_per_token_logps=None):
    """The advantages of one rollout under ``config`` (an ``AdvantageConfig``).

    rewards: fp32 [B*G], the task's rewards (8.3); completion_mask: [B*G, R] 0/1, the loss's tokens;
    old_per_token_logps, ref_per_token_logps: fp32 [B*G, R], read only with ``kl_placement`` "reward".
    Returns (advantages: fp32 [B*G], or [B*G, R] for ``reinforce_pp``; kl_rewards: fp32 [B*G], each answer's summed
    KL penalty -beta * sum_t k1_t, zeros with ``kl_placement`` "loss"). Raises ValueError for an unknown estimator
    or a reward placement without reference log-probs.
    """
    kl_token_rewards = torch.zeros(completion_mask.shape, dtype=torch.float32, device=rewards.device)  # [B*G, R]
    if config.kl_placement == "reward":
        if ref_per_token_logps is None:
            raise ValueError("--kl_placement reward needs the reference's log-probs (--beta > 0)")
        kl_token_rewards = kl_penalty_rewards(old_per_token_logps, ref_per_token_logps, completion_mask, config.beta)
    kl_rewards = kl_token_rewards.sum(dim=1)  # [B*G]
    G = config.num_generations
    if config.estimator == "reinforce_pp":
        token_rewards = place_sequence_rewards(rewards, completion_mask) + kl_token_rewards  # [B*G, R]
        return reinforce_pp_advantages(token_rewards, completion_mask, config.gamma)[0], kl_rewards
    total_rewards = rewards + kl_rewards if config.kl_placement == "reward" else rewards  # [B*G]
    if config.estimator == "grpo":
        return grpo_advantages(total_rewards, G, scale_rewards=config.scale_rewards), kl_rewards
    if config.estimator == "rloo":
        advantages = rloo_advantages(total_rewards, G)  # [B*G]
        return (normalize_over_batch(advantages) if config.normalize_advantages else advantages), kl_rewards
    if config.estimator == "opo":
        return opo_advantages(total_rewards, G, completion_mask), kl_rewards
    if config.estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(total_rewards, G, completion_mask), kl_rewards
    raise ValueError(f"unknown advantage estimator {config.estimator!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")


# ----------------------------------------------------------------------------- the flags
ESTIMATOR_FLAGS = {  # the flags each estimator reads (an estimator refuses a flag it would ignore)
    "grpo": ("scale_rewards",),
    "rloo": ("normalize_advantages",),
    "opo": (),
    "reinforce_pp": ("gamma",),
    "reinforce_pp_baseline": (),
}
ESTIMATOR_DEFAULTS = {"scale_rewards": "group", "normalize_advantages": 0, "gamma": 1.0}


def add_estimator_args(parser):
    """``--advantage_estimator`` and the flags of its estimators, ``--kl_placement``; unset flags stay None and
    take the estimator's default in ``build_advantage_config``. ``parser`` may be an argparse group."""
    parser.add_argument(
        "--advantage_estimator",
        default="grpo",
        choices=ADVANTAGE_ESTIMATORS,
        help="grpo: the group's mean and std (the chapter's); rloo: leave-one-out; opo: length-weighted group mean; "
        "reinforce_pp: token returns whitened over the batch; reinforce_pp_baseline: group mean, whitened over the "
        "batch (docs/estimators.md)",
    )
    parser.add_argument(
        "--scale_rewards",
        default=None,
        choices=("group", "batch", "none"),
        help="grpo: the advantage's scale, the group's std (group, the chapter's), the batch's, or none (Dr. GRPO)",
    )
    parser.add_argument(
        "--normalize_advantages",
        type=int,
        default=None,
        choices=(0, 1),
        help="rloo: 1 = (A - mean) / (std + 1e-4) over the whole batch (TRL's; 0 default)",
    )
    parser.add_argument("--gamma", type=float, default=None, help="reinforce_pp: discount of the token returns (1.0)")
    parser.add_argument(
        "--kl_placement",
        default=None,
        choices=KL_PLACEMENTS,
        help="loss: beta * k3 in the policy loss (the chapter's; default except reinforce_pp); reward: "
        "-beta * (logp - ref) in the rewards, per token or summed per answer (REINFORCE++'s default; needs --beta > 0)",
    )


def build_advantage_config(args):
    """``AdvantageConfig`` from the parsed flags. Raises ValueError naming the flag: one the chosen estimator does not
    read, ``--gamma`` outside (0, 1], ``--kl_placement reward`` without a reference (``--beta 0``), and a token-level
    estimator with ``--loss_type vespo`` (its weight reads the sign of each answer's advantage)."""
    estimator = args.advantage_estimator
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage_estimator {estimator!r} is unknown; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    for flag in ESTIMATOR_DEFAULTS:
        if getattr(args, flag) is not None and flag not in ESTIMATOR_FLAGS[estimator]:
            reads = ", ".join("--" + f for f in ESTIMATOR_FLAGS[estimator]) or "none of them"
            raise ValueError(
                f"--{flag} is not read by --advantage_estimator {estimator} (it reads {reads}): drop --{flag}"
            )
    value = {
        flag: ESTIMATOR_DEFAULTS[flag] if getattr(args, flag) is None else getattr(args, flag)
        for flag in ESTIMATOR_DEFAULTS
    }
    if not 0 < value["gamma"] <= 1:
        raise ValueError(f"--gamma must be in (0, 1], got {value['gamma']}")
    kl_placement = args.kl_placement or ("reward" if estimator == "reinforce_pp" else "loss")
    if kl_placement == "reward" and not args.beta:
        raise ValueError(
            f"--kl_placement reward{' (reinforce_pp default)' if not args.kl_placement else ''} puts "
            f"-beta * (logp - ref) into the rewards and needs a reference: set --beta > 0, or "
            f"--kl_placement loss --beta 0 for no KL at all"
        )
    if estimator in TOKEN_LEVEL_ESTIMATORS and args.loss_type == "vespo":
        raise ValueError(
            f"--advantage_estimator {estimator} gives one advantage per token; --loss_type vespo weighs "
            f"each answer by the sign of its one advantage: choose another --loss_type"
        )
    return AdvantageConfig(
        estimator=estimator,
        num_generations=args.num_generations,
        scale_rewards=value["scale_rewards"],
        normalize_advantages=bool(value["normalize_advantages"]),
        gamma=value["gamma"],
        kl_placement=kl_placement,
        beta=args.beta,
    )


def add_dapo_sampling_args(parser):
    """DAPO's batch-side flags (train_grpo.py): dynamic sampling and its bound, the soft overlong punishment."""
    add_bool_flag(
        parser,
        "--dynamic_sampling",
        help="1: groups whose G rewards are all equal are dropped and new prompts drawn until the batch is full "
        "(DAPO; every rank draws as many; docs/estimators.md)",
    )
    parser.add_argument(
        "--max_num_gen_batches",
        type=int,
        default=10,
        help="--dynamic_sampling: the most prompt batches rolled out for one step (verl's name; 0 = no bound but "
        "the data); at the bound the batch is completed with groups of equal rewards (docs/estimators.md)",
    )
    parser.add_argument(
        "--overlong_buffer_len",
        type=int,
        default=0,
        help="DAPO's soft overlong punishment: answers longer than --max_gen_len minus this many tokens lose up to "
        "--overlong_penalty_factor, linearly (0 = off)",
    )
    parser.add_argument(
        "--overlong_penalty_factor",
        type=float,
        default=1.0,
        help="the overlong penalty at --max_gen_len tokens (verl's default 1.0)",
    )


def check_estimator_args(parser, args):
    """``parser.error`` (exit 2) naming the flag when ``build_advantage_config`` refuses the flags, or DAPO's
    sampling flags are out of range (the agent script has no DAPO flags: their checks are skipped)."""
    try:
        build_advantage_config(args)
    except ValueError as error:
        parser.error(str(error))
    buffer_len = getattr(args, "overlong_buffer_len", 0)
    if not 0 <= buffer_len <= args.max_gen_len:
        parser.error(f"--overlong_buffer_len must be in [0, --max_gen_len {args.max_gen_len}], got {buffer_len}")
    if getattr(args, "overlong_penalty_factor", 0.0) < 0:
        parser.error(f"--overlong_penalty_factor must be >= 0, got {args.overlong_penalty_factor}")
    if getattr(args, "max_num_gen_batches", 0) < 0:
        parser.error(f"--max_num_gen_batches must be >= 0 (0: no bound), got {args.max_num_gen_batches}")


def loss_beta(advantage_config):
    """The KL weight of the policy loss: beta with ``kl_placement`` "loss", 0 when the KL is in the rewards."""
    return advantage_config.beta if advantage_config.kl_placement == "loss" else 0.0


def token_advantages(advantages):
    """Advantages shaped to multiply [N, R] token terms: [N] -> [N, 1] (one per answer), [N, R] unchanged."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


# ----------------------------------------------------------------------------- DAPO's batch-side techniques
def overlong_penalty(completion_lengths, max_gen_len, overlong_buffer_len, overlong_penalty_factor):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's DAPO reward manager): 0 for an answer of at
    most ``max_gen_len - overlong_buffer_len`` tokens, then linear down to ``-overlong_penalty_factor`` at
    ``max_gen_len``: min(0, -(L - (max_gen_len - buffer)) / buffer * factor).

    completion_lengths: [N], each answer's tokens through its EOS (the completion mask's sum, as verl's valid
    response length); returns fp32 [N] <= 0. Raises ValueError unless 0 < buffer <= max_gen_len and factor >= 0.
    """
    if not 0 < overlong_buffer_len <= max_gen_len or overlong_penalty_factor < 0:
        raise ValueError(
            f"--overlong_buffer_len must be in (0, --max_gen_len {max_gen_len}] and "
            f"--overlong_penalty_factor >= 0, got {overlong_buffer_len} and {overlong_penalty_factor}"
        )
    expected_len = max_gen_len - overlong_buffer_len
    exceed_len = completion_lengths.double() - expected_len  # [N]
    return torch.clamp(-exceed_len / overlong_buffer_len * overlong_penalty_factor, max=0.0).float()


def informative_groups(rewards, num_generations):
    """DAPO's dynamic-sampling filter (Yu et al. 2025, eq. 11: 0 < #correct < G; verl keeps groups whose metric has
    a std > 0): True for each group whose G rewards are not all equal. rewards [B*G] -> bool [B]. Float64, so
    rewards that are equal give a std of exactly 0."""
    return rewards.double().view(-1, num_generations).std(dim=1, unbiased=False) > 0  # [B]


def pad_to(tensor, width, value, left=False):
    """[N, W] -> [N, width] (width >= W), ``value`` added on the left or the right."""
    extra = width - tensor.size(1)
    if extra <= 0:
        return tensor
    filler = torch.full((tensor.size(0), extra), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor] if left else [tensor, filler], dim=1)


def join_rollouts(parts, pad_token_id):
    """One ``RolloutResult`` of the rows ``parts`` picks: [(rollout, row indices tensor)], in that order. Prompts are
    left-padded to the widest prompt (the mask 0 there), completions right-padded to the longest (mask 0, log-probs 0,
    the server's NaN), so every row's tokens and log-probs are unchanged. Engine metrics: the first part's
    (``dynamic_sampling`` sets them over every batch rolled out)."""
    prompt_width = max(r.prompt_mask.size(1) for r, _ in parts)
    completion_width = max(r.completion_ids.size(1) for r, _ in parts)
    prompt_ids, prompt_mask, completion_ids, completion_mask, logps, sampling, completions = [], [], [], [], [], [], []
    for rollout, rows in parts:
        width = rollout.prompt_mask.size(1)
        prompt_ids.append(pad_to(rollout.output_ids[rows, :width], prompt_width, pad_token_id, left=True))
        prompt_mask.append(pad_to(rollout.prompt_mask[rows], prompt_width, 0, left=True))
        completion_ids.append(pad_to(rollout.completion_ids[rows], completion_width, pad_token_id))
        completion_mask.append(pad_to(rollout.completion_mask[rows], completion_width, 0))
        logps.append(pad_to(rollout.per_token_logps[rows], completion_width, 0.0))
        if rollout.sampling_per_token_logps is not None:
            sampling.append(pad_to(rollout.sampling_per_token_logps[rows], completion_width, math.nan))
        completions += [rollout.completions[i] for i in rows.tolist()]
    completion_ids = torch.cat(completion_ids)  # [N, R]
    return replace(
        parts[0][0],
        output_ids=torch.cat([torch.cat(prompt_ids), completion_ids], dim=1),  # [N, P + R]
        completion_ids=completion_ids,
        per_token_logps=torch.cat(logps),  # [N, R]
        completions=completions,
        completion_mask=torch.cat(completion_mask),  # [N, R]
        prompt_mask=torch.cat(prompt_mask),  # [N, P]
        metrics=dict(parts[0][0].metrics),
        sampling_per_token_logps=torch.cat(sampling) if len(sampling) == len(parts) else None,
    )


def group_rows(groups, num_generations, device):
    """The row indices of ``groups`` (group indices, a list): each group's G adjacent rows. -> long [len * G]."""
    rows = [g * num_generations + j for g in groups for j in range(num_generations)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def join_scored(parts, pad_token_id):
    """One scored batch of the rows ``parts`` picks: [(scored, row indices long tensor)], in that order; ``scored``
    is ``train_grpo.ScoredRollout`` (rollout, completion_mask [N, R], reward_parts of [N] tensors, prompts,
    truncated), and the result is one of its kind."""
    rollout = join_rollouts([(scored.rollout, rows) for scored, rows in parts], pad_token_id)
    width = rollout.completion_ids.size(1)
    return replace(
        parts[0][0],
        rollout=rollout,
        completion_mask=torch.cat([pad_to(scored.completion_mask[rows], width, 0) for scored, rows in parts]),
        reward_parts={
            key: torch.cat([scored.reward_parts[key][rows.cpu()] for scored, rows in parts])
            for key in parts[0][0].reward_parts
        },
        prompts=[scored.prompts[i] for scored, rows in parts for i in rows.tolist()],
        truncated=sum(scored.truncated for scored, _ in parts),
    )


def dynamic_sampling(first, more_batches, score, args, device, pad_token_id):
    """DAPO's dynamic sampling (Yu et al. 2025, section 3.2; verl's DAPO trainer): keep the groups whose G rewards
    differ (``informative_groups``) and score more prompts, ``score(batch)`` for each (position, batch) drawn from
    ``more_batches``, until B such groups exist on every rank or ``--max_num_gen_batches`` batches were scored this
    step (0: no bound but the batches the remaining steps leave spare). Every rank draws as many batches as the rank
    that needs most (no hang). Kept groups beyond B are dropped (verl keeps the first B); at the bound the batch is
    completed with groups of equal rewards (under the group-baseline estimators with the KL in the loss their
    advantage is 0 and only their KL term acts), where verl raises an error.

    first: the step's own scored batch (``join_scored``'s kind); returns (the B groups as one scored batch in the
    order drawn, metrics {frac_reward_zero_std over every group rolled out, dynamic_sampling/gen_batches,
    dynamic_sampling/filled_groups}, the data position after the last batch drawn or None). Over every batch rolled
    out for the step: the engine's metrics (the keys of the step's own batch, which every rank has, each averaged
    over the batches that report it) and the count of prompts cut to --max_seq_len.
    """
    G, B = args.num_generations, args.batch_size
    draws, kept, equal, position = [first], [], [], None  # (draw, group) pairs
    while True:
        informative = informative_groups(draws[-1].reward_parts["rewards"], G)  # [B]
        for group, keep in enumerate(informative.tolist()):
            (kept if keep else equal).append((len(draws) - 1, group))
        at_bound = args.max_num_gen_batches and len(draws) >= args.max_num_gen_batches
        if at_bound or not any_rank(len(kept) < B, device):
            break
        drawn = next(more_batches, None)
        if drawn is None:  # the data left belongs to the remaining steps (the same on every rank)
            break
        position, batch = drawn
        draws.append(score(batch))
    chosen = sorted(kept[:B] + equal[: max(B - len(kept), 0)])  # [(draw, group)] of B groups
    parts = [
        (draws[d], group_rows([g for dd, g in chosen if dd == d], G, device)) for d in sorted({d for d, _ in chosen})
    ]
    all_rewards = torch.cat([scored.reward_parts["rewards"] for scored in draws])  # [draws * B*G]
    metrics = {
        "frac_reward_zero_std": (~informative_groups(all_rewards, G)).double().mean().item(),  # TRL's, as grpo_family
        "dynamic_sampling/gen_batches": float(len(draws)),
        "dynamic_sampling/filled_groups": float(max(B - len(kept), 0)),
    }
    engine_metrics = {}  # an SGLang engine may report a key on some batches only (its first after a start)
    for key in first.rollout.metrics:
        values = [scored.rollout.metrics[key] for scored in draws if key in scored.rollout.metrics]
        engine_metrics[key] = sum(values) / len(values)
    joined = join_scored(parts, pad_token_id)
    joined = replace(
        joined,
        rollout=replace(joined.rollout, metrics=engine_metrics),
        truncated=sum(scored.truncated for scored in draws),
    )
    return joined, metrics, position
