"""Speed benchmark: our GRPO and PPO steps against TRL's trainers, our rollout against transformers' generate.

Every contestant runs in its own subprocess (a "worker") on the same weights, the same prompts and the same
settings, so that peak resident memory is its own and one contestant's caches do not help another.

Our step contestants run the training scripts as they are: ``ours_grpo`` calls ``trainer.train_grpo.main(argv)``
and ``ours_ppo`` ``trainer.train_ppo.main(argv)`` in the worker, for ``--warmup`` + ``--steps`` steps, with flags
for this workload (``ours_argv``: the prompt file below, ``--eval_interval 0``, a log line every step, checkpoints
only at the end), with full-length answers (``scripts/bench/full_length.py``: ``generate`` gets an EOS id no token has).
Nothing else of the training modules is replaced or copied: the bench passes the arguments ``main`` takes (``argv``
and ``reward_fn``) and reads what the run writes. A step's time is the
difference of consecutive ``elapsed_s`` values in the run's metrics.jsonl (the loop's own clock; step 1 counts
from the start of the loop); the final save comes after the last value and is not in any step. TRL's contestants
are ``trl.GRPOTrainer.train`` on the same weights exported as ``Qwen3ForCausalLM``, and TRL 1.9.2's
``PPOTrainer`` (the last release that has one) against our PPO step; their step time is the time between
consecutive ``on_step_end`` callbacks (the first from ``on_train_begin``). TRL is a benchmark-only dependency
(``requirements-bench.txt``; TRL 1.9.2 goes into its own folder, ``.bench/trl-1.9.2``, see below); without it the
TRL rows say "not installed" and everything else runs. The rollout contestants call ``TorchRolloutEngine.rollout``
and transformers' ``generate`` from the bench.

Phases (``PhaseTracer``, both sides alike): ``sys.settrace`` on the worker's thread sees the entry and the return
of chosen functions, found by their code objects, and adds the wall time in between to the function's phase:

    rollout            ours: TorchRolloutEngine.rollout; TRL GRPO: GRPOTrainer._generate; TRL PPO: batch_generation
    reward             the reward function the bench passes in (``calculate_rewards``; TRL PPO: a reward model, in
                       "other")
    reference_forward  ours GRPO: group_policy_forward, PPO: compute_per_token_logps; TRL GRPO:
    policy_forward       _get_per_token_logps_and_entropies -- the policy's when grad is on and the model has
                       trainable weights, else the reference's (``forward_phase``); TRL PPO: its forwards (the
                       policy and value models in one wrapper) are in "other"
    policy_backward    torch.Tensor.backward (PPO: the actor's and the critic's loss together)
    optimizer          torch's clip_grad_norm_, Adam(W).step, Optimizer.zero_grad, Module.zero_grad,
                       LRScheduler.step; ours also project_scale_only_gradients
    other              the step time minus the phases: loss, advantages, metrics and the log line, the data loader;
                       PPO: the critic's forwards and GAE

A watched call made inside another counts for the outer one only. The trace function runs at every Python call of
the worker's thread; ``--phases 0`` leaves it out (step times only), and ``cpu_s_median`` (the main thread's CPU
seconds per step, between consecutive calls of the bench's reward function, TRL PPO between step ends) compares
the two: docs/performance.md gives the measured cost.

The prompts: ``bench_prompts`` (two user turns of the bundled questions, at most 48 tokens with the chat header)
written as RLAIF JSONL (``write_prompt_file``) that our scripts read with ``--thinking_ratio 1``; every other
contestant gets the strings their data loader renders from it (``loader_prompts``), so all see the same text.

Workloads: the embedded default model (hidden 256, 4 layers, its SFT weights) and a MiniMind-3-sized model
(hidden 768, 8 layers, random weights); 2 prompts x 6 generations, 64 and 256 generated tokens with EOS ignored
(every contestant does full-length work), beta 0.1, CISPO (epsilon_high 5), temperature 1, no top-k / top-p, one
optimizer step per rollout, no gradient checkpointing (TRL's default is on; switched off here), fp32 and, where the
machine has bf16 matrix units (``has_bf16_units``: a CUDA GPU, or a CPU with AMX / AVX512-BF16), bf16 autocast for
both contestants. ``--device cuda`` runs every contestant on the GPU (phase boundaries wait for the GPU's queue).

Figures per contestant: median and spread (min-max) of the step time over ``--steps`` steps after ``--warmup``
steps, the phases (medians over the steps); rollout tokens/s; peak resident memory (ru_maxrss of the worker, its
whole life); model FLOPs utilisation against the fp32 and bf16 matrix-multiply peaks measured at the start of the
same run. "Model FLOPs" count the work every GRPO implementation must do (generation, one reference forward, one
policy forward + backward: 2 + 2 + 6 FLOPs per weight per token, plus attention), the same numerator for every
contestant, so MFU ratios are inverse time ratios.

``--contestants sglang_engine`` adds the rollout of ``SGLangRolloutEngine`` against a real SGLang server on the
CPU (float32): for each run a server is launched on the workload's weights by scripts/launch_sglang.sh (the venv of
scripts/setup_sglang_env.sh, or ``--sglang_python``) and stopped after it, so no engine shares the machine with
another. The engine gets the bench's ``requests`` session (its ``session`` argument, ``FullLengthSession``), which
asks the server for full-length answers (``ignore_eos``) and times each ``/generate`` request: the "server" phase;
the rest of its rollout is the engine's local recomputation of the old log-probs (``--sglang_logprobs recompute``).

Run:
    pip install -r requirements-bench.txt      # TRL (benchmark only)
    pip install --no-deps --target .bench/trl-1.9.2 trl==1.9.2   # for trl_ppo only
    python scripts/bench/bench.py                    # both sizes, 64 and 256 tokens; table + out/bench/bench.json
    python scripts/bench/bench.py --tiny             # minutes: a 2-layer model, 8 tokens (what the test runs)
    python scripts/bench/bench.py --sizes default --lengths 64 --repeats 3 --threads 1   # docs/performance.md
    python scripts/bench/bench.py --device cuda --dtype bfloat16 --lengths 64   # on a GPU (scripts/check_gpu.py)
    python scripts/bench/bench.py --contestants sglang_engine,ours_rollout,hf_generate --sizes default --lengths 64 \\
        --dtype float32 --repeats 3 --json out/bench/bench_sglang.json   # the SGLang rollout (docs/performance.md)
"""

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import requests
import torch

