"""What each speed lever buys on the real default runs: the training scripts with one lever switched off.

``scripts/bench/bench.py`` compares our step with TRL's on a fixed, full-length workload (no padding, so the layouts
that skip padding have nothing to skip there). This script times the runs users start: ``python
trainer/train_grpo.py`` and ``python trainer/train_ppo.py`` on the embedded default (ragged answers of ~50 of up
to 96 tokens, 4 prompts x 6 answers for GRPO, 16 prompts for PPO), each variant a subprocess, the variants in
turn (A B C A B C ...) so that a drift of the shared machine's speed touches them all alike.

Figures per variant: seconds per step (each run's median over its steps after the first, which holds start-up
work), then the median and the min-max of those over ``--repeats`` runs, and the ratio to the defaults' median.
``first loss`` is step 1's policy loss: the first rollout is the same for every variant (same seed, same
weights), so equal digits there show that a layout computes the same numbers.

Run:
    python scripts/bench/bench_levers.py                      # about 10 minutes on a 2-core CPU
    python scripts/bench/bench_levers.py --steps 3 --repeats 1 --scripts grpo   # a quick look
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from scripts.bench.bench import has_bf16_units

VARIANTS = {  # script -> [(name, flags)]; the first of each is the defaults
    "grpo": [
        ("defaults (shared prefix)", []),
        ("--shared_prefix 0 (a copy of the prompt per answer)", ["--shared_prefix", "0"]),
        ("--dtype bfloat16", ["--dtype", "bfloat16"]),
    ],
    "ppo": [
        ("defaults", []),
        ("--dtype bfloat16", ["--dtype", "bfloat16"]),
    ],
}


def run_training(script, flags, steps, work_dir, timeout):
    """``python trainer/train_{script}.py`` for ``steps`` steps without evaluation or checkpoints.

    Returns (seconds per step after the first list[float], step 1's policy_loss, whole process wall seconds).
    Raises RuntimeError with the end of the output when the run fails.
    """
    run_dir = os.path.join(work_dir, "run")
    command = [
        sys.executable,
        os.path.join(ROOT, "trainer", f"train_{script}.py"),
        "--max_steps",
        str(steps),
        "--eval_interval",
        "0",
        "--save_interval",
        "1000000",
        "--save_dir",
        work_dir,
        "--run_dir",
        run_dir,
        "--use_wandb",
        "0",
        *flags,
    ]
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    rows = [row for row in rows if "elapsed_s" in row]
    elapsed = [row["elapsed_s"] for row in rows]
    return [b - a for a, b in zip(elapsed, elapsed[1:])], rows[0]["policy_loss"], wall


def format_table(script, results):
    """One markdown table for a script: a row per variant (results: name -> list of (per-run median, loss))."""
    lines = [
        f"| train_{script}.py | s/step, median of {len(next(iter(results.values())))} runs | min-max over runs | "
        "/ defaults | first loss |",
        "|---|---|---|---|---|",
    ]
    baseline = None
    for name, runs in results.items():
        medians = [m for m, _ in runs]
        median = statistics.median(medians)
        baseline = baseline or median
        lines.append(
            f"| {name} | {median:.3f} | {min(medians):.3f}-{max(medians):.3f} | {median / baseline:.2f} | "
            f"{runs[0][1]:.6f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Seconds per step of the default runs, one speed lever off at a time")
    parser.add_argument("--scripts", default="grpo,ppo", help="comma list of grpo, ppo")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    args = parser.parse_args(argv)
    for script in args.scripts.split(","):
        if script not in VARIANTS:
            parser.error(f"--scripts: unknown script {script!r}; valid: {', '.join(VARIANTS)}")
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 and --repeats >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    print(
        f"{cpu}, {os.cpu_count()} cores, bf16 units: {has_bf16_units('cpu')}; {args.steps} steps a run, "
        f"{args.repeats} runs a variant",
        flush=True,
    )
    tables = []
    for script in args.scripts.split(","):
        variants = [(n, f) for n, f in VARIANTS[script] if has_bf16_units("cpu") or "bfloat16" not in f]
        results = {name: [] for name, _ in variants}
        for repeat in range(args.repeats):
            for name, flags in variants:
                with tempfile.TemporaryDirectory() as work_dir:
                    seconds, loss, wall = run_training(script, flags, args.steps, work_dir, args.timeout)
                results[name].append((statistics.median(seconds), loss))
                print(
                    f"train_{script} {name} run {repeat + 1}: {statistics.median(seconds):.3f} s/step, "
                    f"first loss {loss:.6f}, process {wall:.1f} s",
                    flush=True,
                )
        tables.append(format_table(script, results))
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
