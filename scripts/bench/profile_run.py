"""Where the time of a default training command goes: the whole command, one step, and a decode step's operators.

    python scripts/bench/profile_run.py --script grpo            # the README's `python trainer/train_grpo.py`
    python scripts/bench/profile_run.py --script ppo -- --max_steps 30   # flags after -- go to the script

The script runs ``trainer.train_{grpo,ppo}.main(argv)`` in this process, as ``python trainer/train_X.py ARGV``
would, with ``--save_dir`` a temporary folder (the bundled start weights and reward model linked into it, the
folder removed at the end), and times it with ``PhaseTracer`` (``scripts/bench/bench.py``: ``sys.settrace`` sees the
entry and return of chosen functions; nothing is replaced). It prints three tables:

1. the whole command: imports, set-up (weights, reward model, optimizer, until the first rollout, less the
   step-0 evaluation), evaluations, steps, saves, the end (after the last step);
2. one step, the mean over the run's steps: rollout decode (``TorchRolloutEngine.rollout``), reward (rule +
   reward model, ``calculate_rewards``), reference and old log-probs (the forwards without gradient), PPO's
   critic forwards, policy forward, backward, optimizer, logging (``StepLog.write``), other (the rest);
3. operator calls per decode step: the aten operators one rollout of the run's shape dispatches
   (``TorchDispatchMode``), divided by its decode steps, and the milliseconds per decode step.

With ``--json FILE`` the figures are also written there. ``scripts/check_gpu.py`` runs it with ``--device cuda``.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

START = time.perf_counter()  # the command's clock starts before the imports it pays for
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

IMPORTS_START = time.perf_counter()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="profile one default training command")
    parser.add_argument("--script", choices=["grpo", "ppo"], default="grpo")
    parser.add_argument("--json", default="", help="also write the figures to this JSON file")
    parser.add_argument("--device", default="", help="passed to the script as --device (default: its own)")
    parser.add_argument("script_argv", nargs="*", help="flags for the training script, after --")
    return parser.parse_args(argv)


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside the block (``calls``)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def decode_profile(module, args, device):
    """Operator calls and milliseconds per decode step of one rollout of the run's shape (the start weights, the
    first batch of its prompts), as the script builds them. Returns a dict."""
    from dataset.lm_dataset import RLAIFDataset
    from trainer.infra.weights import build_config, load_policy, load_tokenizer, weight_path
    from trainer.rollout_engine import TorchRolloutEngine, tokenize_prompts

    start_weight = weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe)
    tokenizer = load_tokenizer(args.tokenizer_path, start_weight, args.tokenizer_path_named)
    dataset = RLAIFDataset(args.data_path, tokenizer, thinking_ratio=args.thinking_ratio, seed=args.seed)
    config = build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
    model = load_policy(config, args.from_weight, args.save_dir, tokenizer, device).eval()
    answers = getattr(args, "num_generations", 1)
    prompts = [dataset[i]["prompt"] for i in range(args.batch_size)]
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts, args.max_seq_len, device)
    engine = TorchRolloutEngine(model, tokenizer, generator=torch.Generator(device=device).manual_seed(0))
    with torch.no_grad():
        engine.rollout(prompt_ids, attention_mask, answers, args.max_gen_len, args.temperature)  # warm-up
        counter = CountOps()
        with counter:
            result = engine.rollout(prompt_ids, attention_mask, answers, args.max_gen_len, args.temperature)
        decode_steps = result.completion_ids.size(1)
        began = time.perf_counter()
        timed = engine.rollout(prompt_ids, attention_mask, answers, args.max_gen_len, args.temperature)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began
    return {
        "rows": prompt_ids.size(0) * answers,
        "decode_steps": decode_steps,
        "operator_calls": counter.calls,
        "operator_calls_per_decode_step": counter.calls / max(decode_steps, 1),
        "ms_per_decode_step": 1000 * seconds / max(timed.completion_ids.size(1), 1),
    }


def main(argv=None):
    options = parse_args(argv)
    from scripts.bench.bench import PhaseTracer, forward_phase, watch_update

    module = __import__(f"trainer.train_{options.script}", fromlist=["main"])
    from trainer.evaluation import HeldOutEvaluator
    from trainer.infra.checkpoints import save_checkpoint
    from trainer.infra.metrics import StepLog
    from trainer.infra.optimizer import project_scale_only_gradients
    from trainer.infra.stopping import finish_run
    from trainer.rollout_engine import TorchRolloutEngine, compute_per_token_logps
    from trainer.trainer_utils import calculate_rewards
    from model.model_minimind import CriticModel

    imports_done = time.perf_counter()

    tmp = tempfile.mkdtemp(prefix=f"profile_{options.script}_")
    save_dir = os.path.join(tmp, "out")
    os.makedirs(save_dir)
    bundled = os.path.join(ROOT, "out")
    for name in os.listdir(bundled):  # the bundled start weights, tokenizer and reward model, linked
        if name.startswith(("full_sft_", "reward_model_")):
            os.symlink(os.path.join(bundled, name), os.path.join(save_dir, name))
    script_argv = ["--save_dir", save_dir, *options.script_argv]
    if options.device:
        script_argv += ["--device", options.device]
    args = module.parse_args(script_argv)

    device = options.device or "cpu"
    tracer = PhaseTracer(device)
    watch_update(tracer)
    tracer.watch(project_scale_only_gradients, "optimizer")
    tracer.watch(TorchRolloutEngine.rollout, "rollout decode")
    tracer.watch(calculate_rewards, "reward (rule + reward model)")
    forward = module.group_policy_forward if options.script == "grpo" else compute_per_token_logps

    def forward_kind(frame):
        return "policy forward" if forward_phase(frame) == "policy_forward" else "reference and old log-probs"

    tracer.watch(forward, forward_kind)
    tracer.watch(CriticModel.forward, "critic forwards")
    tracer.watch(StepLog.write, "logging")
    tracer.watch(HeldOutEvaluator.__call__, "evaluations")
    tracer.watch(save_checkpoint, "saves")
    tracer.watch(finish_run, "end")
    rollout_step = module.grpo_rollout if options.script == "grpo" else module.ppo_rollout
    step_starts = []
    tracer.at_entry(rollout_step, lambda: (step_starts.append(time.perf_counter()), tracer.end_step()))
    main_start = time.perf_counter()
    with tracer.tracing():
        module.main(script_argv)
    main_end = time.perf_counter()
    tracer.end_step()
    setup_phases, step_phases = tracer.steps[0], tracer.steps[1:]  # the first closes at the first rollout

    totals = {}
    for phases in tracer.steps:
        for name, seconds in phases.items():
            totals[name] = totals.get(name, 0.0) + seconds
    command = {
        "imports": imports_done - START,
        "set-up": step_starts[0] - main_start - setup_phases.get("evaluations", 0.0),
        "evaluations": totals.get("evaluations", 0.0),
        "saves": totals.get("saves", 0.0),
        "end": totals.get("end", 0.0),
    }
    command["steps"] = (
        (main_end - main_start) - command["set-up"] - command["evaluations"] - command["saves"] - command["end"]
    )
    command["whole command"] = main_end - START
    step_names = [
        "rollout decode",
        "reward (rule + reward model)",
        "reference and old log-probs",
        "critic forwards",
        "policy forward",
        "policy_backward",
        "optimizer",
        "logging",
    ]
    num_steps = len(step_phases)
    per_step = {name: sum(p.get(name, 0.0) for p in step_phases) / num_steps for name in step_names}
    per_step["other"] = command["steps"] / num_steps - sum(per_step.values())
    decode = decode_profile(module, args, args.device or device)
    shutil.rmtree(tmp, ignore_errors=True)  # the run's checkpoints and metrics (its figures are printed)

    print(
        f"{options.script}: {' '.join(script_argv[2:]) or 'the defaults'}, {num_steps} steps, device {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print("\n| the whole command | seconds | share |\n| --- | --- | --- |")
    whole = command["whole command"]
    for name in ("imports", "set-up", "evaluations", "steps", "saves", "end", "whole command"):
        print(f"| {name} | {command[name]:.1f} | {100 * command[name] / whole:.0f} % |")
    step_mean = command["steps"] / num_steps
    print(f"\n| one step (mean of {num_steps}) | seconds | share |\n| --- | --- | --- |")
    for name, seconds in per_step.items():
        print(f"| {name.replace('policy_backward', 'backward')} | {seconds:.3f} | {100 * seconds / step_mean:.0f} % |")
    print(f"| the step | {step_mean:.3f} | 100 % |")
    print(
        f"\n| decode | rows | decode steps | operator calls per decode step | ms per decode step |\n"
        f"| --- | --- | --- | --- | --- |\n| one rollout | {decode['rows']} | {decode['decode_steps']} | "
        f"{decode['operator_calls_per_decode_step']:.0f} | {decode['ms_per_decode_step']:.1f} |"
    )
    if options.json:
        with open(options.json, "w") as f:
            json.dump(
                {
                    "script": options.script,
                    "argv": script_argv[2:],
                    "steps": num_steps,
                    "command": command,
                    "per_step": per_step,
                    "decode": decode,
                    "step_seconds_median": statistics.median([sum(p.values()) for p in step_phases]),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
