"""Compare policy checkpoints on the held-out prompts: accuracy, mean reward and its parts, length.

By default the 1,000 prompts of the test split (``dataset/rlaif_test.jsonl``), which no setting was chosen on;
the training scripts' periodic evaluation uses the validation split. Every checkpoint answers the same prompts
with the same sampling seed (temperature 1.0 by default, the rollout's own setting; ``--greedy`` for argmax
decoding). Accuracy is the share of answers whose final number equals the reference (``answer_reward``);
rewards are those of training (chapter 8.3) without a reward model unless ``--reward_model_path`` is given.

Usage:
    python scripts/eval_policy.py --weights full_sft grpo
    python scripts/eval_policy.py --weights full_sft grpo ppo --seed 2
    python scripts/eval_policy.py --weights out/full_sft_256.pth out/ppo_256.pth --num_prompts 300 --greedy
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


from dataset.lm_dataset import RLAIFDataset
from trainer.evaluation import Decoding, evaluate
from trainer.infra.errors import run_script
from trainer.infra.weights import DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, build_config, init_model
from trainer.infra.flags import add_bool_flag
from trainer.infra.reward_models import read_reward_model_config
from trainer.trainer_utils import LMForRewardModel, prompt_to_messages


def question_of(prompt):
    """The last user turn of a chat-templated prompt, or the prompt itself when it has none."""
    users = [m["content"] for m in prompt_to_messages(prompt) if m["role"] == "user"]
    return users[-1] if users else prompt


def side_by_side(results, num_samples):
    """Text blocks with the same held-out prompt answered by every checkpoint, for the first ``num_samples`` prompts.

    results: {name: ``evaluate`` result}, all on the same prompts. Each block: the question and its reference,
    then one line per checkpoint: correct or wrong, rule reward, and the answer (newlines shown as \\n).
    """
    names = list(results)
    width = max(len(name) for name in names)
    count = min([num_samples] + [len(r["samples"]) for r in results.values()])
    blocks = []
    for i in range(count):
        first = results[names[0]]["samples"][i]
        lines = [f"--- prompt {i}: {question_of(first['prompt'])}  (reference {first['reference']})"]
        for name in names:
            sample = results[name]["samples"][i]
            verdict = "correct" if sample["answer_reward"] > 0 else "wrong  "
            lines.append(f"[{name:<{width}}] {verdict} rule {sample['rule_reward']:+.2f} | {sample['completion']!r}")
        blocks.append("\n".join(lines))
    return blocks


def main(argv=None):
    parser = argparse.ArgumentParser(description="Evaluate policy checkpoints on held-out prompts")
    parser.add_argument(
        "--weights",
        nargs="+",
        default=["full_sft", "grpo"],
        help="weight names in --save_dir ({name}_{hidden}.pth) or paths",
    )
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR)
    parser.add_argument(
        "--data_path",
        default=os.path.join(ROOT, "dataset", "rlaif_test.jsonl"),
        help="held-out prompts (default: the test split, never used to choose a setting)",
    )
    parser.add_argument("--tokenizer_path", default=DEFAULT_TOKENIZER_PATH)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    add_bool_flag(parser, "--use_moe", help="1: mixture-of-experts MLPs")
    parser.add_argument("--num_prompts", type=int, default=1000)
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--max_gen_len", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    add_bool_flag(parser, "--greedy", help="1: greedy answers instead of sampled ones")
    parser.add_argument("--thinking_ratio", type=float, default=1.0)
    parser.add_argument("--reward_model_path", default="none", help="e.g. out/reward_model_256 (as in training)")
    add_bool_flag(parser, "--trust_remote_code", help="allow a get_score remote-code reward model")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--show_samples", type=int, default=3, help="prompts shown with every checkpoint's answer")
    parser.add_argument("--json_out", default="", help="also write the table as JSON here")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.batch_size < 1 or args.max_gen_len < 1:
        parser.error("--num_prompts, --batch_size and --max_gen_len must be >= 1")
    if args.show_samples < 0:
        parser.error(f"--show_samples must be >= 0, got {args.show_samples}")
    if not os.path.isfile(args.data_path):
        parser.error(f"--data_path {args.data_path} does not exist")
    if args.reward_model_path != "none":
        try:
            read_reward_model_config(args.reward_model_path, args.trust_remote_code)
        except (OSError, ValueError) as err:
            parser.error(str(err))

    lm_config = build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
    reward_model = None
    if args.reward_model_path != "none":
        reward_model = LMForRewardModel(args.reward_model_path, trust_remote_code=args.trust_remote_code)
    results = {}
    tokenizer = None
    for name in args.weights:
        model, tokenizer = init_model(lm_config, name, args.save_dir, args.tokenizer_path, "cpu")
        dataset = RLAIFDataset(args.data_path, tokenizer, thinking_ratio=args.thinking_ratio, seed=args.seed)
        decoding = Decoding(
            args.num_prompts, args.batch_size, args.max_gen_len, args.temperature, args.greedy, args.seed
        )
        results[name] = evaluate(model, tokenizer, dataset, decoding, reward_model)

    mode = "greedy" if args.greedy else f"sampled, temperature {args.temperature}, seed {args.seed}"
    print(f"\nheld-out: {args.data_path} ({min(args.num_prompts, len(dataset))} prompts, {mode})")
    header = f"{'weights':<28} {'accuracy':>9} {'reward':>8} {'rule':>7} {'rm':>6} {'length':>7} {'distinct-2':>10}"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<28} {r['accuracy']:>9.3f} {r['reward']:>8.3f} {r['rule_reward']:>7.3f} "
            f"{r['reward_model_score']:>6.2f} {r['response_len']:>7.1f} {r['distinct_2']:>10.3f}"
        )
    if args.show_samples:
        print(f"\nthe same prompts, answered by each checkpoint (first {args.show_samples}):")
    for block in side_by_side(results, args.show_samples):
        print("\n" + block)
    if args.json_out:
        table = {name: {k: v for k, v in r.items() if k != "samples"} for name, r in results.items()}
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=2)
    return results


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