from scripts.bench.full_length import full_length_answers
from scripts.sglang_cpu.server import launch_cpu_server, stop_server
from trainer.infra.files import atomic_write

SIZES = {  # name -> (hidden_size, num_hidden_layers, starting weights)
    "default": (256, 4, os.path.join(ROOT, "out", "full_sft_256.pth")),
    "minimind3": (768, 8, "random"),
    "tiny": (64, 2, "random"),
}
CONTESTANTS = ("ours_grpo", "trl_grpo", "ours_rollout", "hf_generate", "ours_ppo", "trl_ppo")
SGLANG_CONTESTANT = "sglang_engine"  # asked for by name only: it needs the SGLang server venv (docs/sglang.md)
TRL_PPO_VERSION = "1.9.2"  # the last TRL release with PPOTrainer (trl.experimental.ppo; removed in TRL PR #7020)
DEFAULT_TRL_PPO_PATH = os.path.join(ROOT, ".bench", f"trl-{TRL_PPO_VERSION}")
PHASES = ("rollout", "reward", "reference_forward", "policy_forward", "policy_backward", "optimizer")
PROMPT_TOKENS = 48
NUM_PROMPTS = 2
NUM_GENERATIONS = 6
SEED = 42  # our scripts' --seed (their default)
TRL_LEARNING_RATE = 5e-5  # TRL's GRPO learning rate in every benchmark here


# ----------------------------------------------------------------------------- the machine
def has_bf16_units(device):
    """True where bf16 matrix products run on dedicated units: a CUDA GPU that supports bf16, or a CPU whose
    flags (/proc/cpuinfo) list amx_bf16 or avx512_bf16. Elsewhere bf16 is emulated and slower than fp32, so
    ``--dtype auto`` measures fp32 only."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_model():
    """The CPU's model name from /proc/cpuinfo, else ``platform.processor()``, else "unknown CPU"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    if not name:
        import platform

        name = platform.processor()
    return name or "unknown CPU"


# ----------------------------------------------------------------------------- measuring
def synchronize(device):
    """Wait for the device's queued work (CUDA runs asynchronously; a clock read without it times the launch)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def forward_phase(frame):
    """The phase of a log-prob forward, from its frame at the entry: the policy's when gradients are on and the
    ``model`` argument has trainable weights, else the reference's (a frozen model, or a forward without grad)."""
    model = frame.f_locals.get("model")
    weight = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    trainable = weight is not None and weight.requires_grad
    return "policy_forward" if torch.is_grad_enabled() and trainable else "reference_forward"


class PhaseTracer:
    """Wall-clock seconds per named phase of each step, from the entry and the return of chosen functions.

    ``watch(function, phase)``: every call of ``function`` adds its duration to ``phase`` (a name, or a function
    of the call's frame, called at the entry, that returns one: ``forward_phase``). The calls are found by the code
    object of ``inspect.unwrap(function)`` (through decorators such as ``torch.no_grad()``) with ``sys.settrace``
    inside ``tracing()``: the function is not replaced, so the module that defines it runs as it is. A watched call
    made while another runs counts for the outer one only. ``at_entry(function, callback)`` calls ``callback()`` at
    every entry of ``function`` (the end of a step). ``phase(name)`` times a block of the bench's own code, and
    ``end_step()`` closes a step: its phases (a dict name -> seconds), the main thread's CPU seconds marked since
    (``mark_cpu``) and the number of Python calls the trace function saw go to ``steps``, ``cpu_marks`` and
    ``calls_per_step``. On CUDA every boundary waits for the device's queue (``synchronize``).
    """

    def __init__(self, device="cpu"):
        self.device = device
        self.watched = {}  # code object -> ("phase", name or function) or ("entry", callback)
        self.current, self.steps, self.cpu_marks, self.calls_per_step = {}, [], [], []
        self.active = None  # (frame, phase name, start) of the watched call running, or None
        self.calls = 0

    def watch(self, function, phase):
        self.watched[inspect.unwrap(function).__code__] = ("phase", phase)

    def at_entry(self, function, callback):
        self.watched[inspect.unwrap(function).__code__] = ("entry", callback)

    def add(self, name, seconds):
        self.current[name] = self.current.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, name):
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.add(name, time.perf_counter() - start)

    def mark_cpu(self):
        """Record the main thread's CPU time (seconds) now."""
        self.cpu_marks.append(time.thread_time())

    def end_step(self):
        self.steps.append(self.current)
        self.calls_per_step.append(self.calls)
        self.current, self.calls = {}, 0

    @contextlib.contextmanager
    def tracing(self, enabled=True):
        """Trace the watched functions in this block (``enabled`` False: run it untraced)."""
        if not enabled:
            yield
            return
        previous = sys.gettrace()
        sys.settrace(self.trace_call)
        try:
            yield
        finally:
            sys.settrace(previous)

    def trace_call(self, frame, event, arg):
        """sys.settrace's function, called at every Python call: starts the phase of a watched function."""
        self.calls += 1
        entry = self.watched.get(frame.f_code)
        if entry is None:
            return None
        kind, value = entry
        if kind == "entry":
            value()
            return None
        if self.active is not None:
            return None
        frame.f_trace_lines = False
        synchronize(self.device)
        self.active = (frame, value(frame) if callable(value) else value, time.perf_counter())
        return self.trace_return

    def trace_return(self, frame, event, arg):
        """The local trace function of a watched call: its return (or exit by an exception) ends the phase."""
        if event == "return" and self.active is not None and self.active[0] is frame:
            synchronize(self.device)
            _, name, start = self.active
            self.add(name, time.perf_counter() - start)
            self.active = None
        return self.trace_return


def watch_update(tracer):
    """The backward and the optimizer of both sides: torch's own functions, which ours and TRL's loops both call."""
    tracer.watch(torch.Tensor.backward, "policy_backward")
    for function in (
        torch.nn.utils.clip_grad_norm_,
        torch.optim.AdamW.step,
        torch.optim.Optimizer.zero_grad,
        torch.nn.Module.zero_grad,
        torch.optim.lr_scheduler.LRScheduler.step,
    ):
        tracer.watch(function, "optimizer")


def time_steps(step, spec, tracer):
    """Call ``step()`` (the bench's own function) spec["warmup"] + spec["steps"] times, each as a step of
    ``tracer``; return (phases, wall seconds, main-thread CPU seconds) of the timed calls."""
    totals, cpu = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        synchronize(spec["device"])
        start, cpu_start = time.perf_counter(), time.thread_time()
        step()
        synchronize(spec["device"])
        totals.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - cpu_start)
        tracer.end_step()
    return tracer.steps[spec["warmup"] :], totals[spec["warmup"] :], cpu[spec["warmup"] :]


