"""Agent RL for a MiniMind policy: multi-turn tool use trained with the chapter's GRPO / CISPO (chapter 8.5).

One step, in the order of ``train_grpo.py``: the policy answers each prompt G times, calling tools over up to
``--max_turns`` turns (``agent_rollout.py``: the tools' replies sit in the sequence with mask 0, only the model's
own tokens are trained); rewards (upstream MiniMind's agent reward, the functions below); group advantages (8.5.1);
reference log-probs on the model's tokens; the CISPO / GRPO loss with beta * k3 KL (8.5.2, 8.6; the family in
``grpo_family.py``). ``main`` builds what the step uses in numbered blocks, then runs the loop with the update
written out. Source: upstream MiniMind's ``trainer/train_agent.py`` (jingyaogong/minimind); the tools and their
bounds are ``agent_tools.py``. Prompts are cut from the left to ``--max_total_len - --max_gen_len`` tokens.
``--rollout_engine sglang``: an SGLang server generates every turn, the policy pushed to it after each update
(chapter 8.2, ``rollout_engine.SGLangRolloutEngine``); old log-probs as ``--sglang_logprobs`` says.

Run (upstream-format rows: conversations whose system turn carries ``tools``, and ``gt``):
    python trainer/train_agent.py
    python trainer/train_agent.py --data_path dataset/agent_rl.jsonl --reward_model_path none --debug_mode 1
    python trainer/train_agent.py --rollout_engine sglang --sglang_url http://127.0.0.1:30000
"""
import argparse
import copy
import os
import random
import re
import sys
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `python trainer/x.py` from any folder imports this checkout's packages

import torch
from torch.utils.data import DataLoader

from dataset.lm_dataset import (
    DataFormatError, ResumableBatchSampler, count_total_steps, escape_conversations, iter_jsonl, resumable_batches,
)
from trainer.agent_rollout import agent_rollout, conversation_tools
from trainer.agent_tools import check_arguments, parse_tool_calls
from trainer.grpo_family import (
    LOSS_TYPES, TOKEN_SUM_LOSS_TYPES, add_family_args, build_loss_config, check_family_args, family_loss,
    frac_reward_zero_std, scale_gradients, update_metrics,
)
from trainer.infra.checkpoints import claim_save_dir, resume_command, save_checkpoint, start_or_resume
from trainer.infra.distributed import (
    Logger, all_ranks_mean, any_rank, compile_for_training, init_distributed_mode, mean_over_ranks,
    rank_and_world_size, setup_seed, shutdown_distributed, unwrap_model, wrap_ddp,
)
from trainer.infra.dtypes import autocast_context, resolve_train_dtype, reward_model_dtype
from trainer.infra.evaluation import evaluate_if_due
from trainer.infra.flags import (
    add_common_rl_args, check_common_rl_args, check_ranges, rollout_engine_kwargs, same_file,
)
from trainer.infra.metrics import StepLog, gpu_memory_metrics, open_metrics
from trainer.infra.optimizer import (
    accumulation_window_size, build_cosine_scheduler, build_policy_optimizer, project_scale_only_gradients,
)
from trainer.infra.stopping import BadStepGuard, StopSignal, nonfinite_parts
from trainer.infra.weights import build_config, load_policy, load_tokenizer, weight_path
from trainer.rollout_engine import compute_per_token_logps, create_rollout_engine
from trainer.trainer_utils import grpo_advantages, load_reward_model, rep_penalty, rule_reward, split_thinking

AGENT_TRAIN_DATA = os.path.join(ROOT, "dataset", "agent_rl_train.jsonl")
AGENT_VAL_DATA = os.path.join(ROOT, "dataset", "agent_rl_val.jsonl")
AGENT_TEST_DATA = os.path.join(ROOT, "dataset", "agent_rl_test.jsonl")


# ----------------------------------------------------------------------------- data
class AgentRLDataset(torch.utils.data.Dataset):
    """Upstream MiniMind's agent RL rows (``AgentRLDataset``): ``{"conversations": [...], "gt": [values]}``, a
    system turn carrying the tool schemas as ``tools`` (a JSON string or a list). Items: {"messages": the prompt
    turns (a final assistant turn dropped, contents escaped as ``RLAIFDataset`` escapes them), "gt": list[str],
    "open_thinking": bool, "index": int}. A prompt opens thinking with probability ``thinking_ratio``, drawn as
    ``RLAIFDataset`` draws it (a fixed function of seed and index: a resumed run sees the same prompts). Every row
    is checked when the file is read: bad input fails before any model is built. Raises DataFormatError naming file
    and line (``check_agent_row``), ValueError for a ratio outside [0, 1]."""

    def __init__(self, path, tokenizer, thinking_ratio=0.0, seed=42):
        if not 0.0 <= thinking_ratio <= 1.0:
            raise ValueError(f"thinking_ratio must be in [0, 1], got {thinking_ratio}")
        special_tokens = list(tokenizer.all_special_tokens)
        self.rows = [check_agent_row(row, f"{path}:{line}", special_tokens) for line, row in iter_jsonl(path)]
        self.thinking_ratio, self.seed = thinking_ratio, seed

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        open_thinking = random.Random(self.seed * 1_000_003 + index).random() < self.thinking_ratio
        return dict(self.rows[index], open_thinking=open_thinking, index=index)


