"""One table row per training run: held-out accuracy, answer length, entropy, clip fractions, time per step.

Reads each run's metrics.jsonl (``--run_dir`` of train_grpo.py / train_ppo.py) and, optionally, the JSON tables of
``scripts/eval_policy.py --json_out`` that evaluated the runs' final weights (keyed by the weight path given there).
Prints a Markdown table; ``--json_out`` also writes the numbers.

    python scripts/summarize_runs.py --runs cispo=out/a/run dapo=out/b/run \\
        --evals sampled_seed1=val_s1.json sampled_seed2=val_s2.json greedy=val_greedy.json \\
        --weights cispo=out/a/grpo_256.pth dapo=out/b/grpo_256.pth

Columns: the runs' own last in-run evaluation (200 validation prompts by default), each ``--evals`` table's accuracy
for the run's ``--weights``, the mean answer length, entropy, share of groups with equal rewards and clip fraction
over the run's steps (the last ``--last_steps`` for entropy and length), and the median seconds per step (the
differences of consecutive ``elapsed_s`` between two steps without an evaluation).
"""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainer.infra.errors import run_script
from trainer.infra.files import atomic_write

CLIP_KEYS = ("clip_ratio/region_mean", "cispo_clip_ratio", "clipfrac")


def read_rows(run_dir):
    """The rows of ``run_dir/metrics.jsonl``. Raises FileNotFoundError naming the file."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mean_of(rows, key):
    """Mean of ``key`` over the rows that hold it (NaN-free), or None when none does."""
    values = [row[key] for row in rows if key in row and row[key] == row[key]]
    return sum(values) / len(values) if values else None


def seconds_per_step(rows):
    """Median difference of ``elapsed_s`` between consecutive training steps, neither of them with an evaluation."""
    steps = [row for row in rows if "elapsed_s" in row]
    gaps = [
        b["elapsed_s"] - a["elapsed_s"]
        for a, b in zip(steps, steps[1:])
        if b["step"] == a["step"] + 1 and not any(k.startswith("eval/") for k in b)
    ]
    return statistics.median(gaps) if gaps else None


def summarize(rows, last_steps):
    """The run's summary: its last in-run evaluation and the means over its steps."""
    evals = [row for row in rows if "eval/accuracy_greedy" in row]
    train = [row for row in rows if "reward" in row]
    tail = [row for row in train if row["step"] > train[-1]["step"] - last_steps] if train else []
    clip_key = next((key for key in CLIP_KEYS if any(key in row for row in train)), None)
    return {
        "last_eval_step": evals[-1]["step"] if evals else None,
        "in_run_sampled": evals[-1]["eval/accuracy_sampled"] if evals else None,
        "in_run_greedy": evals[-1]["eval/accuracy_greedy"] if evals else None,
        "response_len": mean_of(tail, "response_len"),
        "entropy": mean_of(tail, "entropy"),
        "frac_reward_zero_std": mean_of(train, "frac_reward_zero_std"),
        "clip_fraction": mean_of(train, clip_key) if clip_key else None,
        "seconds_per_step": seconds_per_step(rows),
    }


def parse_pairs(pairs, flag):
    """``name=value`` words -> dict; raises SystemExit naming the flag and the word without '='."""
    result = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"{flag}: expected name=value, got {pair!r}")
        name, value = pair.split("=", 1)
        result[name] = value
    return result


def fmt(value, digits=3):
    return "–" if value is None else f"{value:.{digits}f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="+", required=True, help="name=RUN_DIR (the folder of metrics.jsonl)")
    parser.add_argument("--evals", nargs="*", default=[], help="column=EVAL_JSON from eval_policy.py --json_out")
    parser.add_argument("--weights", nargs="*", default=[], help="name=WEIGHT as given to eval_policy.py")
    parser.add_argument("--last_steps", type=int, default=50, help="steps at the end the length and entropy cover")
    parser.add_argument("--json_out", default="", help="also write the summaries as JSON here")
    args = parser.parse_args(argv)
    runs, weights = parse_pairs(args.runs, "--runs"), parse_pairs(args.weights, "--weights")
    evals = {}
    for column, path in parse_pairs(args.evals, "--evals").items():
        with open(path, encoding="utf-8") as f:
            evals[column] = json.load(f)
    summaries = {}
    for name, run_dir in runs.items():
        summary = summarize(read_rows(run_dir), args.last_steps)
        for column, table in evals.items():
            entry = table.get(weights.get(name, ""))
            summary[column] = entry["accuracy"] if entry else None
        summaries[name] = summary
    columns = [
        *evals,
        "in_run_sampled",
        "in_run_greedy",
        "response_len",
        "entropy",
        "frac_reward_zero_std",
        "clip_fraction",
        "seconds_per_step",
    ]
    print("| run | " + " | ".join(columns) + " |")
    print("| --- | " + " | ".join("---" for _ in columns) + " |")
    for name, summary in summaries.items():
        digits = {"response_len": 1, "seconds_per_step": 2}
        print(f"| {name} | " + " | ".join(fmt(summary[c], digits.get(c, 3)) for c in columns) + " |")
    if args.json_out:

        def write(path):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(summaries, f, indent=1)

        atomic_write({args.json_out: write})
    return summaries


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