def measure_matmul_peak(dtype, size=2048, repeats=3, device="cpu"):
    """GFLOP/s of a [size x size] @ [size x size] product in ``dtype`` (best of ``repeats``) on ``device``."""
    a = torch.randn(size, size).to(device=device, dtype=dtype)
    b = torch.randn(size, size).to(device=device, dtype=dtype)
    a @ b  # warm-up
    synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def forward_flops(config, tokens, context, logit_positions):
    """FLOPs of one forward: 2 per weight per token for the blocks, 2 * V * H per logit position, and the
    attention products (QK^T and AV: 4 * heads * head_dim * context per token and layer)."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    block_weights = hidden * q_dim * 2 + hidden * kv_dim * 2 + 3 * hidden * inter  # q, o, k, v, gate/up/down
    attention = 4 * q_dim * context * layers
    return tokens * (2 * block_weights * layers + attention) + logit_positions * 2 * config.vocab_size * hidden


def grpo_model_flops(config, num_rows, prompt_len, gen_len):
    """Model FLOPs of one GRPO step: generation + one reference forward + policy forward and backward (x3)."""
    full = prompt_len + gen_len
    generation = forward_flops(config, num_rows * prompt_len, prompt_len / 2, num_rows)
    generation += forward_flops(config, num_rows * (gen_len - 1), prompt_len + gen_len / 2, num_rows * (gen_len - 1))
    scoring = forward_flops(config, num_rows * full, full / 2, num_rows * gen_len)
    return generation + scoring + 3 * scoring


# ----------------------------------------------------------------------------- shared set-up
def bench_prompts(tokenizer, data_path):
    """NUM_PROMPTS chat prompts of about PROMPT_TOKENS tokens each, built from the bundled prompts.

    Each prompt is one user turn holding as many of the data file's questions as fit, then the assistant
    header. Returns (prompts, answers).
    """
    from dataset.lm_dataset import iter_jsonl

    questions = []
    for _, row in iter_jsonl(data_path):
        turns = row["conversations"]
        questions.append((turns[0]["content"], turns[1]["content"] if len(turns) > 1 else ""))
    prompts, answers = [], []
    for i in range(NUM_PROMPTS):
        text, answer = "", ""
        for question, reference in questions[i::NUM_PROMPTS]:
            candidate = (text + " " + question).strip()
            rendered = f"<|im_start|>user\n{candidate}<|im_end|>\n<|im_start|>assistant\n"
            if len(tokenizer(rendered, add_special_tokens=False)["input_ids"]) > PROMPT_TOKENS:
                break
            text, answer = candidate, reference
        prompts.append(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
        answers.append(answer)
    return prompts, answers


def write_prompt_file(path, chat_prompts, answers):
    """Write chat prompts (``bench_prompts``) as RLAIF JSONL (``--data_path``'s format): one row per prompt, its user
    turn and the reference answer as the assistant turn.

    Raises:
        ValueError: if a prompt is not one user turn followed by the assistant header.
    """
    head, tail = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    rows = []
    for prompt, answer in zip(chat_prompts, answers):
        if not (prompt.startswith(head) and prompt.endswith(tail)):
            raise ValueError(f"not one user turn and the assistant header: {prompt!r}")
        user = prompt[len(head) : -len(tail)]
        rows.append({"conversations": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def loader_prompts(path, tokenizer, thinking_ratio=1.0, seed=SEED):
    """(prompts, answers) exactly as our scripts' data loader yields them for ``path`` with ``--thinking_ratio``
    and ``--seed`` (``RLAIFDataset``)."""
    from dataset.lm_dataset import RLAIFDataset

    dataset = RLAIFDataset(path, tokenizer, thinking_ratio=thinking_ratio, seed=seed)
    rows = [dataset[i] for i in range(len(dataset))]
    return [row["prompt"] for row in rows], [row["answer"] for row in rows]


def prepare_weights(size, work_dir, tokenizer):
    """Write the size's weights as a MiniMind state dict (.pth, with the record of the tokenizer that our scripts
    check at start) and a Qwen3ForCausalLM folder; return both paths."""
    from model.hf_qwen3 import save_qwen3_folder
    from model.model_minimind import MiniMindForCausalLM
    from trainer.infra.weights import build_config, load_weights, write_tokenizer_record

    hidden, layers, source = SIZES[size]
    torch.manual_seed(0)
    config = build_config(hidden, layers, 0)
    model = MiniMindForCausalLM(config)
    if source != "random":
        load_weights(model, source)
    pth = os.path.join(work_dir, f"{size}.pth")
    torch.save(model.state_dict(), pth)
    write_tokenizer_record(pth, os.path.join(ROOT, "model"))
    folder = os.path.join(work_dir, f"{size}_qwen3")
    save_qwen3_folder(model.state_dict(), config, folder, tokenizer=tokenizer)
    return pth, folder


def summarize(step_phases, step_totals, step_cpu, calls, tokens_per_rollout, model_flops, peaks, dtype):
    """One worker's figures: median / min / max of the step times (``step_s`` lists them), the median of each
    phase (``phases_s``; None when the run was not traced) with "other" = median step - their sum, the median
    main-thread CPU seconds per step and Python calls per step (None where not measured), tokens/s of the rollout
    phase, and the MFU of the median step against the measured matmul peak of ``dtype`` (the run's --dtype)."""
    median = statistics.median(step_totals)
    phases = None
    if step_phases is not None:
        phases = {name: statistics.median([p.get(name, 0.0) for p in step_phases]) for name in PHASES}
        phases["other"] = max(median - sum(phases.values()), 0.0)
        if any("server" in p for p in step_phases):  # sglang_engine: the /generate request, a part of "rollout"
            phases["server"] = statistics.median([p.get("server", 0.0) for p in step_phases])
    rollout = phases["rollout"] if phases else 0.0
    return {
        "step_s_median": median,
        "step_s_min": min(step_totals),
        "step_s_max": max(step_totals),
        "steps": len(step_totals),
        "step_s": step_totals,
        "phases_s": phases,
        "cpu_s_median": statistics.median(step_cpu) if step_cpu else None,
        "python_calls_per_step": statistics.median(calls) if calls else None,
        "rollout_tokens_per_s": tokens_per_rollout / rollout if rollout > 0 else None,
        "mfu": model_flops / median / (peaks[dtype] * 1e9) if model_flops else None,
    }


def combine_runs(runs):
    """One contestant's figures over ``--repeats`` worker runs (dicts from ``summarize``).

    One run is returned as it is. Over several: the median of the runs' median step times, the min and max of
    those medians (the spread between runs, which a single run's min-max over its steps does not show), the
    median of each phase, of the CPU seconds, the tokens/s and the MFU, the largest peak memory, and every run's
    median in ``run_medians``. A failed or skipped run is returned in place of the figures.
    """
    failed = [run for run in runs if "step_s_median" not in run]
    if failed or len(runs) == 1:
        return (failed or runs)[0]
    medians = [run["step_s_median"] for run in runs]
    combined = dict(
        runs[0],
        step_s_median=statistics.median(medians),
        step_s_min=min(medians),
        step_s_max=max(medians),
        runs=len(runs),
        run_medians=medians,
    )
    if runs[0].get("phases_s"):
        combined["phases_s"] = {
            name: statistics.median(run["phases_s"][name] for run in runs) for name in runs[0]["phases_s"]
        }
    for key in ("rollout_tokens_per_s", "mfu", "cpu_s_median", "python_calls_per_step"):
        values = [run[key] for run in runs if run.get(key)]
        combined[key] = statistics.median(values) if values else None
    for key in ("peak_rss_mib", "peak_gpu_mib"):
        if key in runs[0]:
            combined[key] = max(run[key] for run in runs)
    return combined


# ----------------------------------------------------------------------------- contestants (one per worker)
def without_flag(flags, name):
    """``flags`` (a list of words) without ``name`` and the value that follows it."""
    kept, skip = [], False
    for word in flags:
        if skip or word == name:
            skip = word == name
            continue
        kept.append(word)
    return kept


def ours_argv(workload, script, steps, data_path, save_dir, run_dir, flags=()):
    """The command-line flags of ``trainer/train_{script}.py`` (grpo or ppo) for ``workload`` (a dict with pth,
    hidden_size, num_hidden_layers, gen_len, dtype, device) and ``steps`` steps: rule rewards only
    (``--reward_model_path none``), no evaluation, a log line and a metrics.jsonl row every step, no save before
    the last step, then ``flags`` (``--shared_prefix`` is GRPO's and
    left out of PPO's). GRPO: 2 prompts x 6 answers, beta 0.1, CISPO (epsilon_high 5). PPO: the 12 rows of
    ``data_path`` in one step, one answer each, minibatches of 2, GAE lambda 0.95 (as TRL's PPOConfig below)."""
    common = [
        "--data_path",
        data_path,
        "--thinking_ratio",
        "1",
        "--seed",
        str(SEED),
        "--from_weight",
        workload["pth"],
        "--hidden_size",
        str(workload["hidden_size"]),
        "--num_hidden_layers",
        str(workload["num_hidden_layers"]),
        "--max_steps",
        str(steps),
        "--epochs",
        str(steps),
        "--max_gen_len",
        str(workload["gen_len"]),
        "--max_seq_len",
        "512",
        "--temperature",
        "1.0",
        "--top_k",
        "0",
        "--top_p",
        "1.0",
        "--reward_model_path",
        "none",
        "--dtype",
        workload["dtype"],
        "--device",
        workload["device"],
        "--eval_interval",
        "0",
        "--save_interval",
        str(steps + 1),
        "--log_interval",
        "1",
        "--use_compile",
        "0",
        "--use_wandb",
        "0",
        "--save_dir",
        save_dir,
        "--run_dir",
        run_dir,
    ]
    if script == "grpo":
        return common + [
            "--batch_size",
            str(NUM_PROMPTS),
            "--num_generations",
            str(NUM_GENERATIONS),
            "--beta",
            "0.1",
            "--loss_type",
            "cispo",
            "--epsilon_high",
            "5.0",
            *flags,
        ]
    return common + [
        "--batch_size",
        str(NUM_PROMPTS * NUM_GENERATIONS),
        "--mini_batch_size",
        "2",
        "--lam",
        "0.95",
        *without_flag(list(flags), "--shared_prefix"),
    ]


def load_minimind(spec):
    """(MiniMindForCausalLM with the workload's weights, its config), fp32 on spec["device"]."""
    from model.model_minimind import MiniMindForCausalLM
    from trainer.infra.weights import build_config

    config = build_config(spec["hidden_size"], spec["num_hidden_layers"], 0)
    model = MiniMindForCausalLM(config)
    model.load_state_dict(torch.load(spec["pth"], map_location="cpu", weights_only=True))
    return model.to(spec["device"]), config


def timed_reward(tracer):
    """The reward function the bench passes to a step contestant (``calculate_rewards``'s arguments and result):
    its calls are the "reward" phase, and each call marks the main thread's CPU time (once per step)."""
    from trainer.trainer_utils import calculate_rewards

    def reward_fn(*args, **kwargs):
        tracer.mark_cpu()
        with tracer.phase("reward"):
            return calculate_rewards(*args, **kwargs)

    return reward_fn


def elapsed_seconds(run_dir):
    """The ``elapsed_s`` values of a run's metrics.jsonl, in step order (seconds since the loop started)."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row["elapsed_s"] for row in sorted(rows, key=lambda row: row["step"]) if "elapsed_s" in row]


def run_ours(spec, tracer, script):
    """Our ``trainer/train_{script}.py`` (grpo or ppo): its ``main`` for warmup + steps steps, in this process.

    Step times: consecutive differences of metrics.jsonl's ``elapsed_s``. Phases: the module docstring's
    functions, traced (``PhaseTracer``); a step ends where the loop writes its log line (``StepLog.write``).
    The run's checkpoints (written after the last step) are deleted; its metrics.jsonl stays in spec["tmp_dir"].
    Returns (phases or None, step seconds, CPU seconds per step, Python calls per step, tokens per rollout,
    config) of the timed steps.
    Raises:
        RuntimeError: when the run logged another number of steps.
    """
    from trainer.infra.metrics import StepLog
    from trainer.infra.optimizer import project_scale_only_gradients
    from trainer.rollout_engine import TorchRolloutEngine, compute_per_token_logps
    from trainer.infra.weights import build_config

    module = importlib.import_module(f"trainer.train_{script}")
    watch_update(tracer)
    tracer.watch(project_scale_only_gradients, "optimizer")
    tracer.watch(TorchRolloutEngine.rollout, "rollout")
    tracer.watch(module.group_policy_forward if script == "grpo" else compute_per_token_logps, forward_phase)
    tracer.at_entry(StepLog.write, tracer.end_step)
    steps = spec["warmup"] + spec["steps"]
    save_dir, run_dir = os.path.join(spec["tmp_dir"], "save"), os.path.join(spec["tmp_dir"], "run")
    data_path = spec["data_path"] if script == "grpo" else spec["ppo_data_path"]
    argv = ours_argv(spec, script, steps, data_path, save_dir, run_dir, spec["ours_flags"])
    answers = contextlib.nullcontext() if spec["natural_eos"] else full_length_answers()
    with tracer.tracing(spec["phases"]), answers:
        module.main(argv, reward_fn=timed_reward(tracer))
    shutil.rmtree(save_dir, ignore_errors=True)
    elapsed = elapsed_seconds(run_dir)
    if len(elapsed) != steps:
        raise RuntimeError(f"{run_dir}/metrics.jsonl: {len(elapsed)} steps logged, {steps} run")
    totals = [b - a for a, b in zip([0.0] + elapsed, elapsed)]
    cpu = [b - a for a, b in zip(tracer.cpu_marks, tracer.cpu_marks[1:])]  # step i - 1 ... step i
    phases = tracer.steps[spec["warmup"] :] if spec["phases"] else None
    rows = NUM_PROMPTS * NUM_GENERATIONS
    config = build_config(spec["hidden_size"], spec["num_hidden_layers"], 0)
    return (
        phases,
        totals[spec["warmup"] :],
        cpu[max(spec["warmup"] - 1, 0) :],
        tracer.calls_per_step[spec["warmup"] :] if spec["phases"] else [],
        rows * spec["gen_len"],
        config,
    )


def step_clock(tracer, mark_cpu=False):
    """A transformers ``TrainerCallback`` whose ``totals`` are the wall seconds between consecutive step ends (the
    first from the start of training); each step end closes ``tracer``'s step (and marks the main thread's CPU
    time with ``mark_cpu``)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.totals, self.last = [], None

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(tracer.device)
            now = time.perf_counter()
            self.totals.append(now - self.last)
            self.last = now
            tracer.end_step()
            if mark_cpu:
                tracer.mark_cpu()

    return StepClock()