def check_agent_row(row, where, special_tokens):
    """One row as {"messages", "gt"}; DataFormatError ``where: reason`` for a row without a conversation of
    role/content strings, without ``tools`` on a system turn (or with tools that are not JSON, not schemas, or not
    registered in ``agent_tools``), without a ``gt`` list, or without a user turn to answer."""
    conversations = row.get("conversations") if isinstance(row, dict) else None
    if not isinstance(conversations, list) or not conversations or not all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
            for t in conversations):
        raise DataFormatError(f"{where}: expected a non-empty 'conversations' list of role/content strings")
    if not any(t["role"] == "system" and t.get("tools") for t in conversations):
        raise DataFormatError(f"{where}: no system turn with 'tools' (the tool schemas the model may call)")
    gt = row.get("gt")
    if not isinstance(gt, list) or not all(isinstance(g, (str, int, float)) and not isinstance(g, bool) for g in gt):
        raise DataFormatError(f"{where}: expected 'gt', a list of the values a right answer contains, got "
                              f"{str(gt)[:60]!r}")
    try:
        conversation_tools(conversations)  # the schemas parse and every tool is registered
    except ValueError as error:
        raise DataFormatError(f"{where}: {error}") from error
    if conversations[-1]["role"] == "assistant":
        conversations = conversations[:-1]  # upstream's reference answer, not part of the prompt
    if not any(t["role"] == "user" for t in conversations):
        raise DataFormatError(f"{where}: no user turn to use as the prompt")
    escaped, _ = escape_conversations(conversations, special_tokens)
    messages = [dict(turn, content=e["content"]) for turn, e in zip(conversations, escaped)]
    return {"messages": messages, "gt": [str(g) for g in gt]}


def collate_rows(items):
    """A batch of dataset items as lists (messages and gt keep their nesting) and the indices as a tensor."""
    return {"messages": [item["messages"] for item in items], "gt": [item["gt"] for item in items],
            "open_thinking": [item["open_thinking"] for item in items],
            "index": torch.tensor([item["index"] for item in items], dtype=torch.long)}


# ----------------------------------------------------------------------------- rewards (upstream's agent reward)
TAG_PENALTY = 0.5  # per unbalanced <tool_call> / </tool_call> tag
CALL_COUNT_REWARD = 0.5  # +0.5 when the valid calls match len(gt), else -0.5 per call too many or too few
UNFINISHED_PENALTY = 0.5  # the last turn still called a tool
REWARD_CLIP = 3.0
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\w.])")


def tag_penalty(turn_answers):
    """-0.5 per unbalanced tool tag: -0.5 * sum over turns of |#'<tool_call>' - #'</tool_call>'| (upstream
    MiniMind's train_agent.py ``calculate_rewards``). turn_answers: each turn's text after '</think>'."""
    return -TAG_PENALTY * sum(abs(t.count("<tool_call>") - t.count("</tool_call>")) for t in turn_answers)


def gt_found(text, gt):
    """The ground-truth values of ``gt`` that ``text`` contains (upstream's ``validate_gt_in_text``): a value as a
    case-insensitive substring, or a number equal (within 1e-6) to a number standing alone in the text (commas
    removed). Returns a set of strings."""
    numbers = [float(n) for n in NUMBER.findall(text.replace(",", ""))]
    found = set()
    for value in gt:
        value = str(value).strip()
        plain = value.replace(",", "")
        if value and value.lower() in text.lower():
            found.add(value)
        elif re.fullmatch(r"[-+]?\d+(?:\.\d+)?", plain) and any(abs(float(plain) - n) < 1e-6 for n in numbers):
            found.add(value)
    return found


def call_count_reward(num_calls, num_valid_calls, num_gt):
    """+0.5 when the valid calls match the ground truth's count and no call is invalid, else -0.5 per unit of
    gap = |valid - len(gt)| + (calls - valid) (upstream's ``tool_gap``)."""
    gap = abs(num_valid_calls - num_gt) + max(0, num_calls - num_valid_calls)
    return CALL_COUNT_REWARD if gap == 0 else -CALL_COUNT_REWARD * gap


def gt_reward(final_text, gt, weight=2.5):
    """weight x the share of ground-truth values found in the final answer (upstream: 2.5); 0 for an empty gt."""
    return weight * len(gt_found(final_text, gt)) / len(gt) if gt else 0.0


def final_answer_text(turn_answers, unfinished):
    """The text a right answer must contain: the last turn's answer after its last '</tool_call>', "" when the
    conversation ended on a call (upstream's ``final_text``)."""
    if unfinished or not turn_answers:
        return ""
    return turn_answers[-1].split("</tool_call>")[-1]


def count_calls(turn_answers, allowed):
    """(calls, valid calls) over the turns: every <tool_call> block (a malformed one counts, as an invalid call;
    upstream drops it) and those naming an offered tool whose arguments pass ``check_arguments``."""
    calls = [call for text in turn_answers for call in parse_tool_calls(text)]
    valid = sum(call.error is None and call.name in allowed and check_arguments(call.name, call.arguments) is None
                for call in calls)
    return len(calls), valid


