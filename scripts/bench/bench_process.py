"""Whole-process speed: ``python trainer/train_grpo.py`` against TRL 1.16's ``GRPOTrainer``, timed from outside.

``scripts/bench/bench.py`` times one step inside a running process. This script times what a user times: the whole
command, from the interpreter's start through the imports, the loading, the steps and the exit, as the wall
clock of a subprocess. Each contestant runs the same work twice, once with ``--short_steps`` and once with
``--long_steps`` steps; the difference of the two times divided by the difference of the step counts is the time
of one step with every per-step cost of the real loop in it, and with the start-up and the end (imports,
loading, the final save) cancelled out:

    per-step s = (T(long_steps) - T(short_steps)) / (long_steps - short_steps)

where each T is the faster of ``--runs`` runs (2). The runs go in turn (ours short, TRL short, ours long, TRL long,
then again), so a slow phase of the machine hits both contestants. ``--repeats`` R repeats this measurement R
times: the table gives the median and min-max over the repeats of each contestant's per-step time, and of the ratio
ours / TRL taken repeat by repeat.

The contestants, on the same work:
  * ours: ``python scripts/bench/full_length.py grpo``: ``trainer/train_grpo.py``'s ``main`` with every answer
    ``--gen_len`` tokens, ``--loss_type cispo --epsilon_high 5 --beta 0.1 --temperature 1 --top_k 0 --top_p 1``,
    no reward model (``--reward_model_path none``: the rule reward and the answer reward), ``--eval_interval 0``, a
    ``--save_interval`` beyond the last step, no ``--use_compile``, no tracker, ``--dtype`` of the row, and the
    learning rates of ``scripts/bench/bench.py``'s ``ours_grpo`` (the script's defaults).
  * TRL: ``GRPOTrainer.train()`` in a worker mode of this script
    (``python scripts/bench/bench_process.py --trl_worker SPEC.json``), with ``scripts/bench/bench.py``'s settings of
    its ``trl_grpo``: the same weights exported as a ``Qwen3ForCausalLM`` folder, ``min_new_tokens`` = ``--gen_len``
    (EOS never sampled: full-length work), ``loss_type="cispo"``, ``epsilon_high=5``, ``beta=0.1``, T = 1, top-k 0,
    top-p 1, learning rate 5e-5, grad norm 1, ``gradient_checkpointing=False``, ``bf16`` in the bf16 rows,
    ``save_strategy="no"``, ``report_to="none"``, a log entry every step (as ours logs every step), and a reward
    function that calls ``trainer.trainer_utils.calculate_rewards(prompts, completions, answers, None, 2.0)``.
    ``shuffle_dataset=False`` makes every TRL step take the two prompts once each (its dataset holds them
    ``steps`` times), as ours does.
  Both: 2 prompts x 6 answers (``num_generations`` 6) x ``--gen_len`` tokens, one optimizer step per rollout, the
  torch default of threads. Without TRL installed its rows say "not installed" and ours still runs.
  What still differs (as in ``scripts/bench/bench.py``): ours samples past EOS and its completion mask (hence the
  rewarded text and the loss's tokens) ends at the first EOS, while TRL never samples EOS; the tensors and the
  FLOPs are the same. TRL also computes each completion token's entropy in its policy forward and logs more
  metrics per step; ours keeps the final RMSNorm gain in a group of its own (learning rate 1e-2, its gradient
  projected) beside the other weights' 2e-5, TRL has one group at 5e-5.

The prompts: ``scripts/bench/bench.py``'s ``bench_prompts`` (two user turns of the bundled questions, at most 48
tokens with the chat header), written by its ``write_prompt_file`` to a temporary JSONL in the format
``--data_path`` reads (the user turn and its reference answer). ``RLAIFDataset`` opens ``<think>`` for a share
``--thinking_ratio`` of the prompts (0.9 by default), drawn per prompt from the seed: which of the two opens would
depend on ``--seed``. Ours runs with ``--thinking_ratio 1``, so both prompts end in ``<think>\\n``, every step, and
the prompt strings TRL and ``scripts/bench/bench.py``'s other contestants get are read back from ``RLAIFDataset`` itself
(``loader_prompts``): all see the same text, token for token. With ``--batch_size 2`` and ``--epochs`` =
``--max_steps`` = steps, each of ours' steps (one epoch of one batch) takes both prompts.

What each does at the end of its run (in both the short and the long run, so it cancels out of the per-step
figure, and it is in every whole-process time):
  * ours: the last step is always saved, whatever ``--save_interval`` says: ``grpo_{hidden}.pth`` (fp16
    weights) with its ``grpo_{hidden}.tokenizer.json``, and ``grpo_{hidden}_resume.pth`` (fp32 weights, AdamW's
    two moments, schedule, random states), each written to a temporary file, fsynced and renamed, into
    ``--save_dir`` (a folder of this script's, emptied after each run; the JSON lists what was written and its
    size: 13 + 66 MB at the default size, 138 + 787 MB at the MiniMind-3 size). Along the run: one log line per
    step on stdout and one metrics.jsonl line per step.
  * TRL: ``save_strategy="no"`` saves no checkpoint and no model (the JSON lists what its output folder holds
    after the run: nothing); ``train()`` prints a dict of metrics per step and a summary at the end.

Also measured, per repeat: ``scripts/bench/bench.py``'s ``ours_grpo`` worker on the same weights, prompts, lengths, EOS
ignored, and flags: the same ``train_grpo.py`` loop run in-process for
``--bench_warmup`` + ``--bench_steps`` steps, its step the median difference of consecutive ``elapsed_s`` values of
its metrics.jsonl (the loop's own clock) after the warm-up. ``command / in-process`` = ours' whole-process per-step
time / that step time: 1 when the loop's own clock holds every per-step cost of the command, more when the command
pays per step for something the loop's clock does not see.

Figures: a markdown table (size, dtype, ours s/step, TRL s/step, ours/TRL, in-process step s, command /
in-process), the
machine (CPU model, cores, torch, AMX and AVX512-BF16), and a JSON file (``--json``, default
out/bench/process.json) with every raw time, each run's command, its own account of its steps (ours:
metrics.jsonl's ``elapsed_s`` at the last step; TRL: ``train_runtime`` and its per-step ``step_time``) and the
files it wrote.

``--dtype auto`` (the default) measures float32, and bfloat16 as well where ``has_bf16_units`` says the machine has
bf16 matrix units (a CUDA GPU, or a CPU listing ``amx_bf16`` or ``avx512_bf16``): ours ``--dtype bfloat16``, TRL
``bf16=True``.

Run (on a quiet machine: every figure is a difference of two wall-clock times):
    pip install -r requirements-bench.txt      # TRL (benchmark only)
    python scripts/bench/bench_process.py            # default + minimind3 sizes, 64 tokens, steps 2 and 10, 3 repeats
                                               # (about 65 minutes on a 2-core AMD EPYC with bf16 units: the
                                               # default size took 13 minutes for 3 repeats, the MiniMind-3
                                               # size 34 minutes for 2)
    python scripts/bench/bench_process.py --tiny     # under a minute: a 2-layer model, 8 tokens, steps 1 and 2, one run
                                               # of each, float32 (what the test runs; its figures are noise)
    python scripts/bench/bench_process.py --sizes default --dtype float32 --short_steps 1 --long_steps 2 --repeats 1
"""

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CONTESTANTS = ("ours", "trl")
NUM_PROMPTS = 2  # scripts/bench/bench.py's NUM_PROMPTS and NUM_GENERATIONS (checked in main)
NUM_GENERATIONS = 6
TRL_LEARNING_RATE = 5e-5  # scripts/bench/bench.py's trl_grpo
RESULT_PREFIX = "TRL_WORKER_RESULT "


