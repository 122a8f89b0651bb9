"""Follow one GRPO step and one PPO step on a two-prompt batch, printing the real tensors of every stage.

The script calls the training code's own functions (``tokenize_prompts``, the rollout engine,
``calculate_rewards``, ``grpo_advantages``, ``compute_per_token_logps``, ``grpo_loss``, ``ppo_rollout``,
``place_sequence_rewards``, ``compute_gae``, ``masked_whiten``, ``ppo_update``, ``ppo_policy_loss``,
``ppo_value_loss``) in the order of a training step and writes what it sees as markdown, so the numbers in
``docs/walkthrough.md`` are the program's. Seeds are fixed: the same weights, data and flags give the same
document on the same machine (CPU).

Usage (the embedded default: out/full_sft_256.pth, the bundled prompts):
    python scripts/walkthrough.py --out docs/walkthrough.md
    python scripts/walkthrough.py --save_dir /tmp/w --from_weight tiny --hidden_size 64 --num_hidden_layers 2 \\
        --max_gen_len 8 --out /tmp/walkthrough.md
"""

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch

from dataset.lm_dataset import RLAIFDataset
from scripts.eval_policy import question_of
from trainer import train_grpo, train_ppo
from trainer.grpo_family import build_loss_config
from trainer.rollout_engine import RolloutRoles, TorchRolloutEngine, compute_per_token_logps, tokenize_prompts
from trainer.infra.weights import DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, build_config, init_model
from trainer.infra.distributed import setup_seed
from trainer.infra.files import atomic_write
from trainer.infra.dtypes import autocast_context
from trainer.infra.optimizer import adamw, build_cosine_scheduler, build_policy_optimizer, project_scale_only_gradients
from trainer.trainer_utils import calculate_rewards, grpo_advantages, k3_kl, masked_mean

# Stage headings, in order; tests/test_learner.py checks that the document has all of them.
GRPO_STAGES = (
    "1. Prompts to token ids",
    "2. Rollout: sampled answers and old log-probs",
    "3. Rewards and their parts",
    "4. Group-relative advantages",
    "5. Reference and current log-probs, k3 KL",
    "6. Loss",
    "7. After one optimizer step",
)
PPO_STAGES = (
    "1. Rollout, rewards, reference log-probs and old values",
    "2. token_rewards: the reward on the last real token",
    "3. GAE advantages and returns",
    "4. Whitening",
    "5. The update: epochs of minibatches",
    "6. After the update: ratio, clipped losses, approx KL",
)


# ----------------------------------------------------------------------------- formatting
def format_number(value, decimals):
    """An int as is; a float with ``decimals`` decimals."""
    if isinstance(value, bool) or isinstance(value, int):
        return str(int(value))
    return f"{value:.{decimals}f}"


def format_values(values, max_values, decimals):
    """Space-separated numbers; past ``max_values`` only the first ones and how many more there are."""
    shown = " ".join(format_number(v, decimals) for v in values[:max_values])
    if len(values) > max_values:
        shown += f" ... (+{len(values) - max_values} more)"
    return shown


def format_tensor(name, tensor, max_rows=4, max_values=8, decimals=4):
    """Lines describing a tensor: ``name: shape [..], dtype``, then its values (1-D: up to 24, rows: up to
    ``max_rows`` rows of ``max_values`` values), indented by two spaces."""
    tensor = tensor.detach().cpu()
    dtype = str(tensor.dtype).replace("torch.", "")
    lines = [f"{name}: shape {list(tensor.shape)}, {dtype}"]
    if tensor.dim() == 0:
        lines.append("  " + format_number(tensor.item(), decimals))
    elif tensor.dim() == 1:
        lines.append("  " + format_values(tensor.tolist(), max(max_values, 24), decimals))
    else:
        for i in range(min(max_rows, tensor.size(0))):
            lines.append(f"  [{i}] " + format_values(tensor[i].flatten().tolist(), max_values, decimals))
        if tensor.size(0) > max_rows:
            lines.append(f"  ... ({tensor.size(0) - max_rows} more rows)")
    return lines


