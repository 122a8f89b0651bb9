"""Per-rank peak memory and step time of a 2-step GRPO run under torchrun with 2 ranks: DDP against ``--fsdp 1`` (and
its ``--fsdp_reshard_after_forward 0`` and ``--fsdp_cpu_offload 1`` variants), at several model shapes.

Each row is one ``torchrun --standalone --nproc_per_node 2`` of ``trainer/train_grpo.py``'s ``main`` for 2 steps: random
weights (``--from_weight none``), the bundled prompts, 2 prompts x 4 answers per rank, every answer forced to
``--max_gen_len`` tokens (``full_length.py``), the rule rewards (no reward model), CISPO with beta 0.1 (a reference),
fp32, no evaluation, no final save. Every rank reports its process's peak resident memory (``ru_maxrss``: start-up,
rollouts, reference, updates) and, at the last step, what it holds of the policy's parameters and AdamW state (counted
from its local shards; its gradients have the parameters' layout). The step time is rank 0's second step.

Rows (``--rows``, comma-separated; ``--list``): ``{shape}_{mode}``, shape ``up`` (768 x 8, upstream MiniMind's),
``h1024`` (1,024 x 12), ``h1536`` (1,536 x 16); mode ``ddp``, ``fsdp``, ``fsdp_keep`` (``--fsdp_reshard_after_forward
0``), ``fsdp_offload`` (``--fsdp_cpu_offload 1``), ``ddp_levers`` and ``fsdp_levers`` (with the memory levers of
docs/memory.md: checkpointing, micro-batches of 2, log-prob chunks of 1,024).

    python scripts/bench/fsdp_memory.py --rows h1024_ddp,h1024_fsdp --json_out scripts/bench/results/fsdp_memory.json

Prints one table: per-rank peak RSS (MiB) of rank 0 and rank 1, the larger one's ratio to the same shape's DDP row, the
parameters and AdamW values rank 0 holds, and the second step's seconds. A ``fsdp`` row's DDP row is the same shape's
``ddp`` row, a ``fsdp_levers`` row's the ``ddp_levers`` one; either must come first in ``--rows``.
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for path in (ROOT, os.path.join(ROOT, "scripts", "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

SHAPES = {
    "up": ["--hidden_size", "768", "--num_hidden_layers", "8"],
    "h1024": ["--hidden_size", "1024", "--num_hidden_layers", "12"],
    "h1536": ["--hidden_size", "1536", "--num_hidden_layers", "16"],
}
LEVERS = ["--gradient_checkpointing", "1", "--micro_batch_size", "2", "--logprob_chunk_size", "1024"]  # docs/memory.md
MODES = {
    "ddp": [],
    "fsdp": ["--fsdp", "1"],
    "fsdp_keep": ["--fsdp", "1", "--fsdp_reshard_after_forward", "0"],
    "fsdp_offload": ["--fsdp", "1", "--fsdp_cpu_offload", "1"],
    "ddp_levers": LEVERS,
    "fsdp_levers": ["--fsdp", "1", *LEVERS],
}
BATCH = ["--batch_size", "2", "--num_generations", "4", "--max_seq_len", "256", "--max_gen_len", "256"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="h1024_ddp,h1024_fsdp")
    parser.add_argument("--json_out", default="")
    parser.add_argument("--device", default="cpu", help="cpu (gloo), or cuda: each rank the GPU of its LOCAL_RANK")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds a row may take")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def row_argv(name, save_dir, device):
    """``trainer/train_grpo.py``'s flags of row ``name`` (module docstring)."""
    shape, mode = name.split("_", 1)
    return [
        *SHAPES[shape],
        *BATCH,
        *MODES[mode],
        "--from_weight",
        "none",
        "--dtype",
        "float32",
        "--reward_model_path",
        "none",
        "--max_steps",
        "2",
        "--eval_interval",
        "0",
        "--save_dir",
        save_dir,
        "--run_dir",
        os.path.join(save_dir, "run"),
        "--device",
        device,
    ]


