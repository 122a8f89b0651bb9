"""Peak memory and time of one RL update, full fine-tuning against LoRA (``--lora_rank``), for GRPO and PPO.

Each configuration runs in its own process (so its peak resident memory is its own) and does what a training step
holds in memory for its update: the roles of chapter 8.1 as the scripts build them (the policy, a frozen copy as the
reference or, with LoRA, the same model with its adapters off, and for PPO the critic: a full model, or with LoRA
its own frozen copy of the backbone with adapters and the value head trained in full), their AdamW, the old,
reference and (PPO) value forwards, the policy loss (CISPO; PPO's clipped surrogate and value loss), the backward
and the optimizer steps, on a fixed batch of ``--rows`` answers of ``--prompt_len`` + ``--completion_len`` tokens
under autocast at ``--dtypes``. The rollout's decode is not run: its KV cache is the same with or without LoRA.
The reward model is left out for the same reason. Weights are random (the memory and the time do not depend on them).

    python scripts/bench/lora_memory.py                      # hidden 768 x 8 and the Qwen3-0.6B shape
    python scripts/bench/lora_memory.py --shapes tiny --steps 2 --json_out /tmp/lora_memory.json

Prints one table: peak RSS (MiB) and the median seconds per update step after the first, full and LoRA, and LoRA /
full; a configuration whose memory passes 90 % of what the machine had available is stopped and reads "did not fit
(> X)", X its resident memory when it was stopped, a lower bound of its peak (and LoRA / full reads "< X / Y").
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SHAPES = {  # MiniMindConfig fields
    "tiny": dict(hidden_size=64, num_hidden_layers=2),
    "768x8": dict(hidden_size=768, num_hidden_layers=8),  # upstream MiniMind-3
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
    ),  # Qwen3-0.6B's config.json
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="768x8,qwen3-0.6b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--scripts", default="grpo,ppo", help="comma-separated: grpo, ppo")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="autocast dtypes, comma-separated")
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4, help="answers in the batch (GRPO: 2 prompts x 2)")
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--completion_len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="update steps per configuration (the first warms up)")
    parser.add_argument("--json_out", default="", help="write every figure here too")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            parser.error(f"--shapes: unknown shape {shape!r}; valid: {', '.join(SHAPES)}")
    for script in args.scripts.split(","):
        if script not in ("grpo", "ppo"):
            parser.error(f"--scripts: unknown script {script!r}; valid: grpo, ppo")
    if args.steps < 2 or args.rows < 2 or args.lora_rank < 1:
        parser.error("--steps and --rows must be >= 2 and --lora_rank >= 1")
    return args


def status_kib(field, path="/proc/self/status"):
    """A ``kB`` field of /proc/self/status (VmSize, VmHWM) or /proc/meminfo (MemAvailable), in KiB."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"{path} has no {field}")


def run_worker(spec):
    """One configuration in this process: returns peak RSS (MiB), the baseline after imports and the step times."""
    import copy
    import torch
    from model.model_minimind import CriticModel, MiniMindConfig, MiniMindForCausalLM
    from trainer.infra.dtypes import autocast_context
    from trainer.infra.lora import critic_with_adapters, merged_state_dict, with_adapters
    from trainer.infra.optimizer import adamw, build_policy_optimizer
    from trainer.rollout_engine import compute_per_token_logps
    from trainer.train_grpo import grpo_loss
    from trainer.train_ppo import ppo_policy_loss, ppo_value_loss

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.manual_seed(0)
    config = MiniMindConfig(**SHAPES[spec["shape"]])
    policy = MiniMindForCausalLM(config)
    lora = argparse.Namespace(
        lora_rank=spec["lora_rank"],
        lora_alpha=2.0 * spec["lora_rank"],
        lora_dropout=0.0,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        from_weight="none",
    )  # random weights
    ref_model = None if lora.lora_rank else copy.deepcopy(policy).eval().requires_grad_(False)
    policy, ref_model = with_adapters(policy, ref_model, lora)
    optimizer = build_policy_optimizer(policy, 2e-5, 0.0, 2e-2)
    critic = critic_optimizer = None
    if spec["script"] == "ppo":
        critic = CriticModel(config)
        critic.load_actor_state_dict({k: v.detach().float() for k, v in merged_state_dict(policy).items()})
        critic = critic_with_adapters(critic, lora)  # --lora_rank: adapters and a value head trained in full
        critic_optimizer = adamw(critic.parameters(), lr=1e-4, weight_decay=0.0)
    autocast = autocast_context(torch.device("cpu"), spec["dtype"])
    rows, prompt_len, completion_len = spec["rows"], spec["prompt_len"], spec["completion_len"]
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, config.vocab_size, (rows, prompt_len + completion_len), generator=generator)
    mask = torch.ones(rows, completion_len, dtype=torch.long)  # [N, R]
    advantages = torch.randn(rows, generator=generator)  # [N]
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        with torch.no_grad(), autocast:
            old = compute_per_token_logps(policy, input_ids, completion_len).per_token_logps  # [N, R]
            ref = compute_per_token_logps(ref_model, input_ids, completion_len).per_token_logps
            old_values = critic(input_ids).values[:, -completion_len - 1 : -1] if critic is not None else None
        with autocast:
            logps = compute_per_token_logps(policy, input_ids, completion_len).per_token_logps  # [N, R]
            if critic is None:
                loss = grpo_loss(logps, old, ref, advantages, mask, loss_type="cispo", beta=0.1)[0]
            else:
                token_advantages = advantages.unsqueeze(1).expand(-1, completion_len)  # [N, R]
                loss = ppo_policy_loss(logps, old, ref, token_advantages, mask)[0]
                values = critic(input_ids).values[:, -completion_len - 1 : -1]  # [N, R]
                loss = loss + 0.5 * ppo_value_loss(values, old_values, old_values + token_advantages, mask)[0]
        loss.backward()
        for model, opt in ((policy, optimizer), (critic, critic_optimizer)):
            if model is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    critic_trainable = sum(p.numel() for p in critic.parameters() if p.requires_grad) if critic is not None else 0
    return {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "baseline_mib": baseline,
        "step_s": times,
        "policy_parameters": sum(p.numel() for p in policy.parameters()),
        "trainable_policy_parameters": trainable,
        "trainable_critic_parameters": critic_trainable,
    }