def run_trl_grpo(spec, tokenizer, tracer):
    """TRL's GRPOTrainer on the exported Qwen3ForCausalLM, same settings, same prompts; phases traced on TRL's
    own functions and torch's (the module docstring)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    reward_fn = timed_reward(tracer)

    def reward_func(prompts, completions, answer, **kwargs):
        return reward_fn(prompts, completions, answer, None, 2.0)["rewards"].tolist()

    watch_update(tracer)
    tracer.watch(GRPOTrainer._generate, "rollout")
    tracer.watch(GRPOTrainer._get_per_token_logps_and_entropies, forward_phase)
    steps = spec["warmup"] + spec["steps"]
    rows = NUM_PROMPTS * NUM_GENERATIONS
    dataset = Dataset.from_dict({"prompt": spec["prompts"] * steps, "answer": spec["answers"] * steps})
    config = GRPOConfig(
        output_dir=spec["tmp_dir"],
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
        generation_kwargs={"min_new_tokens": spec["gen_len"]},  # ignore EOS: full-length work
        model_init_kwargs={"dtype": torch.float32},
    )
    clock = step_clock(tracer)
    trainer = GRPOTrainer(
        model=spec["qwen3_folder"],
        reward_funcs=reward_func,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    with tracer.tracing(spec["phases"]):
        trainer.train()
    warmup = spec["warmup"]
    cpu = [b - a for a, b in zip(tracer.cpu_marks, tracer.cpu_marks[1:])]
    return (
        tracer.steps[warmup:] if spec["phases"] else None,
        clock.totals[warmup:],
        cpu[max(warmup - 1, 0) :],
        tracer.calls_per_step[warmup:] if spec["phases"] else [],
        rows * spec["gen_len"],
        trainer.model.config,
    )


def run_rollouts(spec, tokenizer, tracer, contestant):
    """Rollout alone: our TorchRolloutEngine (with its old log-probs) or transformers' generate, both under the
    workload's dtype (bf16 autocast, as the GRPO step runs its rollout), called by the bench."""
    from trainer.infra.dtypes import autocast_context
    from trainer.rollout_engine import tokenize_prompts

    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, spec["prompts"], 512, spec["device"])
    rows = NUM_PROMPTS * NUM_GENERATIONS
    if contestant == "ours_rollout":
        from trainer.rollout_engine import TorchRolloutEngine

        model, config = load_minimind(spec)
        engine = TorchRolloutEngine(model, tokenizer, generator=torch.Generator(spec["device"]).manual_seed(0))

        def rollout():
            with tracer.phase("rollout"), autocast_context(spec["device"], spec["dtype"]), full_length_answers():
                return engine.rollout(prompt_ids, attention_mask, NUM_GENERATIONS, spec["gen_len"]).completion_ids
    else:
        from transformers import Qwen3ForCausalLM

        model = Qwen3ForCausalLM.from_pretrained(spec["qwen3_folder"], dtype=torch.float32).eval().to(spec["device"])
        config = model.config
        repeated_ids = prompt_ids.repeat_interleave(NUM_GENERATIONS, dim=0)  # [N, P]
        repeated_mask = attention_mask.repeat_interleave(NUM_GENERATIONS, dim=0)  # [N, P]

        def rollout():
            with tracer.phase("rollout"), torch.no_grad(), autocast_context(spec["device"], spec["dtype"]):
                return model.generate(
                    repeated_ids,
                    attention_mask=repeated_mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=spec["gen_len"],
                    min_new_tokens=spec["gen_len"],
                    pad_token_id=tokenizer.pad_token_id,
                )

    phases, totals, cpu = time_steps(rollout, spec, tracer)
    return phases, totals, cpu, [], rows * spec["gen_len"], config


