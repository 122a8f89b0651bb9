"""Train a reward model on preference pairs with the Bradley-Terry loss (beyond the chapter: it makes the reward
model that chapter 8.3 adds to the rule rewards).

    loss = -log sigmoid(r_chosen - r_rejected)    (Bradley & Terry 1952; Ouyang et al. 2022, InstructGPT, eq. 1)

The model is a MiniMind backbone (SFT weights) with a scalar head, built as transformers'
``Qwen3ForSequenceClassification`` (MiniMind's parameter names are Qwen3's, so the backbone loads strictly): the
saved folder (config.json, model.safetensors, tokenizer files) loads with ``AutoModelForSequenceClassification``
and no custom code, which is kind (a) of ``LMForRewardModel``. Each side of a pair is rendered exactly as the RL
scripts score an answer: ``reward_model_messages`` (history folded into one user turn, the final answer after
'</think>') and the tokenizer's chat template.

Data: JSONL (or .jsonl.gz) pairs, ``{"chosen": [messages], "rejected": [messages]}`` or HH-RLHF transcripts
(``dataset/lm_dataset.py:read_preference_pairs``). Held-out pairwise accuracy = share of held-out pairs with
r_chosen > r_rejected, on ``--eval_path`` or on ``--eval_ratio`` of the pairs.

Run (the committed default reward model, out/reward_model_256, from the bundled arithmetic pairs):
    python scripts/make_demo_data.py && python trainer/train_reward.py
Other examples:
    python trainer/train_reward.py --data_path ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz --eval_path "" \\
        --save_path out/reward_hh --max_seq_len 256
"""

import argparse
import copy
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen3ForSequenceClassification

from dataset.lm_dataset import read_preference_pairs
from model.hf_qwen3 import qwen3_config_from_minimind
from trainer.infra.errors import InputError, run_script
from trainer.infra.weights import (
    DEFAULT_SAVE_DIR,
    DEFAULT_TOKENIZER_PATH,
    build_config,
    check_state_dict_fits,
    weight_path,
)
from trainer.infra.distributed import Logger, setup_seed
from trainer.infra.files import atomic_write
from trainer.infra.dtypes import DTYPES, resolve_dtype
from trainer.infra.flags import DEFAULT_REWARD_MODEL_PATH, add_bool_flag
from trainer.infra.optimizer import build_cosine_scheduler
from trainer.infra.reward_models import render_reward_text
from trainer.trainer_utils import reward_model_messages
from trainer.infra.metrics import MetricsWriter, StepTimer


# ----------------------------------------------------------------------------- the math
def bradley_terry_loss(chosen_rewards, rejected_rewards):
    """Pairwise reward-model loss, mean over pairs of -log sigmoid(r_chosen - r_rejected).

    Bradley & Terry 1952; Ouyang et al. 2022 (InstructGPT), eq. 1 (without the 1/C(K,2) grouping: one pair per row).
    chosen_rewards, rejected_rewards: fp32 [B] -> scalar. ``F.logsigmoid`` keeps it finite for large margins.
    """
    return -F.logsigmoid(chosen_rewards - rejected_rewards).mean()


def pairwise_accuracy(chosen_rewards, rejected_rewards):
    """Share of pairs with r_chosen > r_rejected (a tie counts as wrong); [B], [B] -> float in [0, 1]."""
    return (chosen_rewards > rejected_rewards).float().mean().item()


# ----------------------------------------------------------------------------- the model
def qwen3_config(lm_config, pad_token_id):
    """``Qwen3Config`` of the same architecture as a ``MiniMindConfig``, with one output label (the reward).

    ``pad_token_id`` tells the classification head which tokens are padding: it reads the last non-pad token.
    Raises:
        ValueError: for an MoE config (Qwen3ForSequenceClassification has dense MLPs only).
    """
    if lm_config.use_moe:
        raise InputError("--use_moe 1: the reward model is a dense Qwen3ForSequenceClassification; use --use_moe 0")
    config = qwen3_config_from_minimind(lm_config)  # the same backbone the exported policy gets
    config.architectures = ["Qwen3ForSequenceClassification"]
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    config.tie_word_embeddings = False
    return config


def build_reward_model(lm_config, pad_token_id, weights_path=None):
    """A ``Qwen3ForSequenceClassification`` fp32 with the MiniMind backbone weights of ``weights_path`` (a MiniMind
    ``.pth``) or random ones (None); the scalar head ``score`` [1, hidden] starts at zero (every reward 0).

    Raises:
        FileNotFoundError: if ``weights_path`` does not exist.
        ValueError: naming the keys, when the checkpoint does not hold exactly the backbone (plus ``lm_head.weight``),
            or naming the parameter and both shapes on a size mismatch.
    """
    model = Qwen3ForSequenceClassification(qwen3_config(lm_config, pad_token_id))
    torch.nn.init.zeros_(model.score.weight)
    if weights_path is None:
        return model
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(f"--from_weight: {weights_path} does not exist")
    state_dict = torch.load(weights_path, map_location="cpu", weights_only=True)
    backbone = {k: v.float() for k, v in state_dict.items() if k != "lm_head.weight"}
    check_state_dict_fits(
        weights_path,
        model.state_dict(),
        backbone,
        "--hidden_size / --num_hidden_layers",
        may_be_missing={"score.weight"},
    )
    model.load_state_dict(backbone, strict=False)
    return model