def format_window(name, tensor, positions, before=4, after=1, decimals=4):
    """Lines showing each row of a [B, R] tensor around one position per row (``positions``, e.g. the last real
    token): ``[i] t=a..b: values``, from ``before`` positions before to ``after`` positions after it."""
    tensor = tensor.detach().cpu()
    dtype = str(tensor.dtype).replace("torch.", "")
    lines = [f"{name}: shape {list(tensor.shape)}, {dtype}; around each row's last real token"]
    for i, position in enumerate(positions):
        start = max(position - before, 0)
        end = min(position + after, tensor.size(1) - 1)
        values = format_values(tensor[i, start : end + 1].tolist(), end - start + 1, decimals)
        lines.append(f"  [{i}] t={start}..{end}: {values}")
    return lines


def code_block(lines):
    """A fenced markdown block around ``lines``."""
    return ["```text"] + list(lines) + ["```", ""]


def model_parameters(*models):
    """Total parameters of the models (millions, 2 decimals)."""
    return round(sum(p.numel() for m in models for p in m.parameters()) / 1e6, 2)


# ----------------------------------------------------------------------------- set-up
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="One GRPO and one PPO step with the real tensors, as markdown")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "walkthrough.md"), help="markdown file")
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR)
    parser.add_argument("--from_weight", default="full_sft")
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--tokenizer_path", default=DEFAULT_TOKENIZER_PATH)
    parser.add_argument("--data_path", default=os.path.join(ROOT, "dataset", "rlaif_train.jsonl"))
    parser.add_argument(
        "--prompt_indices",
        type=int,
        nargs=2,
        default=[1, 4],
        help="the two prompts (data rows); with 1 and 4, neither GRPO group has equal rewards and "
        "PPO gets one right and one wrong answer",
    )
    parser.add_argument("--num_generations", type=int, default=6, help="GRPO answers per prompt (G)")
    parser.add_argument("--max_gen_len", type=int, default=96)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    if not os.path.isfile(args.data_path):
        parser.error(f"--data_path {args.data_path} does not exist")
    if args.num_generations < 2:
        parser.error(f"--num_generations must be >= 2 for group advantages, got {args.num_generations}")
    return args


def training_flags(args):
    """The flags both training scripts share, from the walkthrough's own (batch of 2 prompts, thinking on)."""
    return [
        "--save_dir",
        args.save_dir,
        "--from_weight",
        args.from_weight,
        "--hidden_size",
        str(args.hidden_size),
        "--num_hidden_layers",
        str(args.num_hidden_layers),
        "--tokenizer_path",
        args.tokenizer_path,
        "--data_path",
        args.data_path,
        "--batch_size",
        "2",
        "--max_gen_len",
        str(args.max_gen_len),
        "--seed",
        str(args.seed),
        "--thinking_ratio",
        "1.0",
    ]


def load_policy_and_reference(args, seed):
    """(policy, frozen reference copy, tokenizer): the roles each training script's ``main`` makes (chapter 8.1),
    on the CPU."""
    setup_seed(seed)
    lm_config = build_config(args.hidden_size, args.num_hidden_layers, 0)
    model, tokenizer = init_model(lm_config, args.from_weight, args.save_dir, args.tokenizer_path, "cpu")
    ref_model, _ = init_model(lm_config, "none", args.save_dir, args.tokenizer_path, "cpu")
    ref_model.load_state_dict(model.state_dict())
    ref_model.eval().requires_grad_(False)
    return model, ref_model, tokenizer, lm_config


