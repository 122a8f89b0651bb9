"""The prepared GPU check: one command, about 8 minutes on one GPU, that prints what the CPU machines cannot
measure. Run it where a CUDA GPU is (no network or SGLang needed):

    python scripts/check_gpu.py
    python scripts/check_gpu.py --device cpu --steps 2 --skip_compile 1   # a dry run of the same code (CPU)

It prints, in this order:
  1. bf16 autocast at step 0: the rollout's old log-probs against a fresh forward of the same weights
     (``compute_per_token_logps``), max and mean |difference| over real tokens, and the ratio's mean;
  2. ``--steps`` GRPO and PPO steps of the embedded default (``--dtype auto`` = bf16 on the GPU): median step
     time over the steps after the first, and peak GPU memory;
  3. GRPO with ``--use_compile 1`` against 0: median step time after the first step (the compile);
  4. ``scripts/bench/profile_run.py`` for GRPO and PPO, ``--steps`` steps each: where the command's and a step's
     time goes, and the operator calls per decode step (the tables of docs/performance.md);
  5. ``scripts/bench/bench.py`` at both model sizes in bf16 (ours against TRL where TRL is installed), when
     ``--bench 1``;
  6. ``scripts/bench/memory.py --device DEVICE``: the memory levers' peak GPU memory (allocated and reserved) for one
     whole GRPO step at upstream MiniMind's sizes in bf16, levers off and on, the Qwen3-0.6B shape with every lever,
     and TRL's GRPOTrainer with its gradient checkpointing (``--memory_rows``; about 3 minutes on an H100);
  7. on a machine with 2 GPUs or more, ``scripts/bench/fsdp_memory.py --device cuda``: DDP against ``--fsdp 1`` under
     torchrun with 2 ranks, per-rank peak memory and step time of a 2-step GRPO run (``--fsdp_rows``); one GPU: skipped
     with a line that says so (two ranks cannot share one GPU under NCCL).
Each training run is ``python trainer/train_*.py`` in a subprocess, as a user runs it; its metrics.jsonl is read.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from trainer.rollout_engine import TorchRolloutEngine, compute_per_token_logps, tokenize_prompts
from trainer.infra.weights import DEFAULT_TOKENIZER_PATH, build_config, init_model
from trainer.infra.dtypes import autocast_context, resolve_train_dtype
from trainer.infra.flags import add_bool_flag
from trainer.trainer_utils import masked_mean
from dataset.lm_dataset import RLAIFDataset


def step_zero_ratio(device, dtype, num_prompts=8, num_generations=4, max_gen_len=64):
    """Rollout (sampler log-probs) and a fresh forward of the embedded default policy under ``dtype`` autocast:
    the ratio exp(new - old) every loss sees at step 0. Returns a dict of floats."""
    torch.manual_seed(0)
    model, tokenizer = init_model(
        build_config(256, 4, 0), "full_sft", os.path.join(ROOT, "out"), DEFAULT_TOKENIZER_PATH, device
    )
    dataset = RLAIFDataset(os.path.join(ROOT, "dataset", "rlaif_val.jsonl"), tokenizer, thinking_ratio=1.0, seed=0)
    prompts = [dataset[i]["prompt"] for i in range(num_prompts)]
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts, 256, device)
    engine = TorchRolloutEngine(model, tokenizer, generator=torch.Generator(device=device).manual_seed(0))
    with torch.no_grad(), autocast_context(device, dtype):
        rollout = engine.rollout(prompt_ids, attention_mask, num_generations, max_gen_len)
        new_logps = compute_per_token_logps(
            model, rollout.output_ids, rollout.completion_ids.size(1), rollout.attention_mask
        ).per_token_logps  # [N, R]
    mask = rollout.completion_mask  # [N, R]
    difference = (new_logps - rollout.per_token_logps).abs() * mask  # [N, R]
    ratio = torch.exp(new_logps - rollout.per_token_logps)  # [N, R]
    return {
        "max_abs_diff": difference.max().item(),
        "mean_abs_diff": masked_mean(difference, mask).item(),
        "ratio_mean": masked_mean(ratio, mask).item(),
        "tokens": int(mask.sum().item()),
    }


def train(script, flags, work_dir, timeout):
    """Run ``python trainer/{script}.py`` with ``flags``; return (metrics rows, seconds per step list, peak GiB)."""
    run_dir = os.path.join(work_dir, "run")
    command = [
        sys.executable,
        os.path.join(ROOT, "trainer", f"{script}.py"),
        *flags,
        "--save_dir",
        work_dir,
        "--run_dir",
        run_dir,
        "--eval_interval",
        "0",
        "--save_interval",
        "100000",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if '"elapsed_s"' in line]
    elapsed = [row["elapsed_s"] for row in rows]
    step_seconds = [b - a for a, b in zip(elapsed, elapsed[1:])]  # from step 2 on: step 1 holds start-up work
    peak = max((row.get("gpu_peak_memory_gib", 0.0) for row in rows), default=0.0)
    return rows, step_seconds, peak


def median_text(values):
    return f"{statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f}, n {len(values)})"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="The prepared GPU check (bf16 ratio, step times, memory, compile)")
    parser.add_argument("--device", default="cuda:0", help="the GPU to check (cpu: a dry run of the same code)")
    parser.add_argument("--steps", type=int, default=20, help="GRPO and PPO steps of the embedded default")
    add_bool_flag(parser, "--skip_compile", help="1: leave out the --use_compile comparison")
    add_bool_flag(parser, "--bench", help="1: also run scripts/bench/bench.py at both sizes in bf16")
    parser.add_argument(
        "--memory_rows",
        default="up_bf16_off,up_bf16_all,up_bf16_rm18_all,qwen3_bf16_rm18_off,qwen3_bf16_rm18_all,trl_bf16_checkpointing",
        help="rows of scripts/bench/memory.py to measure on the GPU ('' = none)",
    )
    parser.add_argument(
        "--fsdp_rows",
        default="h1024_ddp,h1024_fsdp,h1024_fsdp_offload,h1536_ddp,h1536_fsdp",
        help="rows of scripts/bench/fsdp_memory.py to measure with 2 GPUs ('' = none)",
    )
    parser.add_argument("--timeout", type=int, default=420, help="seconds per training run")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first step is not timed), got {args.steps}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device {args.device}: torch.cuda.is_available() is False here (use --device cpu for a dry run)"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    dtype = resolve_train_dtype("auto", args.device)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"device {args.device} ({name}), torch {torch.__version__}, dtype auto = {dtype}", flush=True)

    zero = step_zero_ratio(args.device, "bfloat16")
    print(
        f"1. bf16 autocast, step 0, {zero['tokens']} tokens: max |new - old| log-prob {zero['max_abs_diff']:.2e}, "
        f"mean {zero['mean_abs_diff']:.2e}, ratio mean {zero['ratio_mean']:.6f}",
        flush=True,
    )

    common = ["--device", args.device, "--max_steps", str(args.steps)]
    with tempfile.TemporaryDirectory() as work_dir:
        for script in ("train_grpo", "train_ppo"):
            _, seconds, peak = train(script, common, os.path.join(work_dir, script), args.timeout)
            print(
                f"2. {script} x {args.steps} steps ({dtype}): step {median_text(seconds)}, "
                f"peak GPU memory {peak:.2f} GiB",
                flush=True,
            )
        if not args.skip_compile:
            for use_compile in ("0", "1"):
                _, seconds, _ = train(
                    "train_grpo",
                    common + ["--use_compile", use_compile],
                    os.path.join(work_dir, f"compile{use_compile}"),
                    args.timeout,
                )
                print(f"3. train_grpo --use_compile {use_compile}: step {median_text(seconds)}", flush=True)
    for script in ("grpo", "ppo"):
        command = [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench", "profile_run.py"),
            "--script",
            script,
            "--device",
            args.device,
            "--",
            "--max_steps",
            str(args.steps),
        ]
        print("4. " + " ".join(command), flush=True)
        subprocess.run(command, check=False, timeout=args.timeout)
    if args.bench:
        command = [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench", "bench.py"),
            "--dtype",
            "bfloat16",
            "--device",
            args.device,
            "--lengths",
            "64",
            "--steps",
            "3",
        ]
        print("5. " + " ".join(command), flush=True)
        subprocess.run(command, check=False)
    if args.memory_rows:
        command = [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench", "memory.py"),
            "--device",
            args.device,
            "--rows",
            args.memory_rows,
        ]
        print("6. " + " ".join(command), flush=True)
        subprocess.run(command, check=False)
    if args.fsdp_rows and torch.device(args.device).type == "cuda":
        command = [sys.executable, os.path.join(ROOT, "scripts", "bench", "fsdp_memory.py"), "--device", "cuda"]
        command += ["--rows", args.fsdp_rows]
        if torch.cuda.device_count() < 2:
            print(f"7. skipped: {torch.cuda.device_count()} GPU here, 2 needed for: {' '.join(command)}", flush=True)
        else:
            print("7. " + " ".join(command), flush=True)
            subprocess.run(command, check=False)


if __name__ == "__main__":
    main()