def save_reward_model(model, tokenizer, path, dtype):
    """Write a transformers folder (config.json, model.safetensors, tokenizer files) with ``atomic_write``: a
    crash leaves the previous folder (or none) in place.

    The weights are saved in ``dtype`` (a copy; ``model`` is unchanged). Returns ``path``.
    Raises:
        OSError: naming ``path`` when writing or renaming fails.
    """

    def write(folder):
        copy.deepcopy(model).to(dtype).save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    atomic_write({path: write})
    return path


# ----------------------------------------------------------------------------- data
def encode_side(tokenizer, messages, max_seq_len):
    """Token ids (list of int, at most the last ``max_seq_len``) of one side of a pair, rendered as the RL scripts
    render an answer for the reward model: ``reward_model_messages(messages[:-1], answer)``, chat template."""
    conversation = reward_model_messages(messages[:-1], messages[-1]["content"])
    text, add_special_tokens = render_reward_text(tokenizer, conversation)
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    return ids[-max_seq_len:]


def encode_pairs(tokenizer, pairs, max_seq_len):
    """[(chosen_ids, rejected_ids)] for a list of pairs from ``read_preference_pairs``."""
    return [
        (encode_side(tokenizer, p["chosen"], max_seq_len), encode_side(tokenizer, p["rejected"], max_seq_len))
        for p in pairs
    ]


def collate_pairs(batch, pad_token_id):
    """Right-padded chosen rows then rejected rows: (input_ids long [2B, T], attention_mask long [2B, T])."""
    rows = [chosen for chosen, _ in batch] + [rejected for _, rejected in batch]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # [2B, T]
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [2B, T]
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
    return input_ids, attention_mask


def pair_rewards(model, batch, pad_token_id, device):
    """(chosen_rewards fp32 [B], rejected_rewards fp32 [B]) of a batch of encoded pairs, in one forward."""
    input_ids, attention_mask = collate_pairs(batch, pad_token_id)
    rewards = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits[:, 0].float()
    return rewards[: len(batch)], rewards[len(batch) :]  # [B], [B]