# ----------------------------------------------------------------------------- GRPO (chapter 8.5)
def grpo_walkthrough(batch, grpo_args, model, ref_model, tokenizer, seed, stages=GRPO_STAGES):
    """One GRPO step (chapter 8.5) in stages, as ``grpo_rollout``, ``grpo_policy_loss`` and the main loop do it.

    Returns (markdown lines, summary dict for ``ppo_vs_grpo_table``).
    """
    G = grpo_args.num_generations
    loss_config = build_loss_config(grpo_args)  # epsilon_high: CISPO's clamp 5.0 when the flag is unset
    lines = ["## GRPO step (chapter 8.5)", ""]
    lines += [
        f"Flags: the defaults of `trainer/train_grpo.py` with `--batch_size 2`: G = {G} answers per prompt, "
        f"loss `{grpo_args.loss_type}`, beta = {grpo_args.beta}, epsilon_high = {loss_config.epsilon_high}, "
        f"learning rate {grpo_args.learning_rate:g}, temperature {grpo_args.temperature}.",
        "",
    ]

    # 1. prompts
    prompts, answers = batch["prompt"], batch["answer"]
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts, grpo_args.max_seq_len, "cpu")
    lines += [f"### {stages[0]}", ""]
    lines += [
        "`tokenize_prompts` renders nothing new: the dataset already applied the chat template "
        "(`open_thinking`, so each prompt ends in `<think>`). The batch is left-padded with the pad id "
        f"{tokenizer.pad_token_id}, so every prompt ends at the same column and generation starts there.",
        "",
    ]
    block = [
        f"prompt {i}: {json.dumps(question_of(p), ensure_ascii=False)}  (reference answer {a!r})"
        for i, (p, a) in enumerate(zip(prompts, answers))
    ]
    block += format_tensor("prompt_ids", prompt_ids, max_values=12)
    block += format_tensor("attention_mask", attention_mask, max_values=12)
    block += [f"real prompt tokens per row: {attention_mask.sum(dim=1).tolist()}"]
    lines += code_block(block)

    # 2. rollout
    model.train()
    engine = TorchRolloutEngine(model, tokenizer, generator=torch.Generator().manual_seed(seed))
    rollout = engine.rollout(prompt_ids, attention_mask, G, grpo_args.max_gen_len, grpo_args.temperature)
    output_ids = rollout.output_ids  # [B*G, P+R]
    completion_mask = rollout.completion_mask  # [B*G, R]
    full_mask = rollout.attention_mask  # [B*G, P+R]
    old_per_token_logps = rollout.per_token_logps  # [B*G, R]
    R = rollout.completion_ids.size(1)
    lines += [f"### {stages[1]}", ""]
    lines += [
        "The rollout [采样] repeats each prompt G times in place (P0 ×G, then P1 ×G: `repeat_interleave`), "
        "samples with the policy's `generate`, and records `old_per_token_logps`, log π_old of every sampled "
        "token (chapter 8.2). `completion_mask` is 1 up to and including the first EOS; a truncated answer "
        "counts in full.",
        "",
    ]
    block = format_tensor("output_ids", output_ids, max_values=10)
    block += format_tensor("completion_ids", rollout.completion_ids, max_values=10)
    block += format_tensor("completion_mask", completion_mask, max_values=10)
    block += [f"answer lengths (completion_mask.sum(1)): {completion_mask.sum(dim=1).tolist()}"]
    block += format_tensor("old_per_token_logps", old_per_token_logps)
    block += ["answers:"] + [f"  [{i}] {json.dumps(c, ensure_ascii=False)}" for i, c in enumerate(rollout.completions)]
    lines += code_block(block)

    # 3. rewards
    repeated_prompts = [p for p in prompts for _ in range(G)]
    repeated_answers = [a for a in answers for _ in range(G)]
    reward_parts = calculate_rewards(
        repeated_prompts, rollout.completions, repeated_answers, None, grpo_args.answer_reward_weight
    )
    rewards = reward_parts["rewards"]  # [B*G]
    lines += [f"### {stages[2]}", ""]
    lines += [
        "`calculate_rewards` (chapter 8.3) gives one scalar per answer: the rule reward [规则奖励] (length, "
        "thinking format, one `</think>`, minus the repetition penalty), the reward-model score [奖励模型] "
        f"(0 here: no `--reward_model_path`), and {grpo_args.answer_reward_weight:g} × the answer reward "
        "(1 when the final number is right).",
        "",
    ]
    block = format_tensor("rule_rewards", reward_parts["rule_rewards"], decimals=6)
    block += format_tensor("reward_model_scores", reward_parts["reward_model_scores"], decimals=6)
    block += format_tensor("answer_rewards", reward_parts["answer_rewards"], decimals=6)
    block += format_tensor("rewards", rewards, decimals=6)
    lines += code_block(block)

    # 4. advantages
    advantages = grpo_advantages(rewards, G)  # [B*G]
    grouped = rewards.view(-1, G)  # [B, G], for display
    lines += [f"### {stages[3]}", ""]
    lines += [
        "`grpo_advantages` (chapter 8.5.1, 组内标准化): A_i = (r_i − group mean) / (group std + 1e-4), "
        "population std, one number per answer. No critic: the other answers to the same prompt are the "
        "baseline. A group whose rewards are all equal gets A = 0 and teaches nothing.",
        "",
    ]
    block = [
        f"group {b}: rewards {format_values(grouped[b].tolist(), G, 4)} | mean {grouped[b].mean().item():.4f} "
        f"std {grouped[b].std(unbiased=False).item():.4f}"
        for b in range(grouped.size(0))
    ]
    block += format_tensor("advantages", advantages, decimals=6)
    lines += code_block(block)

    # 5. log-probs, every row with its own copy of the prompt as in the chapter (train_grpo.py's --shared_prefix
    # runs each prompt once: the same numbers to float rounding, tests/test_forward_layouts.py)
    with torch.no_grad():
        ref_per_token_logps = compute_per_token_logps(
            ref_model, output_ids, R, full_mask, grpo_args.temperature
        ).per_token_logps  # [B*G, R]
    per_token_logps = compute_per_token_logps(
        model, output_ids, R, full_mask, grpo_args.temperature
    ).per_token_logps  # [B*G, R]
    per_token_kl = k3_kl(ref_per_token_logps, per_token_logps.detach())  # [B*G, R]
    lines += [f"### {stages[4]}", ""]
    lines += [
        "One forward of the frozen reference model [参考模型] and one of the policy (with gradient) over the "
        "same `output_ids` give `ref_per_token_logps` and `per_token_logps` (`compute_per_token_logps`, "
        "chapter 8.2). The reference is the starting policy, so at the first step all three log-probs agree "
        "and the k3 KL (chapter 8.6) is 0.",
        "",
    ]
    block = format_tensor("ref_per_token_logps", ref_per_token_logps)
    block += format_tensor("per_token_logps", per_token_logps)
    block += format_tensor("per_token_kl (k3)", per_token_kl)
    block += [
        f"max |per_token_logps - old_per_token_logps| over real tokens: "
        f"{((per_token_logps.detach() - old_per_token_logps).abs() * completion_mask).max().item():.2e}"
    ]
    lines += code_block(block)

    # 6. loss
    policy_loss, _, ratio = train_grpo.grpo_loss(
        per_token_logps,
        old_per_token_logps,
        ref_per_token_logps,
        advantages,
        completion_mask,
        loss_type=loss_config.loss_type,
        epsilon=loss_config.epsilon,
        epsilon_high=loss_config.epsilon_high,
        beta=loss_config.beta,
    )
    lines += [f"### {stages[5]}", ""]
    lines += [
        f"`grpo_loss` with `loss_type={grpo_args.loss_type}` (chapter 8.5.2): CISPO weights each token's "
        "log-prob by the detached ratio clamped at epsilon_high, times the answer's advantage, plus beta × k3; "
        "`sequence_mean_loss` averages over each answer's real tokens, then over answers. On-policy the "
        "ratio is 1, so the loss is −mean over answers of A × (mean log-prob of the answer).",
        "",
    ]
    on_policy_loss = -(advantages * masked_mean(per_token_logps.detach(), completion_mask, dim=1)).mean()
    block = format_tensor("ratio", ratio)
    block += [
        f"policy_loss: {policy_loss.item():.6f}",
        f"-mean_i(A_i * mean_t per_token_logps[i, t]) for comparison: {on_policy_loss.item():.6f}",
    ]
    lines += code_block(block)

    # 7. optimizer step and the new policy
    optimizer = build_policy_optimizer(
        model, grpo_args.learning_rate, grpo_args.weight_decay, grpo_args.final_norm_learning_rate
    )  # as train_grpo.py builds it
    scheduler = build_cosine_scheduler(optimizer, grpo_args.max_steps)
    policy_loss.backward()
    project_scale_only_gradients(optimizer)  # the update, as train_grpo.py's loop writes it
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grpo_args.grad_clip))
    if not math.isfinite(grad_norm):
        raise RuntimeError(f"the GRPO step produced a non-finite gradient norm {grad_norm}")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        new_per_token_logps = compute_per_token_logps(
            model, output_ids, R, full_mask, grpo_args.temperature
        ).per_token_logps  # [B*G, R]
    delta = masked_mean(new_per_token_logps - old_per_token_logps, completion_mask, dim=1)  # [B*G]
    new_kl = masked_mean(k3_kl(ref_per_token_logps, new_per_token_logps), completion_mask)
    agree = int(((delta > 0) == (advantages > 0))[advantages != 0].sum())
    lines += [f"### {stages[6]}", ""]
    lines += [
        "The update of the loop projects the final norm gain's gradient on the gain (it learns one number, "
        "the output's sharpness), clips the gradient norm and takes one AdamW step. Scoring the same answers "
        "again: answers with a positive advantage became more likely (their mean log-prob rose), those with a "
        "negative one less likely, and the policy has moved away from the reference (k3 KL > 0).",
        "",
    ]
    block = [f"grad_norm (before clipping at {grpo_args.grad_clip}): {grad_norm:.4f}"]
    block += format_tensor("new ratio exp(new - old)", torch.exp(new_per_token_logps - old_per_token_logps))
    block += ["answer | advantage | mean Δ log-prob per token"]
    block += [f"  [{i}] {advantages[i].item():+.4f} {delta[i].item():+.6f}" for i in range(advantages.numel())]
    block += [
        f"same sign as the advantage: {agree} of {int((advantages != 0).sum())} answers with A != 0",
        f"k3 KL to the reference after the step: {new_kl.item():.3e}",
    ]
    lines += code_block(block)
    summary = {
        "answers": output_ids.size(0),
        "advantage_shape": list(advantages.shape),
        "advantages_first_answer": 1,
        "models": model_parameters(model, ref_model),
        "optimizer_steps": 1,
    }
    return lines, summary


