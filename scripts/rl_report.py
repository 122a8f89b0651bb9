"""What did RL change? Accuracy against sampling temperature, pass@k, and the kinds of wrong answers, for a list of
checkpoints on the same held-out prompts.

For every checkpoint, on the first ``--num_prompts`` prompts of ``--data_path`` (default: the test split, which no
setting was chosen on):
  - accuracy greedy and sampled at each ``--temperatures`` value (one sampling seed per temperature);
  - pass@k for k = 1..``--num_samples`` at ``--pass_temperature`` (the rollout's 1.0), from ``--num_samples``
    answers per prompt with the unbiased estimator of Chen et al. 2021 (``pass_at_k``): RL that only sharpens what
    the SFT policy knew raises pass@1 and leaves pass@16 where it was; RL that teaches something new raises both;
  - the share of wrong answers by kind (``error_kind``) among the pass@k samples.
It writes ``report.json``, ``accuracy_vs_temperature.png``, ``pass_at_k.png`` and ``error_kinds.md`` into
``--out_dir`` and prints the tables.

Usage (after `python trainer/train_grpo.py` and `python trainer/train_ppo.py`, which save out/grpo_256.pth and
out/ppo_256.pth):
    python scripts/rl_report.py --weights full_sft grpo ppo --out_dir docs/plots/report
    python scripts/rl_report.py --weights full_sft --num_prompts 100 --num_samples 4 --out_dir /tmp/report
"""

import argparse
import json
import os
import re
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dataset.lm_dataset import RLAIFDataset
from trainer.infra.errors import run_script
from trainer.infra.weights import DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, build_config, init_model
from trainer.evaluation import Decoding, evaluate
from trainer.trainer_utils import extract_final_number, prompt_to_messages, split_thinking

ERROR_KINDS = ("format", "no final number", "operand copied wrong", "arithmetic wrong", "wrong without thinking")
NUMBER = re.compile(r"\d+")


def pass_at_k(n, c, k):
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", eq. 1): 1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without
    replacement hold at least one correct one. Computed as a product, stable for large n.

    Raises ValueError unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def question_operands(question):
    """The two operands of a bundled arithmetic question, as strings in their order ('What is 474 - 48?' ->
    ['474', '48']); None when the question does not hold exactly two numbers."""
    numbers = NUMBER.findall(question)
    return numbers if len(numbers) == 2 else None


def error_kind(question, completion, reference, thinking_opened=True):
    """Why an answer to a bundled arithmetic question is wrong, or None when it is right.

    ``completion`` is the sampled text after the prompt; ``thinking_opened``: the prompt (or the completion) opened
    '<think>', as every prompt of the report does. In this order:
      "format": the thinking is opened but never closed (no '</think>'), so no answer part exists;
      "no final number": the answer part (after '</think>') holds no number;
      "wrong without thinking": the thinking is empty, so the operands it used cannot be read;
      "operand copied wrong": the first line of the thinking does not start from the question's two operands,
          in order (the SFT format: '987 减 47, ones first:');
      "arithmetic wrong": the operands were copied right and the final number is still wrong.
    A right answer is one whose final number equals ``reference`` (``answer_reward``'s rule).
    """
    thinking, answer = split_thinking(completion)
    final = extract_final_number(answer)
    expected = extract_final_number(reference)
    if final is not None and expected is not None and float(final) == float(expected):
        return None
    if (thinking_opened or "<think>" in completion) and "</think>" not in completion:
        return "format"
    if final is None:
        return "no final number"
    lines = [line for line in thinking.replace("<think>", "").splitlines() if line.strip()]
    if not lines:
        return "wrong without thinking"
    operands = question_operands(question)
    copied = NUMBER.findall(lines[0])[:2]
    if operands is not None and copied != operands:
        return "operand copied wrong"
    return "arithmetic wrong"


def question_of(prompt):
    """The last user turn of a chat-templated prompt."""
    users = [m["content"] for m in prompt_to_messages(prompt) if m["role"] == "user"]
    return users[-1] if users else prompt


def checkpoint_report(model, tokenizer, dataset, args):
    """Accuracy per temperature, pass@k and error kinds of one checkpoint (see the module docstring)."""
    decoding = Decoding(args.num_prompts, args.batch_size, args.max_gen_len, max_seq_len=args.max_seq_len)
    accuracy = {}
    for temperature in args.temperatures:
        greedy = temperature == 0
        result = evaluate(
            model, tokenizer, dataset, replace(decoding, temperature=temperature or 1.0, greedy=greedy, seed=args.seed)
        )
        accuracy["greedy" if greedy else f"{temperature:g}"] = result["accuracy"]
    correct = None
    kinds = dict.fromkeys(ERROR_KINDS, 0)
    for sample_index in range(args.num_samples):
        result = evaluate(
            model,
            tokenizer,
            dataset,
            replace(decoding, temperature=args.pass_temperature, seed=args.seed + 1 + sample_index),
        )
        hits = [s["answer_reward"] > 0 for s in result["samples"]]
        correct = hits if correct is None else [c + h for c, h in zip(correct, hits)]
        for sample in result["samples"]:
            kind = error_kind(question_of(sample["prompt"]), sample["completion"], sample["reference"])
            if kind is not None:
                kinds[kind] += 1
    n = args.num_samples
    pass_k = {k: sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in range(1, n + 1)}
    wrong = sum(kinds.values())
    return {
        "accuracy": accuracy,
        "pass_at_k": pass_k,
        "wrong_answers": wrong,
        "answers": n * len(correct),
        "error_kinds": {kind: count / max(wrong, 1) for kind, count in kinds.items()},
    }