def agent_reward(turn_texts, gt, allowed, unfinished, reward_model_score=0.0, gt_weight=2.5):
    """One answer's reward and its parts (upstream MiniMind's train_agent.py ``calculate_rewards``), clipped to
    [-3, 3]: ``tag_penalty``; without a call the chapter's ``rule_reward`` (length, thinking, minus the
    repetition penalty; 8.3) + the reward model's score; with calls ``call_count_reward`` + ``gt_reward`` - 0.5
    when unfinished - the repetition penalty of the final text. turn_texts: the model's turns; allowed: offered
    tool names. Departures: the no-call length window is the chapter's 20-800 characters (upstream 5-800); a
    malformed call counts as an invalid call (upstream drops it). "accuracy": every gt value in the final text
    (an empty gt: no call). Returns a dict of floats (``REWARD_PARTS``, "reward", "accuracy", "called")."""
    turn_answers = [split_thinking(text)[1] for text in turn_texts]
    parts = dict.fromkeys(REWARD_PARTS, 0.0)
    parts["tag_penalty"] = tag_penalty(turn_answers)
    num_calls, num_valid = count_calls(turn_answers, allowed)
    final_text = final_answer_text(turn_answers, unfinished)
    if not num_calls:
        parts["rule_reward"] = rule_reward(turn_texts[-1])
        parts["reward_model_score"] = reward_model_score
    else:
        parts["call_reward"] = call_count_reward(num_calls, num_valid, len(gt))
        parts["answer_reward"] = gt_reward(final_text, gt, gt_weight)
        parts["unfinished_penalty"] = -UNFINISHED_PENALTY if unfinished else 0.0
        parts["repetition_penalty"] = -rep_penalty(final_text or turn_answers[-1])
    total = max(-REWARD_CLIP, min(REWARD_CLIP, sum(parts.values())))
    correct = len(gt_found(final_text, gt)) == len(gt) if gt else not num_calls  # empty gt: no call is right
    return dict(parts, reward=total, accuracy=float(correct), called=float(num_calls > 0))


REWARD_PARTS = ("tag_penalty", "rule_reward", "reward_model_score", "call_reward", "answer_reward",
                "unfinished_penalty", "repetition_penalty")


def calculate_agent_rewards(messages, turn_texts, unfinished, gts, reward_model, gt_weight):
    """The rewards of N answers (``agent_reward``); the reward model scores the answers without a call in one
    batch (as upstream, which scores those only). messages: N prompt conversations; turn_texts: N lists of the
    model's turns; unfinished: N bools; gts: N lists. Returns a dict of float32 tensors [N]: "rewards" and
    "rule_rewards", "reward_model_scores", "answer_rewards" (the gt reward), "call_rewards", the penalties,
    "accuracy" and "called" (0/1)."""
    allowed = [[t["function"]["name"] for t in conversation_tools(m)[1] or []] for m in messages]
    no_call = [i for i, texts in enumerate(turn_texts)
               if not count_calls([split_thinking(t)[1] for t in texts], allowed[i])[0]]
    scores = [0.0] * len(turn_texts)
    if reward_model is not None and no_call:
        prompts = [[{"role": t["role"], "content": t["content"]} for t in messages[i]] for i in no_call]
        for i, score in zip(no_call, reward_model.get_scores(prompts, [turn_texts[i][-1] for i in no_call])):
            scores[i] = score
    rows = [agent_reward(texts, gt, names, bool(done), score, gt_weight)
            for texts, gt, names, done, score in zip(turn_texts, gts, allowed, unfinished, scores)]
    keys = {"rewards": "reward", "rule_rewards": "rule_reward", "reward_model_scores": "reward_model_score",
            "answer_rewards": "answer_reward", "call_rewards": "call_reward", "tag_penalties": "tag_penalty",
            "unfinished_penalties": "unfinished_penalty", "repetition_penalties": "repetition_penalty",
            "accuracy": "accuracy", "called": "called"}
    return {name: torch.tensor([row[key] for row in rows], dtype=torch.float32) for name, key in keys.items()}