class FullLengthSession(requests.Session):
    """The ``requests`` session the bench gives ``SGLangRolloutEngine`` (its ``session`` argument, passed on to
    ``SGLangClient``): each ``/generate`` request asks for full-length answers (``ignore_eos``, no stop ids), as
    every contestant samples, and its round trip is added to ``tracer``'s "server" phase.

    Raises:
        RuntimeError: when a successful ``/generate`` answer holds an answer shorter than ``max_new_tokens`` (a
            server that did not honour ``ignore_eos``: the work would not be the other contestants').
    """

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def request(self, method, url, json=None, **kwargs):
        if json is None or not url.endswith("/generate"):
            return super().request(method, url, json=json, **kwargs)
        json = dict(json, sampling_params=dict(json["sampling_params"], ignore_eos=True, stop_token_ids=[]))
        with self.tracer.phase("server"):
            response = super().request(method, url, json=json, **kwargs)
        if response.status_code == 200:
            wanted = json["sampling_params"]["max_new_tokens"]
            lengths = [len(answer.get("output_ids", [])) for answer in response.json()]
            if min(lengths, default=wanted) < wanted:
                raise RuntimeError(
                    f"SGLang answered {min(lengths)} tokens for max_new_tokens {wanted} with "
                    "ignore_eos: not full-length work"
                )
        return response