def plot_report(report, out_dir):
    """accuracy_vs_temperature.png and pass_at_k.png, one line per checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save_lines(file_name, curves, title, ylabel, xlabel="", xticks=None, log2_x=False):
        figure, axis = plt.subplots(figsize=(6, 4))
        for name, (xs, ys) in curves.items():
            axis.plot(xs, ys, marker="o", markersize=3, label=name)
        if xticks:
            axis.set_xticks(*xticks)
        if log2_x:
            axis.set_xscale("log", base=2)
        axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
        axis.grid(alpha=0.3)
        axis.legend()
        figure.tight_layout()
        figure.savefig(os.path.join(out_dir, file_name), dpi=120)
        plt.close(figure)

    checkpoints = report["checkpoints"]
    labels = list(next(iter(checkpoints.values()))["accuracy"])
    save_lines(
        "accuracy_vs_temperature.png",
        {name: (range(len(labels)), list(r["accuracy"].values())) for name, r in checkpoints.items()},
        f"accuracy against sampling temperature ({report['num_prompts']} prompts)",
        "held-out accuracy",
        xticks=(range(len(labels)), ["greedy" if x == "greedy" else f"T {x}" for x in labels]),
    )
    save_lines(
        "pass_at_k.png",
        {name: ([int(k) for k in r["pass_at_k"]], list(r["pass_at_k"].values())) for name, r in checkpoints.items()},
        f"pass@k at T {report['pass_temperature']:g} (n = {report['num_samples']} answers a prompt)",
        "pass@k",
        xlabel="k",
        log2_x=True,
    )


def error_table(report):
    """Markdown table: the share of wrong answers by kind, one column per checkpoint."""
    names = list(report["checkpoints"])
    lines = ["| kind of wrong answer | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for kind in ERROR_KINDS:
        cells = [f"{report['checkpoints'][name]['error_kinds'][kind]:.1%}" for name in names]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    wrong = [
        f"{report['checkpoints'][name]['wrong_answers']} of {report['checkpoints'][name]['answers']}" for name in names
    ]
    lines.append("| wrong answers | " + " | ".join(wrong) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description="What did RL change? Accuracy by temperature, pass@k, error kinds")
    parser.add_argument(
        "--weights",
        nargs="+",
        default=["full_sft", "grpo", "ppo"],
        help="weight names in --save_dir ({name}_{hidden}.pth) or paths",
    )
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR, help="where the weight names are looked up")
    parser.add_argument(
        "--data_path",
        default=os.path.join(ROOT, "dataset", "rlaif_test.jsonl"),
        help="held-out prompts (default: the test split)",
    )
    parser.add_argument("--tokenizer_path", default=DEFAULT_TOKENIZER_PATH, help="tokenizer folder")
    parser.add_argument("--hidden_size", type=int, default=256, help="model width of every checkpoint")
    parser.add_argument("--num_hidden_layers", type=int, default=4, help="model depth of every checkpoint")
    parser.add_argument("--num_prompts", type=int, default=1000, help="held-out prompts")
    parser.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0, 0.3, 0.5, 0.7, 1.0],
        help="sampling temperatures of the accuracy curve (0 = greedy)",
    )
    parser.add_argument("--num_samples", type=int, default=16, help="n, answers per prompt for pass@k (k <= n)")
    parser.add_argument("--pass_temperature", type=float, default=1.0, help="sampling temperature of pass@k")
    parser.add_argument("--batch_size", type=int, default=100, help="prompts per generation batch")
    parser.add_argument("--max_gen_len", type=int, default=96, help="most tokens per answer")
    parser.add_argument("--max_seq_len", type=int, default=256, help="prompt tokens kept")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed (sample i of pass@k uses seed + 1 + i)")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "docs", "plots", "report"), help="where to write")
    args = parser.parse_args(argv)
    if args.num_samples < 1 or args.num_prompts < 1 or min(args.temperatures) < 0 or args.pass_temperature <= 0:
        parser.error("--num_samples and --num_prompts must be >= 1, --temperatures >= 0, --pass_temperature > 0")
    if not os.path.isfile(args.data_path):
        parser.error(f"--data_path {args.data_path} does not exist")
    os.makedirs(args.out_dir, exist_ok=True)
    lm_config = build_config(args.hidden_size, args.num_hidden_layers, 0)
    report = {
        "data_path": args.data_path,
        "num_prompts": args.num_prompts,
        "num_samples": args.num_samples,
        "pass_temperature": args.pass_temperature,
        "seed": args.seed,
        "checkpoints": {},
    }
    for name in args.weights:
        model, tokenizer = init_model(lm_config, name, args.save_dir, args.tokenizer_path, "cpu")
        dataset = RLAIFDataset(args.data_path, tokenizer, thinking_ratio=1.0, seed=args.seed)
        report["num_prompts"] = min(args.num_prompts, len(dataset))
        report["checkpoints"][name] = checkpoint_report(model, tokenizer, dataset, args)
        result = report["checkpoints"][name]
        print(
            f"{name}: accuracy {json.dumps({k: round(v, 3) for k, v in result['accuracy'].items()})}, "
            f"pass@1 {result['pass_at_k'][1]:.3f}, pass@{args.num_samples} "
            f"{result['pass_at_k'][args.num_samples]:.3f}",
            flush=True,
        )
    with open(os.path.join(args.out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    table = error_table(report)
    with open(os.path.join(args.out_dir, "error_kinds.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    plot_report(report, args.out_dir)
    print("\n" + table)
    return report


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