# ----------------------------------------------------------------------------- flags
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind agent RL (multi-turn tool use, GRPO / CISPO)")
    add_common_rl_args(parser)
    parser.add_argument("--save_weight", default="agent", help="name of the saved weights ({name}_{hidden}.pth)")
    parser.add_argument("--num_generations", type=int, default=4, help="G, conversations sampled per prompt")
    parser.add_argument("--max_turns", type=int, default=3, help="model turns per conversation (upstream's 3)")
    parser.add_argument("--max_total_len", type=int, default=1024,
                        help="prompt + every turn and tool reply, in tokens (prompts cut from the left to "
                             "max_total_len - max_gen_len; --max_gen_len is per turn)")
    parser.add_argument("--accumulation_steps", type=int, default=1,
                        help="steps (rollouts) whose gradients make one optimizer step")
    parser.add_argument("--loss_type", default="cispo",
                        help=f"one of {', '.join(LOSS_TYPES)}: the chapter's cispo (default) and grpo, then the family")
    parser.add_argument("--beta", type=float, default=0.1,
                        help="weight of the k3 KL to the reference (0: no reference model is built)")
    parser.add_argument("--epsilon", type=float, default=None, help="clipped family: lower clip 1 - epsilon (0.2)")
    parser.add_argument("--epsilon_high", type=float, default=None,
                        help="cispo: the clamp of the ratio weight (5.0); clipped family: upper clip 1 + epsilon_high")
    parser.add_argument("--num_iterations", type=int, default=1, help="mu: updates on each rollout")
    add_family_args(parser)
    # the bundled task's sizes: a prompt with the calculator's schema is ~610 tokens, a call ~95, its reply ~70;
    # the start is the copy-trained out/agent_copy_256.pth; the reward is correctness and valid calls (the reward
    # model off: its score on an answer without a call can out-earn a valid call, docs/departures.md); steps and
    # learning rate were chosen on agent_rl_val, and the run reports agent_rl_test (docs/agent.md)
    parser.set_defaults(data_path=AGENT_TRAIN_DATA, from_weight="agent_copy", reward_model_path="none",
                        thinking_ratio=0.0, answer_reward_weight=2.5, max_gen_len=128, max_steps=60,
                        eval_interval=60)
    args = parser.parse_args(argv)
    if args.eval_data_path is None and same_file(args.data_path, AGENT_TRAIN_DATA):
        args.eval_data_path = AGENT_TEST_DATA  # the bundled task's test split (settings chosen on AGENT_VAL_DATA)
    check_common_rl_args(parser, args)
    check_ranges(parser, args, at_least_1=("accumulation_steps", "num_iterations", "max_turns"),
                 at_least_2=("num_generations",), non_negative=("beta", "answer_reward_weight"))
    if args.max_total_len <= args.max_gen_len:
        parser.error(f"--max_total_len must be > --max_gen_len ({args.max_gen_len}), got {args.max_total_len}")
    if args.top_p != 1.0 or args.top_k:
        parser.error("train_agent.py samples every turn from the whole distribution (the loss's log-probs are over "
                     "it): use --top_p 1.0 and --top_k 0")
    if args.num_iterations > 1 and args.accumulation_steps > 1:
        parser.error("--num_iterations > 1 updates once per iteration: use it with --accumulation_steps 1")
    check_family_args(parser, args)
    return args


# ----------------------------------------------------------------------------- one step
@dataclass
class AgentRolloutBatch:
    """What ``agent_step_rollout`` hands to the updates: B prompts x G conversations and what the loss needs."""
    rollout: object  # agent_rollout.AgentRolloutResult: ids, masks, old log-probs, turns, call counts
    completion_mask: torch.Tensor  # [B*G, R] 0/1, the model's own tokens (the loss's)
    advantages: torch.Tensor  # [B*G] fp32 (8.5.1)
    ref_per_token_logps: Optional[torch.Tensor]  # [B*G, R] fp32 (8.6), None with --beta 0
    rewards: torch.Tensor  # [B*G] fp32
    reward_parts: dict  # the reward function's parts, each [B*G]
    num_items_in_batch: float  # model tokens of every process's batch / processes (dapo's normaliser)
    metrics: dict  # the rollout's own: calls, turns, cuts, groups of equal rewards


def ended_with_eos(rollout, eos_token_id):
    """bool [N]: each conversation's last model token is EOS (its last turn was not cut at --max_gen_len)."""
    mask = rollout.completion_mask  # [N, R]
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask.bool()  # [N, R], the last model token
    return ((rollout.completion_ids == eos_token_id) & last).any(dim=1)  # [N]