# ----------------------------------------------------------------------------- the machine
def cpu_flags():
    """The CPU's flags from /proc/cpuinfo (an empty set where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def machine_info(device):
    """What the figures were measured on: CPU model, cores, torch / transformers / TRL versions, AMX and
    AVX512-BF16 flags, whether ``has_bf16_units(device)``, and the GPU's name on a CUDA device."""
    import importlib.metadata

    import torch
    import transformers

    from scripts.bench.bench import cpu_model, has_bf16_units

    flags = cpu_flags()
    try:
        trl_version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        trl_version = None
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl_version,
        "torch_threads": torch.get_num_threads(),
        "amx": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "bf16_units": has_bf16_units(device),
        "device": device,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def describe_machine(info):
    """One line naming the machine of ``machine_info``."""
    yes = {True: "yes", False: "no"}
    text = (
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, transformers "
        f"{info['transformers']}, TRL {info['trl'] or 'not installed'}; AMX {yes[info['amx']]}, AVX512-BF16 "
        f"{yes[info['avx512_bf16']]} (bf16 units for {info['device']}: {yes[info['bf16_units']]}); torch threads "
        f"{info['torch_threads']}"
    )
    return text + (f"; GPU {info['gpu']}" if "gpu" in info else "")


# ----------------------------------------------------------------------------- one timed run
def ours_command(workload, steps, data_path, save_dir, run_dir):
    """The command line of our contestant: ``train_grpo.py`` on ``workload`` for ``steps`` steps with full-length
    answers (``scripts/bench/full_length.py``) and the flags ``scripts/bench/bench.py`` gives its ``ours_grpo``
    (``ours_argv``)."""
    from scripts.bench.bench import ours_argv

    return [
        sys.executable,
        os.path.join(ROOT, "scripts", "bench", "full_length.py"),
        "grpo",
        *ours_argv(workload, "grpo", steps, data_path, save_dir, run_dir),
    ]