# ----------------------------------------------------------------------------- PPO (chapter 8.4)
def ppo_walkthrough(batch, ppo_args, actor, ref_model, critic, tokenizer, seed, stages=PPO_STAGES):
    """One PPO step (chapter 8.4) in stages, as ``ppo_rollout`` and ``ppo_update`` do it.

    Returns (markdown lines, summary dict for ``ppo_vs_grpo_table``).
    """
    lines = ["## PPO step (chapter 8.4)", ""]
    lines += [
        f"Flags: the defaults of `trainer/train_ppo.py` with `--batch_size 2`: one answer per prompt, "
        f"γ = {ppo_args.gamma}, λ = {ppo_args.lam}, clip ε = {ppo_args.clip_epsilon}, kl_coef = "
        f"{ppo_args.kl_coef}, vf_coef = {ppo_args.vf_coef}, {ppo_args.ppo_update_iters} epochs of minibatches "
        f"of {ppo_args.mini_batch_size}, actor lr {ppo_args.learning_rate:g}, critic lr "
        f"{ppo_args.critic_learning_rate:g}. Same two prompts, the same starting policy.",
        "",
    ]

    # 1. ppo_rollout
    actor.train()
    critic.train()
    engine = TorchRolloutEngine(actor, tokenizer, generator=torch.Generator().manual_seed(seed))
    roles = RolloutRoles(engine, tokenizer, calculate_rewards, None, ref_model)
    rollout_batch = train_ppo.ppo_rollout(
        batch, roles, critic, ppo_args, "cpu", autocast_context("cpu", ppo_args.dtype)
    )
    mask = rollout_batch.completion_mask  # [B, R]
    R = mask.size(1)
    lines += [f"### {stages[0]}", ""]
    lines += [
        "`ppo_rollout` samples one answer per prompt and scores it as GRPO does; under `no_grad` it also "
        "gets the reference log-probs and the critic's [价值模型] old values V(s_t) for every completion "
        "position (`CriticModel`, chapter 8.4.1; its value head starts at 0, so V = 0 at the first step).",
        "",
    ]
    block = format_tensor("output_ids", rollout_batch.output_ids, max_values=10)
    block += format_tensor("completion_mask", mask, max_values=12)
    block += [f"answer lengths: {mask.sum(dim=1).tolist()}"]
    block += ["answers:"] + [
        f"  [{i}] {json.dumps(c, ensure_ascii=False)}" for i, c in enumerate(rollout_batch.debug["completions"])
    ]
    block += format_tensor("rule_rewards", rollout_batch.reward_parts["rule_rewards"], decimals=6)
    block += format_tensor("answer_rewards", rollout_batch.reward_parts["answer_rewards"], decimals=6)
    block += format_tensor("rewards", rollout_batch.rewards, decimals=6)
    block += format_tensor("old_per_token_logps", rollout_batch.old_per_token_logps)
    block += format_tensor("ref_per_token_logps", rollout_batch.ref_per_token_logps)
    block += format_tensor("old_resp_values", rollout_batch.old_resp_values, max_values=12)
    lines += code_block(block)
    lines += [
        f"(`rewards` = rule + reward model + {ppo_args.answer_reward_weight:g} × answer, computed by "
        "`calculate_rewards` as in the GRPO step.)",
        "",
    ]

    # 2-4. the same functions ppo_rollout called, shown stage by stage
    rewards = rollout_batch.rewards  # [B]
    scores = train_ppo.normalize_rewards(rewards) if ppo_args.reward_norm else rewards  # [B]
    token_rewards = train_ppo.place_sequence_rewards(scores, mask)  # [B, R]
    gae_advantages, returns = train_ppo.compute_gae(
        token_rewards, rollout_batch.old_resp_values, mask, ppo_args.gamma, ppo_args.lam
    )  # [B, R]
    whitened = train_ppo.masked_whiten(gae_advantages, mask)  # [B, R]
    lines += [f"### {stages[1]}", ""]
    lines += [
        "`place_sequence_rewards` (chapter 8.4.2): the reward model scores whole answers, so the scalar "
        "goes on the answer's last real token (its EOS) and every other token gets 0.",
        "",
    ]
    last = (mask.sum(dim=1) - 1).tolist()  # last real token per row
    lines += code_block(
        [f"last real token per row: {last}"] + format_window("token_rewards", token_rewards, last, decimals=6)
    )
    lines += [f"### {stages[2]}", ""]
    lines += [
        "`compute_gae` (chapter 8.4.2, GAE [广义优势估计]): δ_t = r_t + γ V(s_{t+1}) − V(s_t), "
        "A_t = δ_t + γ λ A_{t+1}, walking backwards from the last real token; returns = A + V are the "
        "critic's targets. With V = 0 and γ = 1, A_t = λ^(L−1−t) × r: the reward flows back to earlier "
        f"tokens, multiplied by λ once per token (here λ = {ppo_args.lam:g}). At λ = 1 (the default) every "
        "token of an answer gets its whole reward minus the critic's value; at the chapter's λ = 0.95 the "
        "first of 50 tokens would get 0.95^49 ≈ 8% of it.",
        "",
    ]
    block = format_tensor("advantages (GAE, before whitening)", gae_advantages, max_values=12)
    block += format_window("old_resp_values", rollout_batch.old_resp_values, last, decimals=6)
    block += format_window("advantages (GAE, before whitening)", gae_advantages, last, decimals=6)
    block += format_window("returns", returns, last, decimals=6)
    lines += code_block(block)
    lines += [f"### {stages[3]}", ""]
    lines += [
        "`masked_whiten` (chapter 8.4.2, 优势标准化): (A − mean) / sqrt(var + 1e-8) over the real tokens of the "
        "whole batch. Whitening makes the advantages of each batch mean 0, std 1. With λ = 1 and V = 0, an "
        "answer rewarded above the batch's token-weighted mean gets a positive advantage on every token, the "
        "others a negative one; with λ < 1 and all rewards positive, the early tokens of an answer can go "
        "negative even when its reward is above the batch's, while its late tokens go positive.",
        "",
    ]
    max_diff = (whitened - rollout_batch.advantages).abs().max().item()
    block = format_tensor("advantages (whitened)", whitened, max_values=12)
    block += [
        f"masked mean {masked_mean(whitened, mask).item():.6f}, masked std "
        f"{masked_mean(whitened**2, mask).sqrt().item():.6f}",
        f"max |difference| from the advantages ppo_rollout returned: {max_diff:.2e}",
    ]
    lines += code_block(block)

    # 5. ppo_update
    with torch.no_grad():
        first_per_token_logps = compute_per_token_logps(
            actor, rollout_batch.output_ids, R, rollout_batch.full_mask, ppo_args.temperature
        ).per_token_logps  # [B, R]
    first_ratio_error = ((first_per_token_logps - rollout_batch.old_per_token_logps).abs() * mask).max().item()
    actor_optimizer = build_policy_optimizer(
        actor, ppo_args.learning_rate, ppo_args.weight_decay, ppo_args.final_norm_learning_rate
    )  # as train_ppo.py builds it
    critic_optimizer = adamw(
        critic.parameters(), lr=ppo_args.critic_learning_rate, weight_decay=ppo_args.weight_decay
    )  # as train_ppo.py builds it
    actor_scheduler = build_cosine_scheduler(actor_optimizer, ppo_args.max_steps)
    critic_scheduler = build_cosine_scheduler(critic_optimizer, ppo_args.max_steps)
    update = train_ppo.ppo_update(
        rollout_batch,
        train_ppo.PPOLearners(actor, critic, (actor_optimizer, critic_optimizer), (actor_scheduler, critic_scheduler)),
        ppo_args,
        "cpu",
        torch.Generator().manual_seed(seed),
        autocast_context("cpu", ppo_args.dtype),
    )
    lines += [f"### {stages[4]}", ""]
    lines += [
        "`ppo_update` (chapters 8.4.3–8.4.4) reuses this one rollout for several optimizer steps: each "
        "epoch shuffles the batch into minibatches; each minibatch adds the clipped surrogate + "
        "kl_coef × k3 (`ppo_policy_loss`) and vf_coef × the clipped value loss (`ppo_value_loss`), then steps "
        "both AdamW optimizers. At the first minibatch the actor is still the rollout policy, so the ratio "
        "is 1; later minibatches see a moved policy. Averages over the minibatches:",
        "",
    ]
    block = [f"first minibatch: max |log ratio| = {first_ratio_error:.2e}"]
    block += [f"{key}: {value:.6f}" for key, value in update.items()]
    lines += code_block(block)

    # 6. after the update
    with torch.no_grad():
        new_per_token_logps = compute_per_token_logps(
            actor, rollout_batch.output_ids, R, rollout_batch.full_mask, ppo_args.temperature
        ).per_token_logps  # [B, R]
        policy_loss, stats = train_ppo.ppo_policy_loss(
            new_per_token_logps,
            rollout_batch.old_per_token_logps,
            rollout_batch.ref_per_token_logps,
            rollout_batch.advantages,
            mask,
            ppo_args.clip_epsilon,
            ppo_args.kl_coef,
        )
        new_values = critic(rollout_batch.output_ids, attention_mask=rollout_batch.full_mask).values[
            :, -R - 1 : -1
        ]  # [B, R], as ppo_update
        value_loss, value_clipfrac = train_ppo.ppo_value_loss(
            new_values, rollout_batch.old_resp_values, rollout_batch.returns, mask, ppo_args.cliprange_value
        )
    ratio = torch.exp(new_per_token_logps - rollout_batch.old_per_token_logps) * mask  # [B, R], for display
    clipped_ratio = torch.clamp(ratio, 1 - ppo_args.clip_epsilon, 1 + ppo_args.clip_epsilon) * mask
    lines += [f"### {stages[5]}", ""]
    lines += [
        "Scoring the same answers with the updated actor and critic shows what the next minibatch would "
        "see. `ppo_policy_loss` (chapter 8.4.3, 裁剪代理目标): ratio = exp(logp − old_logp), per token "
        "max(−A·ratio, −A·clip(ratio, 1−ε, 1+ε)), so a token whose ratio left [1−ε, 1+ε] in the favoured "
        "direction stops pushing; approx KL = 0.5·E[(log ratio)²] stops the epochs early when it passes "
        f"`early_stop_kl` = {ppo_args.early_stop_kl}. `ppo_value_loss` (chapter 8.4.4) is 0.5 × max of the "
        "unclipped and the clipped squared error to the returns.",
        "",
    ]
    block = format_tensor("ratio", ratio, max_values=12)
    block += format_tensor("-A * ratio", -rollout_batch.advantages * ratio, max_values=12)
    block += format_tensor("-A * clip(ratio)", -rollout_batch.advantages * clipped_ratio, max_values=12)
    block += [
        f"policy_loss (surrogate + {ppo_args.kl_coef} × k3): {policy_loss.item():.6f}",
        f"approx_kl: {stats['approx_kl'].item():.3e}   clipfrac: {stats['clipfrac'].item():.4f}   "
        f"kl_ref (k3): {stats['kl_ref'].item():.3e}",
    ]
    block += format_tensor("values after the update", new_values * mask, max_values=12)
    block += [f"value_loss: {value_loss.item():.6f}   value_clipfrac: {value_clipfrac.item():.4f}"]
    lines += code_block(block)
    summary = {
        "answers": rollout_batch.output_ids.size(0),
        "advantage_shape": list(rollout_batch.advantages.shape),
        "advantages_first_answer": len(set(rollout_batch.advantages[0][mask[0].bool()].tolist())),
        "models": model_parameters(actor, ref_model, critic),
        "optimizer_steps": int(update["optimizer_steps"]),
    }
    return lines, summary


