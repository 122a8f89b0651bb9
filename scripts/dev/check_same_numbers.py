"""Same seed, same numbers: compare the metrics.jsonl of the RL scripts between this checkout and a git revision.

A refactor must keep every logged number identical. Float results depend on the CPU's vector unit and the torch
release, so the comparison is made on one machine: the revision is checked out into a temporary git worktree, the
same command runs there and here (one thread, wandb off), and every key of every row is compared bit for bit
(key order included; only the wall time ``elapsed_s`` is left out).

    python scripts/dev/check_same_numbers.py --against main          # GRPO and PPO, --max_steps 5, their defaults
    python scripts/dev/check_same_numbers.py --against HEAD~3 --scripts grpo --max_steps 2 -- --shared_prefix 0

Prints one line per script and exits 1 when any number differs (the first differences are printed).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMING_KEYS = ("elapsed_s",)


def run_metrics(checkout, script, max_steps, extra_flags, work_dir):
    """Run ``trainer/train_{script}.py --max_steps N`` of ``checkout`` (one thread, wandb off) under ``work_dir``.

    Returns the metrics.jsonl rows as dicts without ``TIMING_KEYS``. Raises RuntimeError with the output's tail
    when the run fails.
    """
    run_dir = os.path.join(work_dir, "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    command = [
        sys.executable,
        os.path.join(checkout, "trainer", f"train_{script}.py"),
        "--max_steps",
        str(max_steps),
        *extra_flags,
        "--save_dir",
        work_dir,
        "--run_dir",
        run_dir,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=checkout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed in {checkout}:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def compare_rows(expected_rows, rows, allow_new_keys=False):
    """Differences between two lists of metric rows, as readable strings (empty when identical).

    Rows must have the same keys in the same order and bit-identical values (``==`` on the JSON values, so
    0.1 + 2e-17 differs from 0.1); a missing or extra row is a difference. With ``allow_new_keys`` a row may hold
    keys the expected row does not (a new metric): every expected key must still be there, in the same order
    relative to the others, with the same value.
    """
    differences = []
    if len(rows) != len(expected_rows):
        differences.append(f"{len(rows)} rows instead of {len(expected_rows)}")
    for index, (expected, row) in enumerate(zip(expected_rows, rows)):
        where = f"row {index} (step {expected.get('step')})"
        if allow_new_keys:
            row = {key: value for key, value in row.items() if key in expected}
        if list(row) != list(expected):
            differences.append(f"{where}: keys {list(row)} instead of {list(expected)}")
            continue
        differences += [
            f"{where} {key}: {row[key]!r} instead of {expected[key]!r}" for key in expected if row[key] != expected[key]
        ]
    return differences


def checkout_revision(revision, path):
    """A detached git worktree of ``revision`` at ``path`` (removed by ``remove_worktree``)."""
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", path, revision], check=True, capture_output=True, text=True
    )


def remove_worktree(path):
    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], check=False, capture_output=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", required=True, help="git revision to compare with (a branch, tag or commit)")
    parser.add_argument(
        "--scripts",
        nargs="+",
        default=["grpo", "ppo"],
        choices=["grpo", "ppo", "agent"],
        help="which training scripts to run",
    )
    parser.add_argument("--max_steps", type=int, default=5, help="steps of each run (step 0 is the evaluation)")
    parser.add_argument(
        "--allow_new_keys",
        action="store_true",
        help="rows here may hold new metrics; every metric of the revision must be identical",
    )
    parser.add_argument("flags", nargs="*", help="more flags for both runs, after --")
    args = parser.parse_args(argv)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        checkout_revision(args.against, base)
        try:
            for script in args.scripts:
                expected = run_metrics(base, script, args.max_steps, args.flags, os.path.join(tmp, f"{script}_base"))
                rows = run_metrics(ROOT, script, args.max_steps, args.flags, os.path.join(tmp, f"{script}_here"))
                differences = compare_rows(expected, rows, args.allow_new_keys)
                keys = sum(len(row) for row in expected)
                new_keys = sorted({key for row in rows for key in row} - {key for row in expected for key in row})
                if differences:
                    failed = True
                    print(f"{script}: {len(differences)} differences against {args.against}:")
                    for line in differences[:20]:
                        print(f"  {line}")
                else:
                    print(
                        f"{script}: identical to {args.against} ({len(rows)} rows, {keys} numbers and keys)"
                        + (f"; new here: {', '.join(new_keys)}" if new_keys else "")
                    )
        finally:
            remove_worktree(base)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