def trl_spec(workload, steps, output_dir):
    """The TRL worker's spec (written to SPEC.json) for ``workload`` and ``steps`` steps."""
    return {
        "qwen3_folder": workload["qwen3_folder"],
        "prompts": workload["prompts"],
        "answers": workload["answers"],
        "gen_len": workload["gen_len"],
        "dtype": workload["dtype"],
        "device": workload["device"],
        "steps": steps,
        "output_dir": output_dir,
    }


def files_under(folder):
    """{relative path: bytes} of every file under ``folder`` ({} when it does not exist)."""
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            found[os.path.relpath(path, folder)] = os.path.getsize(path)
    return found


def read_own_account(contestant, run_root, log_path):
    """What a run itself says its steps took: ours, metrics.jsonl's ``elapsed_s`` at the last step (seconds from
    the start of its loop); TRL, ``train_runtime`` of ``train()`` and the per-step ``step_time`` of its log.
    {} when the run left no such record."""
    if contestant == "ours":
        path = os.path.join(run_root, "run", "metrics.jsonl")
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        elapsed = [row["elapsed_s"] for row in rows if "elapsed_s" in row]
        return {"elapsed_s": elapsed[-1], "steps_logged": len(elapsed)} if elapsed else {}
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else {}


def timed_run(contestant, workload, steps, work_dir, name, timeout):
    """Run one contestant for ``steps`` steps in a subprocess; return its record.

    The wall time is ``time.perf_counter()`` around the subprocess, from its start to its exit. Its output goes to
    ``{work_dir}/{name}.log``. Afterwards the files it wrote (``--save_dir`` / ``output_dir``) are listed and
    deleted (a checkpoint of the MiniMind-3 size is about 1 GB), its metrics.jsonl is kept.
    Returns {"contestant", "steps", "command", "wall_s", "returncode", "own", "files_written", "log"} and
    "error" (the end of the log) when the run failed.
    """
    run_root = os.path.join(work_dir, name)
    os.makedirs(run_root, exist_ok=True)
    log_path = os.path.join(work_dir, f"{name}.log")
    if contestant == "ours":
        command = ours_command(
            workload, steps, workload["data_path"], os.path.join(run_root, "save"), os.path.join(run_root, "run")
        )
        written = os.path.join(run_root, "save")
    else:
        spec_path = os.path.join(work_dir, f"{name}.spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(trl_spec(workload, steps, os.path.join(run_root, "output")), f)
        command = [sys.executable, os.path.abspath(__file__), "--trl_worker", spec_path]
        written = os.path.join(run_root, "output")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
    with open(log_path, "w", encoding="utf-8") as log:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            returncode = None
        wall = time.perf_counter() - start
    record = {
        "contestant": contestant,
        "steps": steps,
        "command": shlex.join(command),
        "wall_s": wall,
        "returncode": returncode,
        "own": read_own_account(contestant, run_root, log_path),
        "files_written": files_under(written),
        "log": log_path,
    }
    shutil.rmtree(written, ignore_errors=True)
    if returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-2000:]
        record["error"] = f"timed out after {timeout} s" if returncode is None else f"exit {returncode}: {tail}"
    return record