def ppo_vs_grpo_table(grpo_summary, ppo_summary):
    """The chapter's PPO-vs-GRPO comparison (chapter 8.7), filled in with what the two walked steps measured.

    grpo_summary, ppo_summary: the dicts ``grpo_walkthrough`` / ``ppo_walkthrough`` return. Returns markdown
    lines (a table: answers sampled, advantage shape, distinct advantages within one answer, models and
    parameters in memory, optimizer steps per rollout).
    """
    rows = [
        ("answers sampled for 2 prompts", grpo_summary["answers"], ppo_summary["answers"]),
        ("advantage shape", grpo_summary["advantage_shape"], ppo_summary["advantage_shape"]),
        (
            "distinct advantage values within answer 0",
            grpo_summary["advantages_first_answer"],
            ppo_summary["advantages_first_answer"],
        ),
        (
            "models in memory (M parameters)",
            f"policy + reference: {grpo_summary['models']}",
            f"actor + reference + critic: {ppo_summary['models']}",
        ),
        ("optimizer steps from this rollout", grpo_summary["optimizer_steps"], ppo_summary["optimizer_steps"]),
    ]
    lines = ["## PPO vs GRPO on this batch (chapter 8.7)", "", "| | GRPO | PPO |", "| --- | --- | --- |"]
    lines += [f"| {name} | {grpo} | {ppo} |" for name, grpo, ppo in rows]
    lines += [
        "",
        "GRPO's baseline is the group (组内标准化): one advantage per answer, broadcast to its tokens, no "
        "critic. PPO's critic and GAE give each token its own advantage, at the cost of a third model and of "
        "learning V first (at this first step V = 0, so with λ = 1 an answer's tokens still share one "
        "advantage; they part as V(s_t) learns to tell the states apart).",
        "",
    ]
    return lines