@torch.no_grad()
def agent_step_rollout(batch, model, ref_model, reward_fn, reward_model, tokenizer, args, autocast, server=None):
    """Steps 1-4 of an agent RL step: multi-turn rollout (``agent_rollout``), rewards, group advantages (8.5.1),
    reference log-probs on the rollout's tokens (8.6). ``reward_fn``: ``calculate_agent_rewards`` or one with its
    arguments and keys; ``ref_model`` None with --beta 0; ``server``: the ``SGLangRolloutEngine`` of
    ``--rollout_engine sglang`` (None: the policy's own generate). Returns an ``AgentRolloutBatch`` of B*G rows."""
    G = args.num_generations
    # 1. rollout: every conversation of the batch advances turn by turn; tool replies have mask 0
    with autocast:
        rollout = agent_rollout(model, tokenizer, batch["messages"], G, max_new_tokens=args.max_gen_len,
                                max_total_len=args.max_total_len, temperature=args.temperature,
                                max_turns=args.max_turns, chat_template_kwargs=template_kwargs(batch["open_thinking"]),
                                server=server)
    device = rollout.completion_ids.device
    completion_mask = rollout.completion_mask  # [B*G, R]
    if args.mask_truncated_completions:  # DAPO: a last turn cut at --max_gen_len teaches nothing about its end
        completion_mask = completion_mask * ended_with_eos(rollout, tokenizer.eos_token_id).unsqueeze(1)

    # 2. rewards
    messages = [m for m in batch["messages"] for _ in range(G)]
    gts = [gt for gt in batch["gt"] for _ in range(G)]
    reward_parts = reward_fn(messages, rollout.turn_texts, rollout.unfinished.tolist(), gts, reward_model,
                             args.answer_reward_weight)
    rewards = reward_parts["rewards"].to(device)  # [B*G]

    # 3. group-relative advantages (8.5.1)
    advantages = grpo_advantages(rewards, G, scale_rewards=args.scale_rewards)  # [B*G]

    # 4. reference log-probs of the whole conversation, read on the model's tokens by the loss's mask
    ref_per_token_logps = None
    if ref_model is not None:
        with autocast:
            ref_per_token_logps = compute_per_token_logps(ref_model, rollout.output_ids, rollout.completion_ids.size(1),
                                                          rollout.attention_mask, args.temperature).per_token_logps
    calls = rollout.num_tool_calls.sum().item()
    metrics = {"tool_call_share": (rollout.num_tool_calls > 0).float().mean().item(),
               "valid_call_share": rollout.num_valid_calls.sum().item() / calls if calls else 0.0,
               "turns": rollout.num_turns.float().mean().item(),
               "unfinished_share": rollout.unfinished.float().mean().item(),
               "observation_len": (rollout.attention_mask[:, -completion_mask.size(1):] - rollout.completion_mask
                                   ).sum(dim=1).float().mean().item(),  # tool replies and template tokens
               **{key: float(value) for key, value in rollout.metrics.items()},
               "frac_reward_zero_std": frac_reward_zero_std(rewards, G)}
    return AgentRolloutBatch(
        rollout=rollout, completion_mask=completion_mask, advantages=advantages,
        ref_per_token_logps=ref_per_token_logps, rewards=rewards, reward_parts=reward_parts,
        num_items_in_batch=all_ranks_mean(completion_mask.sum().double(), device), metrics=metrics)


def agent_policy_loss(model, rollout_batch, loss_config, args, autocast):
    """Step 5, once per update: the policy's log-probs of the whole conversations through ``model`` (the DDP
    wrapper when distributed) and ``family_loss`` on the model's tokens (the mask) with the k3 KL penalty.
    Returns (loss to backpropagate, metrics of this update); the loop divides the loss by its window."""
    rollout, completion_mask = rollout_batch.rollout, rollout_batch.completion_mask
    old_per_token_logps = rollout.old_per_token_logps.detach()  # [B*G, R], 0 on tool replies
    with autocast:
        per_token_logps, aux_loss, entropies = compute_per_token_logps(
            model, rollout.output_ids, rollout.completion_ids.size(1), rollout.attention_mask, args.temperature,
            compute_entropy=True)  # [B*G, R] each
    token_sum = loss_config.loss_type in TOKEN_SUM_LOSS_TYPES  # the window's normaliser waits for its end
    policy_loss, per_token_kl, ratio = family_loss(
        per_token_logps, old_per_token_logps, rollout_batch.ref_per_token_logps, rollout_batch.advantages,
        completion_mask, loss_config, 1.0 if token_sum else None)
    logged_policy_loss = policy_loss.item() / (rollout_batch.num_items_in_batch if token_sum else 1.0)
    metrics = {"policy_loss": logged_policy_loss, "aux_loss": float(aux_loss)}
    metrics.update(update_metrics(per_token_logps.detach(), old_per_token_logps, per_token_kl, ratio, entropies,
                                  rollout_batch, loss_config))
    return policy_loss + aux_loss, metrics


METRIC_PARTS = {"rule_reward": "rule_rewards", "reward_model_score": "reward_model_scores",
                "answer_reward": "answer_rewards", "call_reward": "call_rewards", "tag_penalty": "tag_penalties",
                "unfinished_penalty": "unfinished_penalties", "repetition_penalty": "repetition_penalties",
                "accuracy": "accuracy"}  # metric name -> reward_fn key


def agent_metrics(rollout_batch, updates):
    """The step's metrics: the rewards and their parts, accuracy, tool use, advantages, then the mean of the
    updates' metrics (``ratio_min`` / ``ratio_max``: the extremes over the updates)."""
    update_mean = {key: sum(update[key] for update in updates) / len(updates) for key in updates[0]}
    update_mean.update(ratio_min=min(update["ratio_min"] for update in updates),
                       ratio_max=max(update["ratio_max"] for update in updates))
    parts = rollout_batch.reward_parts
    return {
        "reward": rollout_batch.rewards.mean().item(),
        **{name: parts[key].mean().item() for name, key in METRIC_PARTS.items()},
        "advantages_mean": rollout_batch.advantages.mean().item(),
        "advantages_std": rollout_batch.advantages.std(unbiased=False).item(),
        "response_len": rollout_batch.rollout.completion_mask.sum(dim=1).float().mean().item(),
        **rollout_batch.metrics,
        **update_mean,
    }