# ----------------------------------------------------------------------------- the TRL contestant (worker mode)
def trl_worker(spec_path):
    """Train TRL's ``GRPOTrainer`` for spec["steps"] steps on the spec's weights and prompts (a contestant's whole
    process), then print one ``TRL_WORKER_RESULT {json}`` line: ``train_runtime``, ``global_step`` and the
    per-step ``step_time`` of TRL's log."""
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trainer.trainer_utils import calculate_rewards

    def reward_func(prompts, completions, answer, **kwargs):
        return calculate_rewards(prompts, completions, answer, None, 2.0)["rewards"].tolist()

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    steps, rows = spec["steps"], NUM_PROMPTS * NUM_GENERATIONS
    dataset = Dataset.from_dict({"prompt": spec["prompts"] * steps, "answer": spec["answers"] * steps})
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=spec["gen_len"],
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.1,
        loss_type="cispo",
        epsilon_high=5.0,
        learning_rate=TRL_LEARNING_RATE,
        max_grad_norm=1.0,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        use_cpu=spec["device"] == "cpu",
        bf16=spec["dtype"] == "bfloat16",
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,  # each step: the two prompts once each, as ours
        generation_kwargs={"min_new_tokens": spec["gen_len"]},  # EOS never sampled: full-length work
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(
        model=spec["qwen3_folder"],
        reward_funcs=reward_func,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    output = trainer.train()
    step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    print(
        RESULT_PREFIX
        + json.dumps(
            {
                "train_runtime": output.metrics["train_runtime"],
                "global_step": trainer.state.global_step,
                "step_time": step_times,
            }
        ),
        flush=True,
    )


# ----------------------------------------------------------------------------- figures
def per_step_time(runs, contestant, short_steps, long_steps):
    """(T_long - T_short) / (long_steps - short_steps) of ``contestant``'s runs, each T the fastest run of that
    step count; None when a run failed or is missing."""
    own = [r for r in runs if r["contestant"] == contestant]
    if any(r.get("error") for r in own):
        return None
    times = {}
    for steps in (short_steps, long_steps):
        walls = [r["wall_s"] for r in own if r["steps"] == steps]
        if not walls:
            return None
        times[steps] = min(walls)
    return (times[long_steps] - times[short_steps]) / (long_steps - short_steps)


def spread(values):
    """{"median", "min", "max", "values"} of the values that are not None (None figures when there are none)."""
    kept = [v for v in values if v is not None]
    if not kept:
        return {"median": None, "min": None, "max": None, "values": values}
    return {"median": statistics.median(kept), "min": min(kept), "max": max(kept), "values": values}


def divide(a, b):
    """a / b, or None when either is missing or not positive (a per-step time <= 0 is noise, not a speed)."""
    return a / b if a is not None and b is not None and a > 0 and b > 0 else None


def summarize_workload(repeats):
    """Median and min-max over the repeats: each contestant's per-step time, the ratio ours / TRL (repeat by
    repeat), the in-process step and command / in-process (repeat by repeat)."""
    return {
        "ours_s_per_step": spread([r["per_step_s"].get("ours") for r in repeats]),
        "trl_s_per_step": spread([r["per_step_s"].get("trl") for r in repeats]),
        "ratio_ours_trl": spread([r["ratio_ours_trl"] for r in repeats]),
        "bench_step_s": spread([r["bench"].get("step_s_median") for r in repeats]),
        "command_over_in_process": spread([r["command_over_in_process"] for r in repeats]),
    }


def format_spread(figure, digits, missing="-"):
    """'median [min-max]' (just the median when they are equal), or ``missing``."""
    if figure["median"] is None:
        return missing
    median = f"{figure['median']:.{digits}f}"
    if figure["min"] == figure["max"]:
        return median
    return f"{median} [{figure['min']:.{digits}f}-{figure['max']:.{digits}f}]"


def format_table(workloads, machine, args):
    """The markdown table of the run: one row per size and dtype."""
    lines = [
        describe_machine(machine),
        "",
        f"{args.gen_len} tokens x {NUM_PROMPTS} prompts x {NUM_GENERATIONS} answers, EOS ignored; per step = "
        f"(T{args.long_steps} - T{args.short_steps}) / {args.long_steps - args.short_steps}, each T the faster "
        f"of {args.runs} whole-process runs; median [min-max] over {args.repeats} repeats; in-process step: "
        "scripts/bench/bench.py's ours_grpo (the loop's own clock); "
        "command / in-process = ours per step / that step",
        "",
        "| size | dtype | ours s/step | TRL s/step | ours/TRL | in-process step s | command / in-process |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in workloads:
        s = w["summary"]
        trl = w.get("trl_skipped") or "failed"
        lines.append(
            f"| {w['size']} (h{w['hidden_size']} x{w['num_hidden_layers']}) | {w['dtype']} | "
            f"{format_spread(s['ours_s_per_step'], 3, 'failed')} | "
            f"{format_spread(s['trl_s_per_step'], 3, trl)} | "
            f"{format_spread(s['ratio_ours_trl'], 2)} | {format_spread(s['bench_step_s'], 3)} | "
            f"{format_spread(s['command_over_in_process'], 2)} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the run
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Whole-process GRPO speed: train_grpo.py against TRL's GRPOTrainer")
    parser.add_argument("--sizes", default="default,minimind3", help="comma list of scripts/bench/bench.py's sizes")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16"],
        help="auto (the default; float32 with --tiny): float32, and bfloat16 too where the machine "
        "has bf16 units (has_bf16_units)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both contestants run")
    parser.add_argument("--gen_len", type=int, default=64, help="generated tokens per answer (EOS ignored)")
    parser.add_argument("--short_steps", type=int, default=2, help="steps of the short run")
    parser.add_argument("--long_steps", type=int, default=10, help="steps of the long run")
    parser.add_argument("--runs", type=int, default=2, help="runs of each step count per repeat; the fastest counts")
    parser.add_argument("--repeats", type=int, default=3, help="the whole measurement, this many times")
    parser.add_argument("--contestants", default=",".join(CONTESTANTS), help=f"comma list of {', '.join(CONTESTANTS)}")
    parser.add_argument(
        "--bench_steps",
        type=int,
        default=3,
        help="timed steps of scripts/bench/bench.py's ours_grpo per repeat (0: no in-process figure)",
    )
    parser.add_argument("--bench_warmup", type=int, default=1, help="untimed steps of it first")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--json", default=os.path.join(ROOT, "out", "bench", "process.json"))
    parser.add_argument(
        "--work_dir",
        default="",
        help="keep every run's log, metrics.jsonl and the prepared weights here (default: a temporary "
        "folder, removed at the end)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a 2-layer hidden-64 model, 8 tokens, steps 1 and 2, one run of each, 1 repeat, "
        "1 bench step, float32 unless --dtype says otherwise",
    )
    parser.add_argument(
        "--trl_worker", default="", metavar="SPEC.json", help="internal: run the TRL contestant described by SPEC.json"
    )
    args = parser.parse_args(argv)
    if args.trl_worker:
        return args
    if args.tiny:
        args.sizes, args.gen_len, args.short_steps, args.long_steps = "tiny", 8, 1, 2
        args.runs, args.repeats, args.bench_steps = 1, 1, 1
    args.dtype = args.dtype or ("float32" if args.tiny else "auto")
    from scripts.bench.bench import SIZES

    for size in args.sizes.split(","):
        if size not in SIZES:
            parser.error(f"--sizes: unknown size {size!r}; valid: {', '.join(SIZES)}")
    for name in args.contestants.split(","):
        if name not in CONTESTANTS:
            parser.error(f"--contestants: unknown contestant {name!r}; valid: {', '.join(CONTESTANTS)}")
    if not 1 <= args.short_steps < args.long_steps:
        parser.error(f"need 1 <= --short_steps < --long_steps, got {args.short_steps} and {args.long_steps}")
    if args.gen_len < 2 or args.runs < 1 or args.repeats < 1 or args.bench_steps < 0 or args.bench_warmup < 0:
        parser.error("--gen_len must be >= 2, --runs and --repeats >= 1, --bench_steps and --bench_warmup >= 0")
    return args


def bench_step(workload, args, peaks, work_dir, name):
    """``scripts/bench/bench.py``'s ``ours_grpo`` worker on ``workload`` (its result dict: step_s_median, phases_s, ...;
    its metrics.jsonl stays in ``{work_dir}/{name}/run``), or {} with ``--bench_steps 0``."""
    if not args.bench_steps:
        return {}
    import torch

    from scripts.bench import bench

    spec = dict(
        contestant="ours_grpo",
        hidden_size=workload["hidden_size"],
        num_hidden_layers=workload["num_hidden_layers"],
        pth=workload["pth"],
        qwen3_folder=workload["qwen3_folder"],
        gen_len=workload["gen_len"],
        prompts=workload["prompts"],
        answers=workload["answers"],
        data_path=workload["data_path"],
        prompt_len=workload["prompt_len"],
        steps=args.bench_steps,
        warmup=args.bench_warmup,
        dtype=workload["dtype"],
        threads=torch.get_num_threads(),
        peaks=peaks,
        device=workload["device"],
        phases=True,
        tmp_dir=os.path.join(work_dir, name),
        trl_ppo_path="",
        ours_flags=[],
        natural_eos=False,
    )
    return bench.run_worker(spec, args.timeout)


def measure(workloads, args, peaks, work_dir, contestants):
    """Every workload's repeats: the timed runs in turn, the per-step times, the bench step and the ratios."""
    for w in workloads:
        tag = f"{w['size']}_{w['dtype']}"
        for repeat in range(args.repeats):
            runs = []
            for run in range(args.runs):
                for steps in (args.short_steps, args.long_steps):
                    for contestant in contestants:  # in turn: ours, TRL, ours, TRL, ...
                        name = f"{tag}_r{repeat + 1}_{contestant}_{steps}steps_run{run + 1}"
                        record = timed_run(contestant, w, steps, work_dir, name, args.timeout)
                        record["run"] = run + 1
                        runs.append(record)
                        print(
                            f"{tag} repeat {repeat + 1} | {contestant} {steps} steps, run {run + 1}: "
                            f"{record['wall_s']:.2f} s"
                            + (f" FAILED ({record['error'][-300:]})" if record.get("error") else ""),
                            flush=True,
                        )
            per_step = {c: per_step_time(runs, c, args.short_steps, args.long_steps) for c in contestants}
            bench_result = bench_step(w, args, peaks, work_dir, f"{tag}_r{repeat + 1}_bench")
            if bench_result:
                print(
                    f"{tag} repeat {repeat + 1} | in-process step: "
                    + (
                        f"{bench_result['step_s_median']:.3f} s"
                        if "step_s_median" in bench_result
                        else str(bench_result)
                    ),
                    flush=True,
                )
            w["repeats"].append(
                {
                    "repeat": repeat + 1,
                    "runs": runs,
                    "per_step_s": per_step,
                    "bench": bench_result,
                    "ratio_ours_trl": divide(per_step.get("ours"), per_step.get("trl")),
                    "command_over_in_process": divide(per_step.get("ours"), bench_result.get("step_s_median")),
                }
            )
        w["summary"] = summarize_workload(w["repeats"])


def main(argv=None):
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return
    import torch
    from transformers import AutoTokenizer

    from scripts.bench import bench
    from trainer.infra.files import atomic_write

    assert (bench.NUM_PROMPTS, bench.NUM_GENERATIONS) == (NUM_PROMPTS, NUM_GENERATIONS)
    machine = machine_info(args.device)
    print(describe_machine(machine), flush=True)
    contestants = args.contestants.split(",")
    trl_skipped = bench.contestant_available("trl_grpo", "") if "trl" in contestants else "not run"
    if trl_skipped and "trl" in contestants:
        print(f"TRL: {trl_skipped}", flush=True)
        trl_skipped = "not installed"
        contestants.remove("trl")
    dtypes = [args.dtype] if args.dtype != "auto" else ["float32"] + ["bfloat16"] * bench.has_bf16_units(args.device)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    peaks = {
        "float32": bench.measure_matmul_peak(torch.float32, device=args.device),
        "bfloat16": bench.measure_matmul_peak(torch.bfloat16, 512, 1, device=args.device),
    }
    with tempfile.TemporaryDirectory() as temporary:
        work_dir = os.path.abspath(args.work_dir or temporary)
        os.makedirs(work_dir, exist_ok=True)
        data_path = os.path.join(work_dir, "prompts.jsonl")
        chat_prompts, answers = bench.bench_prompts(tokenizer, os.path.join(ROOT, "dataset", "rlaif_train.jsonl"))
        bench.write_prompt_file(data_path, chat_prompts, answers)
        prompts, loaded_answers = bench.loader_prompts(data_path, tokenizer)
        assert loaded_answers == answers and all(p.startswith(c) for p, c in zip(prompts, chat_prompts))
        prompt_len = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
        print(f"prompts of {prompt_len} tokens (as the data loader renders them), {', '.join(dtypes)}", flush=True)
        workloads = []
        for size in args.sizes.split(","):
            pth, folder = bench.prepare_weights(size, work_dir, tokenizer)  # and the tokenizer record
            hidden, layers, source = bench.SIZES[size]
            for dtype in dtypes:
                workloads.append(
                    dict(
                        size=size,
                        hidden_size=hidden,
                        num_hidden_layers=layers,
                        weights=source,
                        dtype=dtype,
                        device=args.device,
                        gen_len=args.gen_len,
                        pth=pth,
                        qwen3_folder=folder,
                        data_path=data_path,
                        prompts=prompts,
                        answers=answers,
                        prompt_len=prompt_len,
                        trl_skipped=trl_skipped,
                        repeats=[],
                    )
                )
        measure(workloads, args, peaks, work_dir, contestants)
    table = format_table(workloads, machine, args)
    print(table)
    for w in workloads:  # the prompts once, at the top
        del w["prompts"], w["answers"]
    report = {
        "machine": machine,
        "args": {k: v for k, v in vars(args).items() if k != "trl_worker"},
        "num_prompts": NUM_PROMPTS,
        "num_generations": NUM_GENERATIONS,
        "prompt_tokens": prompt_len,
        "prompts": prompts,
        "answers": answers,
        "matmul_peak_gflops": peaks,
        "workloads": workloads,
        "table": table,
    }
    atomic_write({args.json: lambda tmp: bench.write_json(report, tmp)})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