def run_watched(spec, share=0.9, script=None):
    """Run one configuration in its own process (``script --worker SPEC``, this file by default), stopped (SIGKILL)
    once its resident memory passes ``share`` of the memory available at its start, before the kernel's out-of-memory
    killer picks a process of its own. Returns (returncode, stdout, stderr, the largest resident memory seen in MiB),
    returncode None when it was stopped for memory."""
    limit_kib = share * status_kib("MemAvailable", "/proc/meminfo")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        worker = subprocess.Popen(
            [sys.executable, script or os.path.abspath(__file__), "--worker", json.dumps(spec)],
            stdout=out,
            stderr=err,
            text=True,
            cwd=ROOT,
        )
        stopped, largest_kib = False, 0
        while worker.poll() is None:
            try:
                rss_kib = status_kib("VmRSS", f"/proc/{worker.pid}/status")
            except (OSError, ValueError):  # the process has just ended
                rss_kib = 0
            largest_kib = max(largest_kib, rss_kib)
            if rss_kib > limit_kib:
                worker.kill()
                stopped = True
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        return (None if stopped else worker.returncode), out.read(), err.read(), largest_kib / 1024


def table_row(row):
    """One line of the table; a configuration killed for memory reads "did not fit (> its memory at the stop)"."""

    def peak(result):
        if "stopped_at_mib" in result:
            return f"did not fit (> {result['stopped_at_mib']:,.0f})"
        return f"{result['peak_rss_mib']:,.0f}"

    def step(result):
        return f"{statistics.median(result['step_s'][1:]):.2f}" if "step_s" in result else "-"

    full, lora = (row[name].get("peak_rss_mib") for name in ("full", "lora"))
    if full and lora:
        ratio = f"{lora / full:.2f}"
    elif lora:  # the full run's peak is above the memory it had when it was stopped
        ratio = f"< {lora / row['full']['stopped_at_mib']:.2f}"
    else:
        ratio = "-"
    return (
        f"| {row['shape']} | {row['script']} | {row['dtype']} | {peak(row['full'])} | {peak(row['lora'])} | "
        f"{ratio} | {step(row['full'])} | {step(row['lora'])} |"
    )


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    import torch

    results = []
    print(
        "| shape | script | dtype | peak RSS full (MiB) | peak RSS LoRA (MiB) | LoRA / full | s per step full | "
        "s per step LoRA |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for shape in args.shapes.split(","):
        for script in args.scripts.split(","):
            for dtype in args.dtypes.split(","):
                row = {"shape": shape, "script": script, "dtype": dtype}
                for name, rank in (("full", 0), ("lora", args.lora_rank)):
                    spec = dict(
                        row,
                        lora_rank=rank,
                        rows=args.rows,
                        prompt_len=args.prompt_len,
                        completion_len=args.completion_len,
                        steps=args.steps,
                    )
                    returncode, stdout, stderr, largest_mib = run_watched(spec)
                    if returncode is None:  # the configuration does not fit in this machine's memory
                        row[name] = {"stopped_at_mib": largest_mib}
                        continue
                    if returncode != 0:
                        raise SystemExit(f"{shape} {script} {dtype} {name} failed:\n{stderr[-3000:]}")
                    row[name] = json.loads(stdout.strip().splitlines()[-1])
                results.append(row)
                print(table_row(row), flush=True)
    machine = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args), **machine, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