def main(argv=None):
    args = parse_args(argv)
    grpo_args = train_grpo.parse_args(training_flags(args) + ["--num_generations", str(args.num_generations)])
    ppo_args = train_ppo.parse_args(training_flags(args))
    model, ref_model, tokenizer, lm_config = load_policy_and_reference(args, args.seed)
    dataset = RLAIFDataset(args.data_path, tokenizer, thinking_ratio=1.0, seed=args.seed)
    for index in args.prompt_indices:
        if not 0 <= index < len(dataset):
            sys.exit(f"walkthrough.py: --prompt_indices {index} is outside {args.data_path} ({len(dataset)} prompts)")
    rows = [dataset[i] for i in args.prompt_indices]
    batch = {"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]}

    flags = sys.argv[1:] if argv is None else argv
    command = " ".join(["python scripts/walkthrough.py"] + flags)
    lines = [
        "# Walkthrough: one GRPO step and one PPO step, with the real tensors",
        "",
        f"Generated by `{command}` (seed {args.seed}, CPU, weights `{args.from_weight}` with hidden size "
        f"{args.hidden_size} and {args.num_hidden_layers} layers, prompts {args.prompt_indices} of "
        f"`{os.path.relpath(args.data_path, ROOT)}`). Every number below is printed by the program, which "
        "calls the training scripts' own functions; re-run it to check them. Shapes: B prompts, G answers "
        "per prompt, P prompt tokens, R completion tokens; rows past the first few and values past the first "
        "few of a row are elided.",
        "",
    ]
    grpo_lines, grpo_summary = grpo_walkthrough(batch, grpo_args, model, ref_model, tokenizer, args.seed)
    lines += grpo_lines
    actor, ref_model, tokenizer, lm_config = load_policy_and_reference(args, args.seed)
    critic = train_ppo.build_critic(lm_config, actor, ppo_args.from_weight != "none", "cpu", ppo_args)
    ppo_lines, ppo_summary = ppo_walkthrough(batch, ppo_args, actor, ref_model, critic, tokenizer, args.seed)
    lines += ppo_lines
    lines += ppo_vs_grpo_table(grpo_summary, ppo_summary)

    def write(tmp_path):
        with open(tmp_path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines).rstrip() + "\n")

    atomic_write({args.out: write})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