def run_worker(spec):
    """One rank of a row: ``train_grpo.main`` with full-length answers; the final save replaced by a count of the
    local shards. Writes ``rank{r}.json`` into the row's folder."""
    import torch
    import torch.distributed as dist
    from full_length import full_length_answers

    from trainer import train_grpo
    from trainer.infra.fsdp import local_numel

    held = {}

    def count_instead_of_saving(args, script, lm_config, objects, progress, weights):
        model, optimizer = objects["model"], objects["optimizer"]
        held["parameters"] = local_numel(model.parameters())
        held["optimizer_state"] = local_numel(t for s in optimizer.state.values() for t in s.values() if t.dim())

    train_grpo.save_checkpoint = count_instead_of_saving
    with full_length_answers():
        train_grpo.main(spec["argv"])
    rank = int(os.environ.get("RANK", 0))
    result = {
        "rank": rank,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
        **held,
    }
    if torch.cuda.is_available() and spec["device"] != "cpu":
        result["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        with open(os.path.join(spec["save_dir"], "run", "metrics.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        result["step_s"] = rows[-1]["elapsed_s"] - rows[-2]["elapsed_s"]
        result["response_len"] = rows[-1]["response_len"]
    with open(os.path.join(spec["save_dir"], f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    del dist  # the script's main shut the process group down


def run_row(name, device, timeout):
    """The row's two ranks under torchrun; returns their results (rank 0 first), or the end of its error output."""
    with tempfile.TemporaryDirectory(prefix="fsdp_bench_") as save_dir:
        spec = {"argv": row_argv(name, save_dir, device), "save_dir": save_dir, "device": device}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        command += [os.path.abspath(__file__), "--worker", json.dumps(spec)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:  # the table says so and the next rows run
            return {"row": name, "flags": spec["argv"], "failed": done.stderr[-3000:]}
        ranks = [json.load(open(os.path.join(save_dir, f"rank{r}.json"), encoding="utf-8")) for r in range(2)]
    return {"row": name, "flags": spec["argv"], "ranks": ranks}


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        for shape in SHAPES:
            for mode in MODES:
                print(f"{shape}_{mode}: {' '.join(SHAPES[shape] + MODES[mode])}")
        return
    if args.worker:
        run_worker(json.loads(args.worker))
        return
    print(
        "| row | peak RSS rank 0 / rank 1 (MiB) | larger / DDP's | parameters on rank 0 (M) "
        "| AdamW values on rank 0 (M) | second step (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- |", flush=True)
    results, ddp_peak = [], {}
    for name in args.rows.split(","):
        result = run_row(name, args.device, args.timeout)
        results.append(result)
        if "failed" in result:  # e.g. "exitcode  : -9 (pid: 123)  (SIGKILL)": the out-of-memory killer
            causes = [line.strip() for line in result["failed"].splitlines() if "exitcode" in line]
            print(f"| {name} | failed: {'; '.join(causes)[:300]} | | | | |", flush=True)
            if args.json_out:
                write_results(args.json_out, results)
            continue
        rank0, rank1 = result["ranks"]
        peak = max(rank0["peak_rss_mib"], rank1["peak_rss_mib"])
        shape, mode = name.split("_", 1)
        baseline = f"{shape}_ddp" + ("_levers" if mode.endswith("levers") else "")  # the same shape and levers
        if mode.startswith("ddp"):
            ddp_peak[baseline] = peak
        ratio = f"{peak / ddp_peak[baseline]:.2f}" if baseline in ddp_peak else "-"
        print(
            f"| {name} | {rank0['peak_rss_mib']:,.0f} / {rank1['peak_rss_mib']:,.0f} | {ratio} | "
            f"{rank0['parameters'] / 1e6:.1f} | {rank0['optimizer_state'] / 1e6:.1f} | {rank0['step_s']:.0f} |",
            flush=True,
        )
        if args.json_out:  # after every row: a long run stopped later keeps the rows it measured
            write_results(args.json_out, results)


def write_results(path, results):
    """The rows measured so far, with the machine, as JSON at ``path``."""
    import torch

    machine = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"machine": machine, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
