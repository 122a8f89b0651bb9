"""GRPO for a MiniMind policy (chapter 8.5): rollout -> reward -> group advantage -> CISPO / GRPO loss.

One step, in chapter order:
  1. rollout: each of the B prompts is repeated num_generations (G) times in place (P0,P0,..,P1,P1,..)
     and sampled by the rollout engine, which also records old_per_token_logps (8.2);
  2. rewards [B*G] = rule reward + reward-model score + answer reward (8.3, ``calculate_rewards``);
  3. advantages [B*G] = (r - group mean) / (group std + 1e-4) (8.5.1, ``grpo_advantages``);
  4. ref_per_token_logps from the frozen reference model, per_token_logps from the policy (with grad);
  5. loss: CISPO (default) or the clipped GRPO surrogate, plus beta * k3 KL to the reference
     (8.5.2, 8.6, ``grpo_loss``), then backward, grad clip, AdamW + cosine schedule (the final RMSNorm gain
     in a group of its own that learns the output's sharpness, ``build_policy_optimizer``);
  6. one log line + metrics.jsonl (+ wandb), atomic checkpoints, and the held-out evaluation at step 0,
     every ``--eval_interval`` steps and at the end (``trainer/evaluation.py``).

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
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from dataset.lm_dataset import RLAIFDataset  # noqa: E402
from trainer.evaluation import HeldOutEvaluator  # noqa: E402
from trainer.rollout_engine import (  # noqa: E402
    ROLLOUT_ENGINES, SGLANG_LOGPROB_MODES, TORCH_LOGPROB_MODES, compute_per_token_logps, create_rollout_engine,
    tokenize_prompts,
)
from trainer.trainer_utils import (  # noqa: E402
    DEFAULT_REWARD_MODEL_PATH, DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, DTYPES, BadStepGuard,
    LMForRewardModel, Logger, MetricsWriter, ResumableBatchSampler, StepTimer, StopSignal, TRAIN_DTYPES, any_rank,
    atomic_save, autocast_context, build_config, build_cosine_scheduler, build_policy_optimizer, calculate_rewards,
    check_finite_state, check_writable_dir, describe_changed_flags, half_state_dict, init_distributed_mode,
    init_model, is_main_process, k3_kl, load_resume, load_training_states, masked_mean, nonfinite_parts,
    project_scale_only_gradients, read_reward_model_config, resolve_dtype, resume_command, resume_path,
    resume_progress, save_resume, set_rng_state, setup_seed, shutdown_distributed, training_states, weight_path,
)

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


# ----------------------------------------------------------------------------- set-up
def add_common_rl_args(parser):
    """Flags shared by train_grpo.py and train_ppo.py (same names, same meanings)."""
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR, help="where weights and runs are written")
    parser.add_argument("--run_dir", default="", help="metrics folder (default: {save_dir}/runs/{save_weight}-TIME)")
    parser.add_argument("--data_path", default=os.path.join(ROOT, "dataset", "rlaif_train.jsonl"),
                        help="RL prompts, MiniMind's RLAIF JSONL (the assistant turn, if any, is the reference answer)")
    parser.add_argument("--tokenizer_path", default=DEFAULT_TOKENIZER_PATH, help="tokenizer folder")
    parser.add_argument("--from_weight", default="full_sft", help="name in save_dir ({name}_{hidden}.pth) or a path")
    parser.add_argument("--hidden_size", type=int, default=256, help="model width (MiniMind: 512, 768)")
    parser.add_argument("--num_hidden_layers", type=int, default=4, help="model depth")
    parser.add_argument("--use_moe", type=int, default=0, choices=[0, 1], help="1: mixture-of-experts MLPs")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the prompts (when --max_steps is 0)")
    parser.add_argument("--max_steps", type=int, default=300, help="stop after this many steps (0 = whole epochs)")
    parser.add_argument("--batch_size", type=int, default=4, help="prompts per step and rank")
    parser.add_argument("--learning_rate", type=float, default=2e-5, help="AdamW learning rate of the policy")
    parser.add_argument("--final_norm_learning_rate", type=float, default=1e-2,
                        help="learning rate of the policy's final RMSNorm gain, which sets how sharp its output "
                             "distribution is (0 = --learning_rate, one group)")
    parser.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--accumulation_steps", type=int, default=1,
                        help="backward passes per optimizer step (GRPO: steps; PPO: minibatches)")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="gradient-norm clipping")
    parser.add_argument("--max_seq_len", type=int, default=256, help="prompt tokens kept (from the right)")
    parser.add_argument("--max_gen_len", type=int, default=96, help="most tokens generated per answer")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollout")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling (1.0 = off)")
    parser.add_argument("--top_k", type=int, default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--dtype", default="float32", choices=TRAIN_DTYPES,
                        help="autocast dtype of the policy/critic forwards (weights and log-softmax stay fp32)")
    parser.add_argument("--torch_logprobs", default="sampler", choices=TORCH_LOGPROB_MODES,
                        help="old log-probs of --rollout_engine torch: recorded while sampling, or one more forward")
    parser.add_argument("--thinking_ratio", type=float, default=0.9, help="share of prompts that open <think>")
    parser.add_argument("--reward_model_path", default=DEFAULT_REWARD_MODEL_PATH,
                        help="reward model folder (sequence classification, or get_score remote code), or none")
    parser.add_argument("--reward_batch_size", type=int, default=16, help="answers per reward-model forward")
    parser.add_argument("--reward_device", default="", help="device of the reward model (default: the policy's)")
    parser.add_argument("--reward_dtype", default="", choices=["", *DTYPES],
                        help="dtype of the reward model (default: the policy's)")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="allow a reward model that runs its own Python code (e.g. internlm2-1_8b-reward)")
    parser.add_argument("--answer_reward_weight", type=float, default=2.0,
                        help="weight of the 0/1 reward for a correct final number")
    parser.add_argument("--rollout_engine", default="torch", help=f"one of {', '.join(ROLLOUT_ENGINES)}")
    parser.add_argument("--sglang_url", default="http://127.0.0.1:30000", help="server of --rollout_engine sglang")
    parser.add_argument("--sglang_shared_path", default="",
                        help="folder the trainer writes synced weights to and the server reads "
                             "(default {save_dir}/sglang_policy)")
    parser.add_argument("--sglang_logprobs", default="recompute", choices=SGLANG_LOGPROB_MODES,
                        help="old log-probs: recomputed by the local policy, or the server's (checked at batch 1)")
    parser.add_argument("--sglang_sync_interval", type=int, default=1,
                        help="push weights to SGLang every N policy updates (N > 1: rollouts up to N-1 updates old)")
    parser.add_argument("--sglang_export_dtype", default="float32", choices=sorted(DTYPES),
                        help="dtype of the weights synced to SGLang")
    parser.add_argument("--eval_data_path", default=os.path.join(ROOT, "dataset", "rlaif_val.jsonl"),
                        help="held-out prompts of the periodic evaluation (the validation split)")
    parser.add_argument("--eval_interval", type=int, default=50,
                        help="held-out evaluation at step 0, every N steps and at the end (0 = off)")
    parser.add_argument("--eval_num_prompts", type=int, default=200,
                        help="held-out prompts per evaluation, each answered sampled and greedy")
    parser.add_argument("--log_interval", type=int, default=1, help="log line and metrics.jsonl every N steps")
    parser.add_argument("--save_interval", type=int, default=50, help="checkpoint and resume file every N steps")
    parser.add_argument("--seed", type=int, default=42, help="data order, initial state and sampling")
    parser.add_argument("--use_wandb", action="store_true", help="also send the metrics to wandb")
    parser.add_argument("--wandb_project", default="MiniMind-RL", help="wandb project name")
    parser.add_argument("--debug_mode", action="store_true", help="print prompts, answers and reward parts")
    parser.add_argument("--debug_interval", type=int, default=20, help="--debug_mode prints every N steps")
    parser.add_argument("--from_resume", type=int, default=0, choices=[0, 1],
                        help="1: continue from {save_dir}/{save_weight}_{hidden}_resume.pth when it exists")
    parser.add_argument("--max_bad_steps", type=int, default=3,
                        help="stop after this many updates in a row skipped for a NaN/inf")


def check_common_rl_args(parser, args):
    """argparse-style errors (exit 2) for out-of-range shared flags, before any model is built."""
    for flag in ("batch_size", "accumulation_steps", "max_gen_len", "max_seq_len", "epochs", "log_interval",
                 "save_interval", "debug_interval", "reward_batch_size", "max_bad_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.max_steps < 0:
        parser.error(f"--max_steps must be >= 0, got {args.max_steps}")
    if args.eval_interval < 0 or args.eval_num_prompts < 1:
        parser.error(f"--eval_interval must be >= 0 and --eval_num_prompts >= 1, got {args.eval_interval} and "
                     f"{args.eval_num_prompts}")
    if args.eval_interval and not os.path.isfile(args.eval_data_path):
        parser.error(f"--eval_data_path {args.eval_data_path} does not exist (--eval_interval 0 turns evaluation off)")
    if args.learning_rate <= 0:
        parser.error(f"--learning_rate must be > 0, got {args.learning_rate}")
    if args.final_norm_learning_rate < 0:
        parser.error(f"--final_norm_learning_rate must be >= 0 (0 = --learning_rate), got "
                     f"{args.final_norm_learning_rate}")
    if args.temperature <= 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top_p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.thinking_ratio <= 1:
        parser.error(f"--thinking_ratio must be in [0, 1], got {args.thinking_ratio}")
    if args.rollout_engine not in ROLLOUT_ENGINES:
        parser.error(f"--rollout_engine {args.rollout_engine!r} is unknown; valid: {', '.join(ROLLOUT_ENGINES)}")
    if not os.path.isfile(args.data_path):
        parser.error(f"--data_path {args.data_path} does not exist")
    if args.grad_clip <= 0:
        parser.error(f"--grad_clip must be > 0, got {args.grad_clip}")
    if args.top_k < 0:
        parser.error(f"--top_k must be >= 0 (0 = off), got {args.top_k}")
    if args.reward_model_path != "none":
        try:
            read_reward_model_config(args.reward_model_path, args.trust_remote_code)
        except (OSError, ValueError) as err:
            parser.error(str(err))
    try:
        check_writable_dir(args.save_dir)
    except OSError as err:
        parser.error(f"--save_dir: {err.strerror}")
    if args.sglang_sync_interval < 1:
        parser.error(f"--sglang_sync_interval must be >= 1, got {args.sglang_sync_interval}")
    if args.rollout_engine == "sglang" and args.use_moe:
        parser.error("--rollout_engine sglang needs a dense model (--use_moe 0): MoE weights have no Qwen3 export")
    if not args.sglang_url.startswith(("http://", "https://")):
        parser.error(f"--sglang_url must start with http:// or https://, got {args.sglang_url!r}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind GRPO (Group Relative Policy Optimization)")
    add_common_rl_args(parser)
    parser.add_argument("--save_weight", default="grpo", help="name of the saved weights ({name}_{hidden}.pth)")
    parser.add_argument("--num_generations", type=int, default=6, help="G, answers sampled per prompt")
    parser.add_argument("--loss_type", default="cispo", help=f"one of {', '.join(LOSS_TYPES)}")
    parser.add_argument("--beta", type=float, default=0.1, help="weight of the k3 KL to the reference")
    parser.add_argument("--epsilon", type=float, default=0.2, help="clip range of the grpo loss")
    parser.add_argument("--epsilon_high", type=float, default=5.0, help="upper clamp of the CISPO ratio weight")
    args = parser.parse_args(argv)
    check_common_rl_args(parser, args)
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


def count_long_prompts(dataset, tokenizer, max_seq_len):
    """How many prompts of ``dataset`` are longer than ``max_seq_len`` tokens (they will be cut from the left)."""
    prompts = [dataset[i]["prompt"] for i in range(len(dataset))]
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    return sum(length > max_seq_len for length in lengths)


def rollout_engine_kwargs(args):
    """Constructor arguments of the ``--rollout_engine`` chosen (chapter 8.2)."""
    kwargs = dict(top_p=args.top_p, top_k=args.top_k)
    if args.rollout_engine == "torch":
        kwargs.update(logprobs_mode=args.torch_logprobs)
    if args.rollout_engine == "sglang":
        kwargs.update(
            url=args.sglang_url, shared_path=args.sglang_shared_path or os.path.join(args.save_dir, "sglang_policy"),
            logprobs_mode=args.sglang_logprobs, sync_interval=args.sglang_sync_interval,
            export_dtype=DTYPES[args.sglang_export_dtype],
            resume_hint=f"A checkpoint is saved every --save_interval {args.save_interval} steps: rerun the same "
                        f"command with --from_resume 1 to continue from the last one.",
        )
    return kwargs


def build_run(args, script_name):
    """Shared set-up of both RL scripts (chapter 8.1, the roles): distributed init, seed, the actor/policy,
    the frozen reference, the reward model, and the prompt data (validated here, before the first rollout).

    Returns a dict with device, rank, world_size, local_rank, lm_config, model, ref_model, tokenizer,
    reward_model, dataset, batch_sampler (``ResumableBatchSampler``), loader, evaluator
    (``HeldOutEvaluator``, None with ``--eval_interval 0``).
    Raises:
        ValueError: when the data file has fewer prompts than one batch per rank (says how many of each).
        DataFormatError: a bad data line (file and line number).
    """
    local_rank, device = init_distributed_mode()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    setup_seed(args.seed)  # identical initial weights on every rank
    lm_config = build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
    # the data is read and validated before any model is built: a bad line is reported even without weights
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    dataset = RLAIFDataset(args.data_path, tokenizer, thinking_ratio=args.thinking_ratio, seed=args.seed)
    needed = args.batch_size * world_size
    if len(dataset) < needed:
        raise ValueError(f"--data_path {args.data_path}: found {len(dataset)} prompts, need at least {needed} "
                         f"(--batch_size {args.batch_size} x {world_size} processes) for one full batch")
    model, tokenizer = init_model(lm_config, args.from_weight, args.save_dir, args.tokenizer_path, device, tokenizer)
    long_prompts = count_long_prompts(dataset, tokenizer, args.max_seq_len)
    if long_prompts:
        Logger(f"warning: {long_prompts} of {len(dataset)} prompts are longer than --max_seq_len "
               f"{args.max_seq_len} tokens; they are cut from the left so the generation prompt survives")
    ref_model, _ = init_model(lm_config, "none", args.save_dir, args.tokenizer_path, device)
    ref_model.load_state_dict(model.state_dict())  # the reference is the starting policy, also for 'none'
    ref_model.eval().requires_grad_(False)
    reward_model = None
    if args.reward_model_path != "none":
        reward_model = LMForRewardModel(args.reward_model_path, device=args.reward_device or device,
                                        dtype=resolve_dtype(args.reward_dtype, next(model.parameters()).dtype),
                                        batch_size=args.reward_batch_size, trust_remote_code=args.trust_remote_code)
    evaluator = None
    if args.eval_interval:
        eval_dataset = RLAIFDataset(args.eval_data_path, tokenizer, thinking_ratio=1.0, seed=args.seed)
        evaluator = HeldOutEvaluator(eval_dataset, tokenizer, args.eval_num_prompts, args.temperature,
                                     args.max_gen_len, args.max_seq_len, device)
    batch_sampler = ResumableBatchSampler(dataset, args.batch_size, world_size, rank, args.seed)
    # its own generator: creating the loader's iterator must not draw from the global RNG (exact resume)
    loader = DataLoader(dataset, batch_sampler=batch_sampler, generator=torch.Generator().manual_seed(args.seed))
    setup_seed(args.seed + rank)  # different sampling on every rank
    Logger(f"{script_name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
           f"{len(dataset)} prompts, world size {world_size}, device {device}")
    return dict(device=device, rank=rank, world_size=world_size, local_rank=local_rank, lm_config=lm_config,
                model=model, ref_model=ref_model, tokenizer=tokenizer, reward_model=reward_model,
                dataset=dataset, batch_sampler=batch_sampler, loader=loader, evaluator=evaluator)


def wrap_ddp(model, device, local_rank):
    """DistributedDataParallel around ``model`` when distributed (gloo on CPU, one GPU per rank on CUDA)."""
    if not dist.is_initialized():
        return model
    # MoE experts that received no token on a rank get no gradient there: DDP must be told to expect that.
    use_moe = bool(getattr(getattr(model, "config", None), "use_moe", False))
    return DistributedDataParallel(model, device_ids=[local_rank] if device.startswith("cuda") else None,
                                   find_unused_parameters=use_moe)


def mean_over_ranks(metrics, device):
    """Average a dict of floats over ranks (all_reduce); unchanged when not distributed."""
    if not dist.is_initialized():
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return dict(zip(keys, values.tolist()))


def print_debug_samples(step, prompts, completions, reward_parts, num_generations):
    """--debug_mode: each prompt, its sampled answers and their reward parts (rank 0 only)."""
    for i in range(0, len(completions), num_generations):
        Logger(f"[debug] step {step} prompt:\n{prompts[i]}")
        for j in range(i, i + num_generations):
            Logger(f"[debug] answer {j - i}: reward {reward_parts['rewards'][j]:.3f} "
                   f"(rule {reward_parts['rule_rewards'][j]:.3f}, rm {reward_parts['reward_model_scores'][j]:.3f}, "
                   f"answer {reward_parts['answer_rewards'][j]:.0f})\n{completions[j]}")


# ----------------------------------------------------------------------------- the loop
def grpo_step(batch, model, ref_model, rollout_engine, reward_model, tokenizer, args, device):
    """One turn of the RLHF loop (chapter 8.1) with GRPO (chapter 8.5): rollout, rewards, group advantages,
    loss. Returns (loss to backpropagate, metrics dict, debug dict); the loop divides the loss by the size of
    its gradient-accumulation window (``accumulation_window_size``).

    ``model`` is what the gradient flows through (the DDP wrapper when distributed).
    """
    prompts, answers = batch["prompt"], batch["answer"]  # list[str] of length B
    prompt_ids, attention_mask, truncated = tokenize_prompts(tokenizer, prompts, args.max_seq_len, device)

    # 1. rollout: B*G completions and their old log-probs (8.2)
    with autocast_context(device, args.dtype):
        rollout = rollout_engine.rollout(prompt_ids, attention_mask, args.num_generations, args.max_gen_len,
                                         args.temperature)
    output_ids = rollout.output_ids  # [B*G, P+R]
    full_mask = rollout.attention_mask  # [B*G, P+R]
    completion_mask = rollout.completion_mask  # [B*G, R]
    old_per_token_logps = rollout.per_token_logps.detach()  # [B*G, R]
    num_completion_tokens = rollout.completion_ids.size(1)  # R

    # 2. rewards (8.3)
    repeated_prompts = [p for p in prompts for _ in range(args.num_generations)]
    repeated_answers = [a for a in answers for _ in range(args.num_generations)]
    reward_parts = calculate_rewards(repeated_prompts, rollout.completions, repeated_answers, reward_model,
                                     args.answer_reward_weight)
    rewards = reward_parts["rewards"].to(device)  # [B*G]

    # 3. group-relative advantages (8.5.1)
    advantages = grpo_advantages(rewards, args.num_generations)  # [B*G]

    # 4. reference and current log-probs (fp32 whatever --dtype is)
    with torch.no_grad(), autocast_context(device, args.dtype):
        ref_per_token_logps = compute_per_token_logps(ref_model, output_ids, num_completion_tokens, full_mask,
                                                      args.temperature)  # [B*G, R]
    with autocast_context(device, args.dtype):
        per_token_logps, aux_loss = compute_per_token_logps(model, output_ids, num_completion_tokens, full_mask,
                                                            args.temperature, return_aux_loss=True)  # [B*G, R]

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


def accumulation_window_size(step, total_steps, accumulation_steps):
    """How many backward passes the optimizer step that ``step`` (1-based) belongs to accumulates.

    Windows are steps 1..k, k+1..2k, ... (k = ``accumulation_steps``); the last one ends at ``total_steps`` and
    may be shorter. Each loss is divided by its window's size, so that every optimizer step applies the mean
    gradient of its window (the fix transformers PR #39659 and TRL PR #3493 made for the same mistake).
    Example: total 5, k 2 -> sizes 2, 2, 2, 2, 1.
    """
    window_start = (step - 1) // accumulation_steps * accumulation_steps  # steps before this window
    return min(accumulation_steps, total_steps - window_start)


def count_total_steps(max_steps, epochs, steps_per_epoch):
    """Steps of the run: ``max_steps`` when set (capped by the data), else ``epochs`` full passes."""
    return min(max_steps, epochs * steps_per_epoch) if max_steps else epochs * steps_per_epoch


def evaluate_if_due(evaluator, model, step, total_steps, eval_interval):
    """The ``eval/...`` metrics of the held-out evaluation when it is due (step 0, every ``eval_interval``
    steps, the last step), with one log line; {} otherwise or without an evaluator."""
    if evaluator is None or not (step == 0 or step % eval_interval == 0 or step == total_steps):
        return {}
    metrics = evaluator(model, step)
    Logger(f"eval step {step} | held-out accuracy sampled {metrics['eval/accuracy_sampled']:.3f} "
           f"greedy {metrics['eval/accuracy_greedy']:.3f} | len {metrics['eval/response_len']:.1f} "
           f"({evaluator.num_prompts} prompts)")
    return metrics


def open_metrics(args, progress):
    """(run_dir, MetricsWriter): ``--run_dir``, else the resumed run's folder, else
    ``{save_dir}/runs/{save_weight}-TIME``; a resumed run appends to its metrics and wandb run."""
    run_dir = args.run_dir or progress.get("run_dir") or os.path.join(
        args.save_dir, "runs", f"{args.save_weight}-{time.strftime('%Y%m%d-%H%M%S')}")
    writer = MetricsWriter(run_dir, args.use_wandb, args.wandb_project, os.path.basename(run_dir), vars(args),
                           wandb_id=progress.get("wandb_id"))
    return run_dir, writer


def start_or_resume(args, script, run, objects, steps_per_epoch):
    """Where the run starts: step 0, or (``--from_resume 1`` and a resume file exists) the saved step, with
    ``objects`` (policy, optimizer, schedule, ...) and this rank's random state restored.

    The reference model is not in ``objects``: it stays the initial ``--from_weight`` weights (a resume whose
    ``--from_weight`` is the file the run saves to is refused, since that file holds the trained policy).
    Under torchrun every rank must find the same file: ranks that would start from different steps stop.
    Returns a progress dict: step, epoch, batch_in_epoch, run_dir, wandb_id, bad_steps_in_a_row.
    Raises:
        ValueError: a resume file from another script, format or architecture (see ``load_resume``), a
            ``--from_weight`` that is the saved policy, or ranks at different steps.
    """
    progress = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "run_dir": None, "wandb_id": None,
                "bad_steps_in_a_row": 0}
    if not args.from_resume:
        return progress
    path = resume_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe)
    checkpoint = load_resume(path, script, args)
    if checkpoint is None:
        Logger(f"--from_resume 1: no resume file at {path}, starting at step 0")
    else:
        restore_from_checkpoint(args, run, objects, steps_per_epoch, path, checkpoint, progress)
    if dist.is_initialized():  # every rank must have read the same file (multi-node: a shared --save_dir)
        steps = torch.tensor([progress["step"], -progress["step"]], dtype=torch.float64, device=run["device"])
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if steps[0].item() != -steps[1].item():
            raise ValueError(f"ranks would resume from different steps (up to {int(steps[0].item())}, this one "
                             f"{progress['step']}): every node needs the same {path} (a shared --save_dir)")
    return progress


def restore_from_checkpoint(args, run, objects, steps_per_epoch, path, checkpoint, progress):
    """The restore part of ``start_or_resume``: states, data position and random state (updates ``progress``)."""
    start_weights = weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe)
    saved_weights = weight_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe, allow_file=False)
    if os.path.abspath(start_weights) == os.path.abspath(saved_weights):
        raise ValueError(f"--from_weight {args.from_weight} is {saved_weights}, the file this run saves its policy "
                         f"to, so on resume the reference model would be the step-{checkpoint['progress']['step']} "
                         f"policy, not the starting one; start runs from a copy (another --save_weight)")
    load_training_states(objects, checkpoint["states"], path)
    resumed, rng_state = resume_progress(checkpoint, run["world_size"], steps_per_epoch, run["rank"])
    progress.update(resumed)
    if rng_state is not None:
        set_rng_state(rng_state)
    else:
        saved_world_size = checkpoint["progress"]["world_size"]
        setup_seed(args.seed + run["rank"] + 1000 * progress["step"])
        Logger(f"world size changed from {saved_world_size} to {run['world_size']}: step rescaled to "
               f"{progress['step']}, data position to batch {progress['batch_in_epoch']} of epoch "
               f"{progress['epoch']}; random states reseeded, so this resume is not bit-exact")
    for change in describe_changed_flags(checkpoint["args"], args):
        Logger(f"warning: resuming with a changed flag: {change}")
    Logger(f"resumed from {path} at step {progress['step']} (epoch {progress['epoch']}, "
           f"batch {progress['batch_in_epoch']})")


def save_checkpoint(args, script, lm_config, objects, progress, weights):
    """Save at a safe point: the policy (and critic) weights as MiniMind fp16 ``.pth`` files (rank 0) and the
    resume file with everything ``start_or_resume`` needs (a collective: every rank calls it).

    Args:
        objects: name -> model / optimizer / schedule / generator (see ``training_states``).
        progress: step, epoch, batch_in_epoch, run_dir, wandb_id, bad_steps_in_a_row.
        weights: name in ``save_dir`` -> module, e.g. {"grpo": policy} or {"ppo": actor, "ppo_critic": critic}.
    Returns the resume file's path.
    Raises:
        ValueError: a NaN or inf in the weights (nothing is written); OSError naming the path.
    """
    if is_main_process():
        for name, module in weights.items():
            path = weight_path(name, args.save_dir, lm_config.hidden_size, lm_config.use_moe, allow_file=False)
            state_dict = half_state_dict(module)
            check_finite_state(state_dict, path)
            atomic_save(state_dict, path)
    path = resume_path(args.save_weight, args.save_dir, args.hidden_size, args.use_moe)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    save_resume(path, script, args, dict(progress, world_size=world_size), training_states(objects))
    return path


def optimizer_step(model, optimizer, scheduler, grad_clip, problems, device):
    """Clip the gradient norm, then step the optimizer and the schedule -- unless something was non-finite.

    Args:
        problems: names of non-finite values seen since the last update on this rank (e.g. ['rewards']).
    Returns:
        (grad_norm float, problems list): a non-finite grad norm adds 'gradients'; when any rank has a
        problem the update is skipped on every rank (gradients cleared, optimizer and schedule untouched)
        and the list is non-empty.
    """
    project_scale_only_gradients(optimizer)  # the final norm gain learns one number (build_policy_optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    problems = list(problems) + ([] if math.isfinite(grad_norm) else ["gradients"])
    if any_rank(bool(problems), device):
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, problems or ["values on another rank"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, []


def main(argv=None):
    args = parse_args(argv)
    run = build_run(args, "GRPO")
    device, model, ref_model, tokenizer = run["device"], run["model"], run["ref_model"], run["tokenizer"]
    lm_config, loader, batch_sampler = run["lm_config"], run["loader"], run["batch_sampler"]

    steps_per_epoch = len(loader)
    total_steps = count_total_steps(args.max_steps, args.epochs, steps_per_epoch)
    optimizer = build_policy_optimizer(model, args.learning_rate, args.weight_decay, args.final_norm_learning_rate)
    scheduler = build_cosine_scheduler(optimizer, -(-total_steps // args.accumulation_steps))  # ceil
    ddp_model = wrap_ddp(model, device, run["local_rank"])
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    progress = start_or_resume(args, "grpo", run, objects, steps_per_epoch)
    # made after the restore: the SGLang engine pushes the (restored) policy to its server at start-up
    rollout_engine = create_rollout_engine(args.rollout_engine, model, tokenizer, **rollout_engine_kwargs(args))
    run_dir, writer = open_metrics(args, progress)
    Logger(f"GRPO: {total_steps} steps, {args.batch_size} prompts x {args.num_generations} answers per step, "
           f"loss {args.loss_type}, metrics in {run_dir}")

    stop_signal = StopSignal()
    stop = False  # agreed by all ranks at the end of each step
    guard = BadStepGuard(args.max_bad_steps, progress["bad_steps_in_a_row"])
    step, problems = progress["step"], []
    if step == 0 and run["evaluator"] is not None:
        writer.log({"step": 0, **evaluate_if_due(run["evaluator"], model, 0, total_steps, args.eval_interval)})
    timer = StepTimer(total_steps, start_step=progress["step"])  # after the step-0 evaluation: it times steps only
    ddp_model.train()
    for epoch in range(progress["epoch"], args.epochs):
        if step >= total_steps:
            break
        batch_sampler.set_epoch(epoch, progress["batch_in_epoch"] if epoch == progress["epoch"] else 0)
        for batch_in_epoch, batch in enumerate(loader, start=batch_sampler.skip_batches + 1):
            step += 1
            learning_rate = optimizer.param_groups[0]["lr"]  # the rate this step's update uses (read before stepping)
            loss, metrics, debug = grpo_step(batch, ddp_model, ref_model, rollout_engine, run["reward_model"],
                                             tokenizer, args, device)
            problems += nonfinite_parts(rewards=debug["reward_parts"]["rewards"], loss=loss)
            (loss / accumulation_window_size(step, total_steps, args.accumulation_steps)).backward()
            if step % args.accumulation_steps == 0 or step == total_steps:
                metrics["grad_norm"], problems = optimizer_step(ddp_model, optimizer, scheduler, args.grad_clip,
                                                                problems, device)
                metrics["skipped_update"] = float(bool(problems))
                guard.record(step, problems)
                problems = []
                rollout_engine.update_policy(model)
            metrics = mean_over_ranks(metrics, device)
            if args.debug_mode and step % args.debug_interval == 0:
                print_debug_samples(step, debug["prompts"], debug["completions"], debug["reward_parts"],
                                    args.num_generations)
            metrics["final_norm_gain"] = model.model.norm.weight.mean().item()  # the output's sharpness
            eval_metrics = evaluate_if_due(run["evaluator"], model, step, total_steps, args.eval_interval)
            metrics.update(eval_metrics)
            if step % args.log_interval == 0 or step == total_steps or eval_metrics:
                elapsed, remaining = timer.eta(step)
                metrics.update(step=step, total_steps=total_steps, epoch=epoch,
                               learning_rate=learning_rate, elapsed_s=time.time() - timer.start,
                               sample_indices=batch["index"].tolist())
                Logger(f"step {step}/{total_steps} | reward {metrics['reward']:.3f} "
                       f"(rule {metrics['rule_reward']:.3f}, rm {metrics['reward_model_score']:.3f}, "
                       f"answer {metrics['answer_reward']:.3f}) | kl_ref {metrics['kl_ref']:.4f} | "
                       f"adv mean {metrics['advantages_mean']:.3f} std {metrics['advantages_std']:.3f} | "
                       f"policy_loss {metrics['policy_loss']:.4f} | len {metrics['response_len']:.1f} | "
                       f"lr {metrics['learning_rate']:.2e} | {elapsed} elapsed, {remaining} left")
                writer.log(metrics)
            stop = stop_signal.requested(device)
            if step % args.save_interval == 0 or step == total_steps or stop:
                progress.update(step=step, epoch=epoch, batch_in_epoch=batch_in_epoch, run_dir=run_dir,
                                wandb_id=writer.wandb_id, bad_steps_in_a_row=guard.in_a_row)
                path = save_checkpoint(args, "grpo", lm_config, objects, progress, {args.save_weight: model})
                Logger(f"saved step {step}: weights and {path}")
            if stop:
                Logger(f"stopped by {stop_signal.signal_name or 'a signal to another rank'} at step {step}; "
                       f"resume with:\n"
                       f"  {resume_command(__file__, sys.argv[1:] if argv is None else argv, run['world_size'])}")
                break
            if step >= total_steps:
                break
        if step >= total_steps or stop:
            break
    if run["evaluator"] is not None:
        for line in run["evaluator"].summary_lines():
            Logger(line)
    writer.close()
    stop_signal.restore()
    del ddp_model  # free the DDP wrappers while the process group is alive (see shutdown_distributed)
    shutdown_distributed()


if __name__ == "__main__":
    main()
