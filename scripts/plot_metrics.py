"""Plot the curves of one or more training runs from their ``metrics.jsonl`` (one JSON object per logged step).

One panel per metric, every run overlaid in its own colour with its label (e.g. PPO vs GRPO, CISPO vs the
clipped GRPO loss). Only the metrics that at least one run logged are drawn; a metric that is 0 at every
step of every run (``reward_model_score`` without a reward model) is skipped and reported.

Usage:
    python scripts/plot_metrics.py out/runs/grpo-20261130-083120 out/runs/ppo-20261130-090258 \\
        --labels GRPO PPO --smooth 10 --out docs/plots/default_runs.png
    python scripts/plot_metrics.py out/runs/grpo-* --x elapsed_s
"""

import argparse
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from dataset.lm_dataset import iter_jsonl
from trainer.infra.errors import run_script
from trainer.infra.files import atomic_write

# (metric key, panel title); the order of the panels. The keys are those train_grpo.py / train_ppo.py log.
CURVES = [
    ("eval/accuracy_sampled", "held-out accuracy, sampled (T of the rollout)"),
    ("eval/accuracy_greedy", "held-out accuracy, greedy"),
    ("reward", "reward (total)"),
    ("rule_reward", "rule reward (8.3)"),
    ("answer_reward", "answer reward (share correct)"),
    ("reward_model_score", "reward model score (8.3)"),
    ("kl_ref", "k3 KL to the reference (8.6)"),
    ("approx_kl", "PPO approx KL 0.5·E[(log ratio)²]"),
    ("clipfrac", "PPO clip fraction"),
    ("policy_loss", "policy loss"),
    ("value_loss", "PPO value loss (8.4.4)"),
    ("explained_variance", "PPO critic explained variance"),
    ("advantages_std", "advantages std"),
    ("response_len", "response length (tokens)"),
    ("learning_rate", "learning rate (actor)"),
    ("final_norm_gain", "final RMSNorm gain (output sharpness)"),
]
X_KEYS = ("step", "elapsed_s")