@torch.no_grad()
def evaluate(model, encoded_pairs, batch_size, pad_token_id, device):
    """Held-out Bradley-Terry loss and pairwise accuracy over all ``encoded_pairs`` -> dict of floats."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for start in range(0, len(encoded_pairs), batch_size):
        chosen_rewards, rejected_rewards = pair_rewards(
            model, encoded_pairs[start : start + batch_size], pad_token_id, device
        )
        chosen.append(chosen_rewards)
        rejected.append(rejected_rewards)
    model.train(was_training)
    chosen_rewards = torch.cat(chosen)  # [E]
    rejected_rewards = torch.cat(rejected)  # [E]
    return {
        "eval_loss": bradley_terry_loss(chosen_rewards, rejected_rewards).item(),
        "eval_accuracy": pairwise_accuracy(chosen_rewards, rejected_rewards),
        "eval_margin": (chosen_rewards - rejected_rewards).mean().item(),
    }


def split_pairs(pairs, eval_pairs, eval_ratio, seed):
    """(train, held-out): ``eval_pairs`` when given, else a seeded shuffle of ``pairs`` with the last
    ``eval_ratio`` share (at least one pair) held out."""
    if eval_pairs is not None:
        return pairs, eval_pairs
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    num_eval = max(1, int(round(len(pairs) * eval_ratio)))
    return [pairs[i] for i in order[:-num_eval]], [pairs[i] for i in order[-num_eval:]]


# ----------------------------------------------------------------------------- set-up and loop
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train a reward model (Bradley-Terry) from a MiniMind backbone")
    parser.add_argument("--data_path", default=os.path.join(ROOT, "dataset", "reward_train.jsonl"))
    parser.add_argument(
        "--eval_path",
        default=os.path.join(ROOT, "dataset", "reward_heldout.jsonl"),
        help="held-out pairs; '' holds out --eval_ratio of --data_path",
    )
    parser.add_argument("--eval_ratio", type=float, default=0.1)
    parser.add_argument("--save_path", default=DEFAULT_REWARD_MODEL_PATH, help="output model folder")
    parser.add_argument("--save_dtype", default="float16", choices=list(DTYPES))
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR, help="where --from_weight is looked up")
    parser.add_argument("--run_dir", default="", help="metrics folder (default: {save_dir}/runs/reward-TIME)")
    parser.add_argument(
        "--from_weight", default="full_sft", help="MiniMind weights ({name}_{hidden}.pth), a path, or none"
    )
    parser.add_argument("--tokenizer_path", default=DEFAULT_TOKENIZER_PATH)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    add_bool_flag(parser, "--use_moe", help="1: mixture-of-experts MLPs")
    parser.add_argument("--max_seq_len", type=int, default=256, help="tokens kept per side (from the right)")
    parser.add_argument("--batch_size", type=int, default=16, help="pairs per step")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=0, help="stop after this many steps (0 = whole epochs)")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--eval_interval", type=int, default=50, help="steps between held-out evaluations")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    for flag in ("batch_size", "epochs", "max_seq_len", "eval_interval"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.max_steps < 0:
        parser.error(f"--max_steps must be >= 0, got {args.max_steps}")
    if args.use_moe:
        parser.error("--use_moe 1: the reward model is a dense Qwen3ForSequenceClassification; use --use_moe 0")
    if args.learning_rate <= 0:
        parser.error(f"--learning_rate must be > 0, got {args.learning_rate}")
    if not 0 < args.eval_ratio < 1:
        parser.error(f"--eval_ratio must be in (0, 1), got {args.eval_ratio}")
    for flag in ("data_path", "eval_path"):
        if getattr(args, flag) and not os.path.isfile(getattr(args, flag)):
            parser.error(f"--{flag} {getattr(args, flag)} does not exist")
    if args.from_weight != "none":
        path = weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe)
        if not os.path.isfile(path):
            parser.error(f"--from_weight {args.from_weight}: {path} does not exist")
    return args


def main(argv=None):
    args = parse_args(argv)
    setup_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_pairs, eval_pairs = split_pairs(
        read_preference_pairs(args.data_path),
        read_preference_pairs(args.eval_path) if args.eval_path else None,
        args.eval_ratio,
        args.seed,
    )
    if len(train_pairs) < args.batch_size:
        raise InputError(
            f"--data_path {args.data_path}: {len(train_pairs)} training pairs, fewer than --batch_size "
            f"{args.batch_size}"
        )
    train_encoded = encode_pairs(tokenizer, train_pairs, args.max_seq_len)
    eval_encoded = encode_pairs(tokenizer, eval_pairs, args.max_seq_len)

    lm_config = build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
    weights = (
        None
        if args.from_weight == "none"
        else weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe)
    )
    model = build_reward_model(lm_config, pad_token_id, weights).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_encoded) // args.batch_size
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps:
        total_steps = min(args.max_steps, total_steps)
    scheduler = build_cosine_scheduler(optimizer, total_steps)
    run_dir = args.run_dir or os.path.join(args.save_dir, "runs", f"reward-{time.strftime('%Y%m%d-%H%M%S')}")
    writer = MetricsWriter(run_dir, config=vars(args))
    Logger(
        f"reward model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{len(train_encoded)} training / {len(eval_encoded)} held-out pairs, {total_steps} steps, "
        f"metrics in {run_dir}"
    )
    before = evaluate(model, eval_encoded, args.batch_size, pad_token_id, args.device)
    Logger(
        f"step 0/{total_steps} | eval_loss {before['eval_loss']:.4f} | eval_acc {before['eval_accuracy']:.3f} "
        f"(a tie counts as wrong)"
    )
    writer.log({"step": 0, "total_steps": total_steps, **before})  # before training: a zero head scores log 2

    timer = StepTimer(total_steps)
    step = 0
    model.train()
    generator = random.Random(args.seed)
    while step < total_steps:
        order = list(range(len(train_encoded)))
        generator.shuffle(order)
        for start in range(0, steps_per_epoch * args.batch_size, args.batch_size):
            step += 1
            batch = [train_encoded[i] for i in order[start : start + args.batch_size]]
            chosen_rewards, rejected_rewards = pair_rewards(model, batch, pad_token_id, args.device)  # [B], [B]
            loss = bradley_terry_loss(chosen_rewards, rejected_rewards)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            metrics = {
                "step": step,
                "total_steps": total_steps,
                "loss": loss.item(),
                "accuracy": pairwise_accuracy(chosen_rewards.detach(), rejected_rewards.detach()),
                "margin": (chosen_rewards - rejected_rewards).mean().item(),
                "grad_norm": float(grad_norm),
                "learning_rate": optimizer.param_groups[0]["lr"],
                "elapsed_s": time.time() - timer.start,
            }
            if step % args.eval_interval == 0 or step == total_steps:
                metrics.update(evaluate(model, eval_encoded, args.batch_size, pad_token_id, args.device))
            elapsed, remaining = timer.eta(step)
            line = (
                f"step {step}/{total_steps} | loss {metrics['loss']:.4f} | acc {metrics['accuracy']:.3f} | "
                f"margin {metrics['margin']:.3f} | lr {metrics['learning_rate']:.2e}"
            )
            if "eval_accuracy" in metrics:
                line += f" | eval_loss {metrics['eval_loss']:.4f} | eval_acc {metrics['eval_accuracy']:.3f}"
            Logger(f"{line} | {elapsed} elapsed, {remaining} left")
            writer.log(metrics)
            if step >= total_steps:
                break
    writer.close()
    path = save_reward_model(model, tokenizer, args.save_path, resolve_dtype(args.save_dtype, torch.float16))
    Logger(
        f"saved {path} (held-out pairwise accuracy {metrics['eval_accuracy']:.3f}, held-out loss "
        f"{before['eval_loss']:.4f} -> {metrics['eval_loss']:.4f})"
    )


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