def agent_log_line(metrics):
    """The agent's part of the log line (after the rewards): accuracy, tool use, loss, KL, entropy, length, rate."""
    kl_ref = f"kl_ref {metrics['kl_ref']:.4f} | " if "kl_ref" in metrics else ""
    return (f"acc {metrics['accuracy']:.2f} | calls {metrics['tool_call_share']:.2f} valid "
            f"{metrics['valid_call_share']:.2f} | turns {metrics['turns']:.2f} | {kl_ref}"
            f"policy_loss {metrics['policy_loss']:.4f} | entropy {metrics['entropy']:.3f} | "
            f"len {metrics['response_len']:.1f} | lr {metrics['learning_rate']:.2e}")


def template_kwargs(open_thinking):
    """The chat template's arguments of each prompt of a batch: ``open_thinking`` (bools, the dataset's draw by
    ``--thinking_ratio``; a prompt that opens thinking ends in ``<think>\\n``)."""
    return [{"open_thinking": bool(value)} for value in open_thinking]


def mask_segments(tokenizer, ids, mask):
    """[(mask value, text)] of the runs of equal mask in one conversation's tokens (``--debug_mode``)."""
    segments, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            segments.append((mask[start], tokenizer.decode(ids[start:end], skip_special_tokens=False)))
            start = end
    return segments


def print_conversations(step, rollout_batch, tokenizer, num_generations):
    """``--debug_mode``: every conversation of the step, whole, in runs marked by their mask (1: the model's
    tokens, trained; 0: prompt, tool replies and template tokens, seen only), with its reward parts."""
    rollout, parts = rollout_batch.rollout, rollout_batch.reward_parts
    prompt_width = rollout.output_ids.size(1) - rollout.completion_ids.size(1)
    for n in range(rollout.output_ids.size(0)):
        keep = rollout.attention_mask[n].bool().cpu()
        mask = torch.cat([torch.zeros(prompt_width, dtype=torch.long), rollout_batch.completion_mask[n].cpu()])
        ids, mask = rollout.output_ids[n].cpu()[keep].tolist(), mask[keep].tolist()
        Logger(f"[debug] step {step} prompt {n // num_generations} answer {n % num_generations}: reward "
               f"{parts['rewards'][n]:.3f} (rule {parts['rule_rewards'][n]:.3f}, rm "
               f"{parts['reward_model_scores'][n]:.3f}, calls {parts['call_rewards'][n]:.2f}, gt "
               f"{parts['answer_rewards'][n]:.2f}), {rollout.num_turns[n]} turns, {rollout.num_tool_calls[n]} calls "
               f"({rollout.num_valid_calls[n]} valid)")
        for value, text in mask_segments(tokenizer, ids, mask):
            Logger(f"[mask {value}: {'trained' if value else 'not trained'}]\n{text}")