def read_metrics(path):
    """Rows of a ``metrics.jsonl`` (a run folder or the file itself) as a list of dicts, one per step in step
    order (for a step logged twice, as by a resumed run, the last row).

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: naming file and line for a line that is not a JSON object, or one without 'step'.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (give a run folder that holds metrics.jsonl, or the file)")
    rows = []
    for line_number, row in iter_jsonl(path):  # names file:line for a line that is not UTF-8 JSON
        if not isinstance(row, dict) or "step" not in row:
            raise ValueError(f"{path}:{line_number}: expected a JSON object with a 'step' key")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} has no rows")
    # a run resumed from a checkpoint logs again the steps after that checkpoint: keep the last row of each step
    last_row_of_step = {row["step"]: row for row in rows}
    return [last_row_of_step[step] for step in sorted(last_row_of_step)]


def moving_average(values, window):
    """Trailing mean over the last ``window`` values (fewer at the start): list of floats, same length."""
    averaged = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        averaged.append(total / min(i + 1, window))
    return averaged


def series(rows, key, x_key):
    """(xs, ys) of the rows that hold a finite number for ``key`` (and for ``x_key``)."""
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and x_key in row:
            xs.append(row[x_key])
            ys.append(float(value))
    return xs, ys


def choose_curves(runs, keys):
    """(drawn, skipped): the keys some run logged; a key that is 0 at every step of every run is skipped."""
    drawn, skipped = [], []
    for key in keys:
        values = [row[key] for rows in runs for row in rows if isinstance(row.get(key), (int, float))]
        if not values:
            continue
        (skipped if all(v == 0 for v in values) else drawn).append(key)
    return drawn, skipped


def plot_runs(runs, labels, keys, out_path, x_key="step", smooth=1, columns=3, titles=CURVES):
    """Draw one panel per key with every run overlaid and save a PNG at ``out_path`` (written atomically).

    With a PPO and a GRPO run this is chapter 8.7's comparison as curves: reward, KL to the reference, loss,
    advantage std and length side by side, plus what only PPO has (approx KL, clip fraction, value loss).
    runs: list of row lists (``read_metrics``); labels: one str per run; keys: metric keys to draw.
    smooth > 1 draws the raw curve faintly and its ``moving_average`` over ``smooth`` logged steps on top;
    the held-out evaluations (``eval/...`` keys, a few points per run) are drawn as points, never smoothed.
    titles: (key, panel title) pairs (a key without one is its own title).
    """
    titles = dict(titles)
    rows_of_panels = max(1, math.ceil(len(keys) / columns))
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(5 * columns, 3.2 * rows_of_panels), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes.flat, keys):
        for i, (rows, label) in enumerate(zip(runs, labels)):
            xs, ys = series(rows, key, x_key)
            if not xs:
                continue
            colour = colours[i % len(colours)]
            if key.startswith("eval/"):  # a few evaluations per run: points joined by lines, never smoothed
                ax.plot(xs, ys, color=colour, linewidth=1.6, marker="o", markersize=4, label=label)
            elif smooth > 1:
                ax.plot(xs, ys, color=colour, alpha=0.25, linewidth=0.8)
                ax.plot(xs, moving_average(ys, smooth), color=colour, linewidth=1.6, label=label)
            else:
                ax.plot(xs, ys, color=colour, linewidth=1.2, label=label)
        ax.set_title(titles.get(key, key), fontsize=10)
        ax.set_xlabel(x_key, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    handles, legend_labels = axes.flat[0].get_legend_handles_labels()
    note = f" (thin: raw, thick: mean of {smooth} logged steps)" if smooth > 1 else ""
    fig.legend(
        handles,
        legend_labels,
        loc="upper center",
        ncol=max(1, len(labels)),
        fontsize=10,
        title=f"runs{note}",
        title_fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.2 * rows_of_panels)))
    atomic_write({out_path: lambda tmp_path: fig.savefig(tmp_path, dpi=100, format="png")})
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="PNG curves of training runs from their metrics.jsonl")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (or metrics.jsonl files)")
    parser.add_argument("--labels", nargs="+", default=None, help="one label per run (default: folder names)")
    parser.add_argument("--out", default="", help="PNG path (default: {first RUN_DIR}/metrics.png)")
    parser.add_argument("--keys", nargs="+", default=None, help="metric keys to draw (default: the usual curves)")
    parser.add_argument("--x", default="step", choices=X_KEYS, help="x axis: logged step or seconds elapsed")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window in logged steps (1 = off)")
    parser.add_argument("--columns", type=int, default=3)
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        parser.error(f"--labels has {len(args.labels)} labels for {len(args.run_dirs)} RUN_DIRs")
    if args.smooth < 1 or args.columns < 1:
        parser.error(f"--smooth and --columns must be >= 1, got {args.smooth} and {args.columns}")
    return args


def run_label(path):
    """Default label of a run: its folder name (the folder of a metrics.jsonl file)."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        path = os.path.dirname(path)
    return os.path.basename(path)


def main(argv=None):
    args = parse_args(argv)
    try:
        runs = [read_metrics(path) for path in args.run_dirs]
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"plot_metrics.py: {err}")
    labels = args.labels or [run_label(path) for path in args.run_dirs]
    keys, skipped = choose_curves(runs, args.keys or [key for key, _ in CURVES])
    if not keys:
        sys.exit(
            f"plot_metrics.py: none of the keys {args.keys or [k for k, _ in CURVES]} has a nonzero value "
            f"in {', '.join(args.run_dirs)}"
        )
    default_out = os.path.join(
        args.run_dirs[0] if os.path.isdir(args.run_dirs[0]) else os.path.dirname(os.path.abspath(args.run_dirs[0])),
        "metrics.png",
    )
    out_path = args.out or default_out
    plot_runs(runs, labels, keys, out_path, args.x, args.smooth, args.columns)
    for rows, label in zip(runs, labels):
        print(f"run {label}: {len(rows)} logged steps, last step {rows[-1]['step']}")
    print(f"curves: {', '.join(keys)}")
    if skipped:
        print(f"skipped (0 at every step): {', '.join(skipped)}")
    print(f"wrote {out_path}")
    return keys


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