def run_sglang_rollouts(spec, tokenizer, tracer):
    """Rollout alone through ``SGLangRolloutEngine`` against the server at spec["url"] (launched on the
    workload's weights), with ``FullLengthSession``: the /generate request is the "server" phase, the engine's
    local recomputation of the old log-probs the rest."""
    from trainer.rollout_engine import SGLangRolloutEngine, tokenize_prompts

    model, config = load_minimind(spec)
    engine = SGLangRolloutEngine(
        model.eval(), tokenizer, spec["url"], spec["tmp_dir"], session=FullLengthSession(tracer)
    )
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, spec["prompts"], 512, "cpu")

    def rollout():
        with tracer.phase("rollout"):
            return engine.rollout(prompt_ids, attention_mask, NUM_GENERATIONS, spec["gen_len"]).completion_ids

    phases, totals, cpu = time_steps(rollout, spec, tracer)
    return phases, totals, cpu, [], NUM_PROMPTS * NUM_GENERATIONS * spec["gen_len"], config


def run_trl_ppo(spec, tokenizer, tracer):
    """TRL 1.9.2's PPOTrainer with our PPO settings: 12 prompts, 1 answer each, 2 epochs of minibatches of 2.

    TRL needs a reward model and a value model (sequence classifiers): both are the same weights with a new
    scalar head (``Qwen3ForSequenceClassification``), so TRL's reward is one extra forward where ours is the
    rule reward. Generation is forced to full length by giving TRL's PPO module (the contestant's code, not
    ours) a GenerationConfig with min_new_tokens. Phases traced: TRL's ``batch_generation`` (rollout), and
    torch's backward and optimizer functions as for ours; TRL's forwards are in "other".
    """
    sys.path.insert(0, spec["trl_ppo_path"])
    import transformers
    from datasets import Dataset
    from transformers import Qwen3ForCausalLM, Qwen3ForSequenceClassification
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo_module

    rows = NUM_PROMPTS * NUM_GENERATIONS
    steps = spec["warmup"] + spec["steps"]
    tokenizer.padding_side = "left"
    dataset = Dataset.from_dict(
        {"input_ids": [tokenizer(p, add_special_tokens=False)["input_ids"] for p in spec["ppo_prompts"]]}
    )
    folder = spec["qwen3_folder"]
    policy = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref_policy = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reward_model = Qwen3ForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32)
    value_model = Qwen3ForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32)
    for model in (policy, ref_policy, reward_model, value_model):
        model.config.pad_token_id = tokenizer.pad_token_id
    config = PPOConfig(
        output_dir=spec["tmp_dir"],
        per_device_train_batch_size=2,
        gradient_accumulation_steps=rows // 2,
        num_mini_batches=rows // 2,
        num_ppo_epochs=2,
        total_episodes=rows * steps,
        response_length=spec["gen_len"],
        temperature=1.0,
        kl_coef=0.02,
        vf_coef=0.5,
        cliprange=0.2,
        cliprange_value=0.2,
        gamma=1.0,
        lam=0.95,
        learning_rate=1e-5,
        local_rollout_forward_batch_size=rows,
        report_to="none",
        use_cpu=spec["device"] == "cpu",
        bf16=spec["dtype"] == "bfloat16",
        gradient_checkpointing=False,
        num_sample_generations=0,
        save_strategy="no",
        seed=0,
        stop_token=None,
    )
    generation_config_class = trl_ppo_module.GenerationConfig

    def full_length_generation_config(**kwargs):  # ignore EOS: full-length work, as for every contestant
        return generation_config_class(**kwargs, min_new_tokens=kwargs["max_new_tokens"])

    trl_ppo_module.GenerationConfig = full_length_generation_config
    watch_update(tracer)
    tracer.watch(trl_ppo_module.batch_generation, "rollout")
    clock = step_clock(tracer, mark_cpu=True)  # no reward function here to mark the steps
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        train_dataset=dataset,
        value_model=value_model,
        callbacks=[clock],
    )
    with tracer.tracing(spec["phases"]):
        trainer.train()
    transformers.logging.set_verbosity_error()
    warmup = spec["warmup"]
    cpu = [b - a for a, b in zip(tracer.cpu_marks, tracer.cpu_marks[1:])]
    return (
        tracer.steps[warmup:] if spec["phases"] else None,
        clock.totals[warmup:],
        cpu[max(warmup - 1, 0) :],
        tracer.calls_per_step[warmup:] if spec["phases"] else [],
        rows * spec["gen_len"],
        policy.config,
    )