# ----------------------------------------------------------------------------- held-out evaluation
class GreedyPolicy(torch.nn.Module):
    """The policy with ``generate`` always greedy: ``agent_rollout`` of the greedy evaluation."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def generate(self, input_ids, **kwargs):
        return self.policy.generate(input_ids, **dict(kwargs, do_sample=False))


class AgentEvaluator:
    """The run's held-out evaluation (step 0, every --eval_interval steps, the end): the first ``num_prompts`` rows
    answered once each, sampled (own generator, ``seed``) and greedy, reporting ``eval/accuracy_*`` (all gt values
    in the final answer), ``eval/tool_call_share_*`` (answers with a call), ``eval/answers_with_valid_call_*``
    (answers with at least one valid call), ``eval/valid_call_share_*`` (valid calls / calls), ``eval/turns_*`` and
    ``eval/response_len``; ``history`` keeps every call for the before/after lines."""

    def __init__(self, dataset, tokenizer, args, device, seed=1234, batch_size=32):
        self.rows = [dataset[i] for i in range(min(args.eval_num_prompts, len(dataset)))]
        self.num_prompts = len(self.rows)
        self.tokenizer, self.args, self.device, self.seed, self.batch_size = tokenizer, args, device, seed, batch_size
        self.history = []

    @torch.no_grad()
    def evaluate(self, model, greedy, should_stop=None):
        """{accuracy, tool_call_share, answers_with_valid_call, valid_call_share, turns, response_len}, or None when
        stopped."""
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        totals = dict.fromkeys(("accuracy", "tool_call_share", "answers_with_valid_call", "turns", "response_len",
                                "calls", "valid"), 0.0)
        policy = GreedyPolicy(unwrap_model(model)) if greedy else unwrap_model(model)
        for start in range(0, self.num_prompts, self.batch_size):
            if should_stop is not None and should_stop():
                return None
            rows = self.rows[start:start + self.batch_size]
            rollout = agent_rollout(policy, self.tokenizer, [r["messages"] for r in rows], 1,
                                    max_new_tokens=self.args.max_gen_len, max_total_len=self.args.max_total_len,
                                    temperature=self.args.temperature, max_turns=self.args.max_turns,
                                    generator=generator,
                                    chat_template_kwargs=template_kwargs([r["open_thinking"] for r in rows]))
            parts = calculate_agent_rewards([r["messages"] for r in rows], rollout.turn_texts,
                                            rollout.unfinished.tolist(), [r["gt"] for r in rows], None, 1.0)
            totals["accuracy"] += parts["accuracy"].sum().item()
            totals["tool_call_share"] += (rollout.num_tool_calls > 0).sum().item()
            totals["answers_with_valid_call"] += (rollout.num_valid_calls > 0).sum().item()
            totals["turns"] += rollout.num_turns.sum().item()
            totals["response_len"] += rollout.completion_mask.sum().item()
            totals["calls"] += rollout.num_tool_calls.sum().item()
            totals["valid"] += rollout.num_valid_calls.sum().item()
        calls, valid = totals.pop("calls"), totals.pop("valid")
        return dict({key: value / self.num_prompts for key, value in totals.items()},
                    valid_call_share=valid / calls if calls else 0.0)

    def __call__(self, model, step, should_stop=None):
        sampled = self.evaluate(model, False, should_stop)
        greedy = self.evaluate(model, True, should_stop) if sampled else None
        if sampled is None or greedy is None:
            return {}
        metrics = {f"eval/{key}_{kind}": result[key] for kind, result in (("sampled", sampled), ("greedy", greedy))
                   for key in ("accuracy", "tool_call_share", "answers_with_valid_call", "valid_call_share", "turns")}
        metrics["eval/response_len"] = sampled["response_len"]
        self.history.append((step, metrics))
        return metrics

    def summary_lines(self):
        """The first and the last evaluation side by side (the start policy and the trained one)."""
        if not self.history:
            return []
        (first_step, first), (last_step, last) = self.history[0], self.history[-1]
        lines = [f"held-out agent evaluation on {self.num_prompts} prompts (same prompts and seed each time):",
                 f"  {'':<30} {'step ' + str(first_step):>10} {'step ' + str(last_step):>10} {'change':>8}"]
        for key in (k for k in first if k != "eval/response_len"):
            lines.append(f"  {key[5:]:<30} {first[key]:>10.3f} {last[key]:>10.3f} {last[key] - first[key]:>+8.3f}")
        return lines


def build_agent_evaluator(args, tokenizer, device):
    """The ``AgentEvaluator`` of --eval_data_path, or None with --eval_interval 0 or no held-out file."""
    if args.eval_interval and not args.eval_data_path:
        Logger("held-out evaluation off: pass --eval_data_path FILE (agent rows) to evaluate")
    if not (args.eval_interval and args.eval_data_path):
        return None
    dataset = AgentRLDataset(args.eval_data_path, tokenizer, args.thinking_ratio, args.seed)
    return AgentEvaluator(dataset, tokenizer, args, device)


def main(argv=None, reward_fn=calculate_agent_rewards):
    """Agent RL: the roles of chapter 8.1 without a critic, then multi-turn rollout -> rewards -> group advantage
    -> loss -> update, step after step (8.5).
    ``reward_fn``: your own rewards, with the arguments and result of ``calculate_agent_rewards``."""
    args = parse_args(argv)

    # 1. processes, seed and dtype
    local_rank, device = init_distributed_mode(args.device)
    rank, world_size = rank_and_world_size()
    setup_seed(args.seed)  # identical initial weights on every rank
    train_dtype = resolve_train_dtype(args.dtype, device)
    autocast = autocast_context(device, train_dtype)
    loss_config = build_loss_config(args)

    # 2. tokenizer, rows (checked: tools, gt, schemas) and their loader
    start_weight = None if args.from_weight == "none" else weight_path(args.from_weight, args.save_dir,
                                                                        args.hidden_size, args.use_moe)
    tokenizer = load_tokenizer(args.tokenizer_path, start_weight, args.tokenizer_path_named)
    train_ds = AgentRLDataset(args.data_path, tokenizer, args.thinking_ratio, args.seed)
    if len(train_ds) < args.batch_size * world_size:
        raise ValueError(f"--data_path {args.data_path}: found {len(train_ds)} rows, need at least "
                         f"{args.batch_size * world_size} (--batch_size x processes) for one full batch")
    batch_sampler = ResumableBatchSampler(train_ds, args.batch_size, world_size, rank, args.seed)
    loader = DataLoader(train_ds, batch_sampler=batch_sampler, num_workers=args.num_workers, collate_fn=collate_rows,
                        generator=torch.Generator().manual_seed(args.seed))
    total_steps = count_total_steps(args.max_steps, args.epochs, len(loader))
    evaluator = build_agent_evaluator(args, tokenizer, device)  # its rows checked before any model is built
    run_lock = claim_save_dir(args, "agent", total_steps)

    # 3. the roles (8.1): the policy is trained; the reference and the reward model stay frozen
    lm_config = build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
    model = load_policy(lm_config, args.from_weight, args.save_dir, tokenizer, device)  # pi_theta
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.beta else None  # pi_ref
    reward_model = load_reward_model(args, device, reward_model_dtype(args.reward_dtype, args.reward_device or device))
    setup_seed(args.seed + rank)  # from here on every rank samples its own conversations
    Logger(f"agent RL: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(train_ds)} prompts, "
           f"world size {world_size}, device {device}, dtype {train_dtype}")

    # 4. optimizer
    optimizer = build_policy_optimizer(model, args.learning_rate, args.weight_decay, args.final_norm_learning_rate)
    ddp_model = compile_for_training(wrap_ddp(model, device, local_rank), args.use_compile)

    # 5. resume (--from_resume 1): weights, optimizer, data position, random state; the schedule at that update
    trained = {"model": model, "optimizer": optimizer}
    progress, engine_state = start_or_resume(args, "agent", trained, len(loader), device, rank, world_size)
    num_updates = -(-total_steps // args.accumulation_steps) * args.num_iterations
    scheduler = build_cosine_scheduler(optimizer, num_updates, progress["lr_schedule_step"])

    # 6. --rollout_engine sglang (8.2): the server that generates every turn, made after the resume (it is pushed
    #    the resumed policy); torch: the policy's own generate
    server = None
    if args.rollout_engine == "sglang":
        server = create_rollout_engine(args.rollout_engine, model, tokenizer, **rollout_engine_kwargs(args))
        server.load_resume_state(engine_state)
        trained["rollout_engine"] = server  # its push cadence is saved with the checkpoints

    # 7. the held-out evaluation, the stop requests, the NaN guard
    stop_signal = StopSignal()
    guard = BadStepGuard(args.max_bad_steps, progress["bad_steps_in_a_row"])
    start_metrics = {} if progress["step"] else evaluate_if_due(evaluator, model, 0, total_steps, args.eval_interval,
                                                                 lambda: stop_signal.received)

    # 8. metrics: metrics.jsonl (+ wandb) and the log line
    run_dir, writer = open_metrics(args, progress)
    Logger(f"agent RL: {total_steps} steps, {args.batch_size} prompts x {args.num_generations} conversations of up "
           f"to {args.max_turns} turns per step, loss {args.loss_type}, metrics in {run_dir}")
    if start_metrics:
        writer.log({"step": 0, **start_metrics})
    step_log = StepLog(writer, total_steps, args.log_interval, agent_log_line, start_step=progress["step"])

    # 9. the loop
    ddp_model.train()
    problems = []
    window_num_items = progress.get("window_num_items", 0.0)
    step, stop = progress["step"], stop_signal.requested(device)
    batches = [] if stop else resumable_batches(loader, batch_sampler, progress, args.epochs, total_steps)
    for step, position, batch in batches:
        learning_rate = optimizer.param_groups[0]["lr"]
        rollout_batch = agent_step_rollout(batch, ddp_model, ref_model, reward_fn, reward_model, tokenizer, args,
                                           autocast, server)  # steps 1-4: rollout, rewards, advantages, reference
        if args.debug_mode and step % args.debug_interval == 0:
            print_conversations(step, rollout_batch, tokenizer, args.num_generations)
        update_due = step % args.accumulation_steps == 0 or step == total_steps
        window = accumulation_window_size(step, total_steps, args.accumulation_steps)
        if (step - 1) % args.accumulation_steps == 0:
            window_num_items = 0.0
        window_num_items += rollout_batch.num_items_in_batch
        updates = []
        for _ in range(args.num_iterations):
            loss, update_metrics_ = agent_policy_loss(ddp_model, rollout_batch, loss_config, args, autocast)  # 5
            problems += nonfinite_parts(rewards=rollout_batch.rewards, loss=loss)
            (loss / window).backward()
            if update_due:  # the update
                if loss_config.loss_type in TOKEN_SUM_LOSS_TYPES:
                    scale_gradients(model.parameters(), window / window_num_items)
                project_scale_only_gradients(optimizer)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), args.grad_clip))
                problems += nonfinite_parts(gradients=grad_norm)
                skipped = any_rank(bool(problems), device)  # a NaN or inf on any rank: no rank updates
                if not skipped:
                    optimizer.step()
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                update_metrics_.update(grad_norm=grad_norm, skipped_update=float(skipped))
                guard.record(step, skipped, problems)
                problems = []
            updates.append(update_metrics_)
        if update_due and server is not None:
            server.update_policy(model)  # the next turns are generated by the updated policy
        metrics = mean_over_ranks(agent_metrics(rollout_batch, updates), device)
        metrics.update(gpu_memory_metrics(device))
        metrics.update(evaluate_if_due(evaluator, model, step, total_steps, args.eval_interval,
                                       lambda: stop_signal.received))
        step_log.write(step, position["epoch"], metrics, {"learning_rate": learning_rate}, batch["index"].tolist())
        stop = stop_signal.requested(device)
        if step % args.save_interval == 0 or step == total_steps or stop:
            checkpoint_progress = {"step": step, "total_steps": total_steps, **position,
                                   "lr_schedule_step": scheduler.last_epoch, "run_dir": run_dir,
                                   "wandb_id": writer.wandb_id, "bad_steps_in_a_row": guard.in_a_row,
                                   "window_num_items": window_num_items}
            save_checkpoint(args, "agent", lm_config, trained, checkpoint_progress, {args.save_weight: model})
        if stop:
            break

    if stop:
        Logger(stop_signal.stopped_message(step, resume_command(__file__, argv, world_size)))
    for line in evaluator.summary_lines() if evaluator is not None else []:
        Logger(line)
    writer.close()
    stop_signal.restore()
    if run_lock is not None:
        run_lock.close()
    del ddp_model
    shutdown_distributed()


if __name__ == "__main__":
    main()