def worker(spec):
    """Run one contestant on one workload; print one JSON line with its figures."""
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    tracer = PhaseTracer(spec["device"])
    contestant = spec["contestant"]
    if contestant in ("ours_grpo", "ours_ppo"):
        figures = run_ours(spec, tracer, contestant[len("ours_") :])
    elif contestant == "trl_grpo":
        figures = run_trl_grpo(spec, tokenizer, tracer)
    elif contestant == "trl_ppo":
        figures = run_trl_ppo(spec, tokenizer, tracer)
    elif contestant == SGLANG_CONTESTANT:
        figures = run_sglang_rollouts(spec, tokenizer, tracer)
    else:
        figures = run_rollouts(spec, tokenizer, tracer, contestant)
    phases, totals, cpu, calls, tokens, config = figures
    rows = NUM_PROMPTS * NUM_GENERATIONS
    flops = grpo_model_flops(config, rows, spec["prompt_len"], spec["gen_len"]) if contestant.endswith("grpo") else 0
    result = summarize(phases, totals, cpu, calls, tokens, flops, spec["peaks"], spec["dtype"])
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if contestant.startswith("ours_") and contestant != "ours_rollout":
        result["run_dir"] = os.path.join(spec["tmp_dir"], "run")
    if torch.device(spec["device"]).type == "cuda":
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated(spec["device"]) / 2**20
    print("BENCH_RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- the run
def contestant_available(name, trl_ppo_path, sglang_python=""):
    """None when the contestant can run here, else the reason it cannot."""
    if name == SGLANG_CONTESTANT:
        python = sglang_python or os.path.join(
            os.environ.get("SGLANG_VENV")
            or os.path.expanduser(os.path.join("~", ".cache", "minimind-rl", "sglang-venv")),
            "bin",
            "python",
        )
        if not os.access(python, os.X_OK):
            return f"no SGLang server python at {python} (bash scripts/setup_sglang_env.sh, or --sglang_python)"
    if name == "trl_grpo" and importlib.util.find_spec("trl") is None:
        return "trl not installed (pip install -r requirements-bench.txt)"
    if name == "trl_ppo" and not os.path.isdir(os.path.join(trl_ppo_path, "trl", "experimental", "ppo")):
        return (
            f"TRL {TRL_PPO_VERSION} not in {trl_ppo_path} (pip install --no-deps --target {trl_ppo_path} "
            f"trl=={TRL_PPO_VERSION})"
        )
    return None


def run_worker(spec, timeout):
    """Start a worker subprocess for ``spec``; return its result dict, or {"error": ...}."""
    device = torch.device(spec["device"])
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
    if device.type == "cuda" and device.index is not None:  # TRL's accelerate takes the first visible GPU
        env["CUDA_VISIBLE_DEVICES"] = str(device.index)
        spec = dict(spec, device="cuda:0")
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in result.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT ") :])
    return {"error": (result.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def format_table(results, peaks):
    """The results as a plain-text table, one row per workload and contestant, with ours/theirs ratios."""
    lines = [
        f"matmul peaks measured in this run: fp32 {peaks['float32']:.1f} GFLOP/s (2048^3), "
        f"bf16 {peaks['bfloat16']:.1f} GFLOP/s (512^3); each row's MFU is against the peak of its dtype; "
        "min-max: over the timed steps of one run, or over the runs' medians with --repeats",
        "",
        "| workload | contestant | step s (median) | min-max | rollout | reward | ref fwd | policy fwd | "
        "policy bwd | optimizer | other | rollout tok/s | peak RSS MiB | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        r = row["result"]
        if "error" in r or "skipped" in r:
            lines.append(
                f"| {row['workload']} | {row['contestant']} | {r.get('error') or r.get('skipped')} |" + " |" * 11
            )
            continue
        p = r["phases_s"]
        tok = f"{r['rollout_tokens_per_s']:.0f}" if r["rollout_tokens_per_s"] else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        lines.append(
            f"| {row['workload']} | {row['contestant']} | {r['step_s_median']:.2f} | "
            f"{r['step_s_min']:.2f}-{r['step_s_max']:.2f} | "
            + " | ".join(f"{p[name]:.2f}" if p else "-" for name in (*PHASES, "other"))
            + f" | {tok} | {r['peak_rss_mib']:.0f} | {mfu} |"
        )
    lines.append("")
    lines.append("| workload | GRPO step ours/TRL | rollout tok/s ours/generate | PPO step ours/TRL |")
    lines.append("|---|---|---|---|")
    for workload in dict.fromkeys(row["workload"] for row in results):
        by_name = {row["contestant"]: row["result"] for row in results if row["workload"] == workload}
        step_ratio = ratio(by_name.get("ours_grpo"), by_name.get("trl_grpo"), "step_s_median")
        tok_ratio = ratio(by_name.get("ours_rollout"), by_name.get("hf_generate"), "rollout_tokens_per_s")
        ppo_ratio = ratio(by_name.get("ours_ppo"), by_name.get("trl_ppo"), "step_s_median")
        lines.append(f"| {workload} | {step_ratio} | {tok_ratio} | {ppo_ratio} |")
    return "\n".join(lines)


def ratio(ours, theirs, key):
    """ours[key] / theirs[key] as text with two decimals, or "-" when either is missing. With ``--repeats`` (both
    carry ``run_medians`` of one length): the ratio run by run (run i of ours against run i of theirs, started
    one after the other), as "median (min-max)", so that a drift of the machine's speed between runs cancels
    in each pair and the spread shows. For rollout_tokens_per_s the pairs are theirs / ours of the run times
    (the rollout contestants' steps are their rollouts, of the same number of tokens)."""
    if not ours or not theirs or not ours.get(key) or not theirs.get(key):
        return "-"
    ours_runs, theirs_runs = ours.get("run_medians", []), theirs.get("run_medians", [])
    if ours_runs and len(ours_runs) == len(theirs_runs):
        pairs = [(b / a if key == "rollout_tokens_per_s" else a / b) for a, b in zip(ours_runs, theirs_runs)]
        return f"{statistics.median(pairs):.2f} ({min(pairs):.2f}-{max(pairs):.2f})"
    return f"{ours[key] / theirs[key]:.2f}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="GRPO step and rollout speed: ours vs TRL and transformers")
    parser.add_argument("--sizes", default="default,minimind3", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--lengths", default="64,256", help="generated tokens per answer (comma list)")
    parser.add_argument("--contestants", default=",".join(CONTESTANTS), help=f"comma list of {', '.join(CONTESTANTS)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contestant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="worker runs of each contestant, in turn; >1 reports the median of the runs' medians and their min-max",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: float32, and bfloat16 too where the machine has bf16 units (has_bf16_units)",
    )
    parser.add_argument("--device", default="cpu", help="where every contestant runs: cpu or cuda[:N]")
    parser.add_argument(
        "--ours_flags",
        default="",
        help='extra flags of our training scripts for our step contestants, e.g. "--shared_prefix 0" '
        "(a lever switched off); TRL's contestants are not affected",
    )
    parser.add_argument(
        "--natural_eos",
        action="store_true",
        help="our GRPO / PPO steps stop each answer at its EOS (ragged rows, as in training) instead "
        "of full length; for comparing our layouts (--ours_flags), not against TRL",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per worker")
    parser.add_argument(
        "--phases",
        type=int,
        default=1,
        choices=[0, 1],
        help="1: trace the phases of every step (sys.settrace); 0: step times only, untraced",
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per worker")
    parser.add_argument("--json", default=os.path.join(ROOT, "out", "bench", "bench.json"))
    parser.add_argument(
        "--work_dir",
        default="",
        help="keep the weights, prompt files and every worker's folder (our runs' metrics.jsonl) "
        "here (default: a temporary folder, removed at the end)",
    )
    parser.add_argument(
        "--trl_ppo_path",
        default=DEFAULT_TRL_PPO_PATH,
        help=f"folder holding TRL {TRL_PPO_VERSION} (for trl_ppo; installed apart from the newer TRL)",
    )
    parser.add_argument(
        "--sglang_python",
        default="",
        help=f"the server venv's python for {SGLANG_CONTESTANT} (default: launch_sglang.sh's)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a 2-layer hidden-64 model, 8 tokens, 1 timed step (keeps the script working)",
    )
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.lengths, args.steps, args.warmup = "tiny", "8", 1, 1
    for size in args.sizes.split(","):
        if size not in SIZES:
            parser.error(f"--sizes: unknown size {size!r}; valid: {', '.join(SIZES)}")
    for name in args.contestants.split(","):
        if name not in CONTESTANTS + (SGLANG_CONTESTANT,):
            parser.error(
                f"--contestants: unknown contestant {name!r}; valid: {', '.join(CONTESTANTS + (SGLANG_CONTESTANT,))}"
            )
    try:
        args.lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be a comma list of integers, got {args.lengths!r}")
    if any(n < 2 for n in args.lengths) or args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--lengths must be >= 2, --steps >= 1, --warmup >= 0, --repeats >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    chat_prompts, chat_answers = bench_prompts(tokenizer, os.path.join(ROOT, "dataset", "rlaif_train.jsonl"))
    peaks = {
        "float32": measure_matmul_peak(torch.float32, device=args.device),
        "bfloat16": measure_matmul_peak(torch.bfloat16, 512, 1, device=args.device),
    }
    dtypes = [args.dtype] if args.dtype != "auto" else ["float32"] + (["bfloat16"] * has_bf16_units(args.device))
    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "bf16_units": has_bf16_units(args.device),
        "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
    }
    print(
        f"{machine['cpu']}, {machine['cores']} cores{', GPU ' + machine['gpu'] if machine['gpu'] else ''}; "
        f"dtypes: {', '.join(dtypes)} (bf16 units here: {machine['bf16_units']})",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as temporary:
        work_dir = os.path.abspath(args.work_dir or temporary)
        os.makedirs(work_dir, exist_ok=True)
        data_path, ppo_data_path = os.path.join(work_dir, "prompts.jsonl"), os.path.join(work_dir, "prompts_ppo.jsonl")
        write_prompt_file(data_path, chat_prompts, chat_answers)
        rows = NUM_PROMPTS * NUM_GENERATIONS  # PPO: one answer for each of 12 rows, the prompts in turn
        write_prompt_file(
            ppo_data_path,
            [chat_prompts[i % NUM_PROMPTS] for i in range(rows)],
            [chat_answers[i % NUM_PROMPTS] for i in range(rows)],
        )
        prompts, answers = loader_prompts(data_path, tokenizer)  # what our data loader hands our scripts
        ppo_prompts, _ = loader_prompts(ppo_data_path, tokenizer)
        prompt_len = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
        print(
            f"threads {args.threads}, prompts of {prompt_len} tokens, matmul peaks fp32 {peaks['float32']:.1f} / "
            f"bf16 {peaks['bfloat16']:.1f} GFLOP/s",
            flush=True,
        )
        weights = {size: prepare_weights(size, work_dir, tokenizer) for size in args.sizes.split(",")}
        for size, gen_len, dtype in itertools.product(args.sizes.split(","), args.lengths, dtypes):
            pth, folder = weights[size]
            hidden, layers, _ = SIZES[size]
            workload = f"{size} (h{hidden} x{layers}), {gen_len} tok, {dtype}"
            contestants = args.contestants.split(",")
            runs = {contestant: [] for contestant in contestants}
            for repeat, contestant in itertools.product(range(args.repeats), contestants):  # in turn: A B A B
                spec = dict(
                    contestant=contestant,
                    hidden_size=hidden,
                    num_hidden_layers=layers,
                    pth=pth,
                    qwen3_folder=folder,
                    gen_len=gen_len,
                    prompts=prompts,
                    answers=answers,
                    ppo_prompts=ppo_prompts,
                    data_path=data_path,
                    ppo_data_path=ppo_data_path,
                    prompt_len=prompt_len,
                    steps=args.steps,
                    warmup=args.warmup,
                    dtype=dtype,
                    threads=args.threads,
                    peaks=peaks,
                    device=args.device,
                    phases=bool(args.phases),
                    tmp_dir=os.path.join(work_dir, f"{contestant}_{size}_{gen_len}_{dtype}_{repeat + 1}"),
                    trl_ppo_path=args.trl_ppo_path,
                    ours_flags=args.ours_flags.split(),
                    natural_eos=args.natural_eos,
                )
                reason = contestant_available(contestant, args.trl_ppo_path, args.sglang_python)
                if reason and repeat > 0:
                    continue
                if reason:
                    result = {"skipped": reason}
                elif contestant == SGLANG_CONTESTANT:  # a server of its own, up only during this run
                    url, server = launch_cpu_server(folder, work_dir, args.sglang_python)
                    try:
                        result = run_worker(dict(spec, url=url), args.timeout)
                    finally:
                        stop_server(server)
                else:
                    result = run_worker(spec, args.timeout)
                runs[contestant].append(result)
                print(
                    f"{workload} | {contestant} | run {repeat + 1}: "
                    + (f"{result['step_s_median']:.2f} s/step" if "step_s_median" in result else str(result)),
                    flush=True,
                )
            for contestant in contestants:
                results.append(
                    {
                        "workload": workload,
                        "contestant": contestant,
                        "size": size,
                        "gen_len": gen_len,
                        "dtype": dtype,
                        "result": combine_runs(runs[contestant]),
                    }
                )
    table = format_table(results, peaks)
    print(table)
    report = {
        "machine": machine,
        "torch": torch.__version__,
        "threads": args.threads,
        "dtype": args.dtype,
        "device": args.device,
        "repeats": args.repeats,
        "natural_eos": args.natural_eos,
        "phases": args.phases,
        "command": shlex.join(["python", "scripts/bench/bench.py", *(sys.argv[1:] if argv is None else argv)]),
        "prompt_tokens": prompt_len,
        "prompts": prompts,
        "num_prompts": NUM_PROMPTS,
        "num_generations": NUM_GENERATIONS,
        "matmul_peak_gflops": peaks,
        "ours_flags": args.ours_flags,
        "results": results,
        "table": table,
    }
    atomic_write({args.json: lambda tmp: write_json(report, tmp)})
    print(f"wrote {args.json}")


def write_json(value, path):
    """``value`` as indented JSON (UTF-8) at ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
