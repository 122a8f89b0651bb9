"""Speed benchmark: our GRPO and PPO steps against TRL's trainers, our rollout against transformers' generate.

Every contestant runs in its own subprocess (a "worker") on the same weights, the same prompts and the same
settings, so that peak resident memory is its own and one contestant's caches do not help another. Our
contestants call this project's functions (``train_grpo.grpo_step``, the update of its loop, the rollout
engine, ``train_ppo.ppo_rollout`` / ``ppo_update``); TRL's is ``trl.GRPOTrainer.train`` on the same weights
exported as ``Qwen3ForCausalLM``, and TRL 1.9.2's ``PPOTrainer`` (the last release that has one) against our
PPO step. TRL is a benchmark-only dependency (``requirements-bench.txt``; TRL 1.9.2 goes into its own folder,
``.bench/trl-1.9.2``, see below); without it the TRL rows say "not installed" and everything else runs.

Workloads: the embedded default model (hidden 256, 4 layers, its SFT weights) and a
MiniMind-3-sized model (hidden 768, 8 layers, random weights); 2 prompts x 6 generations, prompts of at most 48
tokens (as many bundled questions as fit: 41 tokens), 64 and 256 generated tokens with EOS ignored (every
contestant does full-length work), beta 0.1,
CISPO (epsilon_high 5), temperature 1, no top-k / top-p, one optimizer step per rollout, no gradient
checkpointing (TRL's default is on; switched off here), fp32 and, where the machine has bf16 matrix units
(``has_bf16_units``: a CUDA GPU, or a CPU with AMX / AVX512-BF16), bf16 autocast for both contestants.
``--device cuda`` runs every contestant on the GPU (timings wait for the GPU's queue).

Figures per contestant: median and spread (min-max) of the step time over ``--steps`` steps after
``--warmup`` steps, split into rollout / reward / reference forward / policy forward / policy backward /
optimizer (the rest is "other"); rollout tokens/s; peak resident memory (ru_maxrss of the worker); model
FLOPs utilisation against the fp32 and bf16 matrix-multiply peaks measured at the start of the same run.
"Model FLOPs" count the work every GRPO implementation must do (generation, one reference forward, one
policy forward + backward: 2 + 2 + 6 FLOPs per weight per token, plus attention), the same numerator for
every contestant, so MFU ratios are inverse time ratios.

``--contestants sglang_engine`` adds the rollout of ``SGLangRolloutEngine`` against a real SGLang server on the
CPU (float32, EOS ignored as for the others): for each run a server is launched on the workload's weights by
scripts/launch_sglang.sh (the venv of scripts/setup_sglang_env.sh, or ``--sglang_python``) and stopped after
it, so no engine shares the machine with another; its "server" phase is the /generate request, the rest is
the engine's local recomputation of the old log-probs (``--sglang_logprobs recompute``, the default).

Run:
    pip install -r requirements-bench.txt      # TRL (benchmark only)
    pip install --no-deps --target .bench/trl-1.9.2 trl==1.9.2   # for trl_ppo only
    python scripts/bench.py                    # about 20 minutes on a 2-core CPU; table + out/bench/bench.json
    python scripts/bench.py --tiny             # seconds: a 2-layer model, 8 tokens (what the test runs)
    python scripts/bench.py --device cuda --dtype bfloat16 --lengths 64   # on a GPU (scripts/check_gpu.py)
    python scripts/bench.py --contestants sglang_engine,ours_rollout,hf_generate --sizes default --lengths 64 \\
        --dtype float32 --repeats 3 --json out/bench/bench_sglang.json   # the SGLang rollout (docs/performance.md)
"""
import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from scripts.sglang_cpu.server import launch_cpu_server, stop_server
from trainer.dtypes import has_bf16_units

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


# ----------------------------------------------------------------------------- measuring
def synchronize(device):
    """Wait for the device's queued work (CUDA runs asynchronously; a clock read without it times the launch)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Wall-clock seconds per named phase within one step; ``wrap`` times every call of a function."""

    def __init__(self, device="cpu"):
        self.current = {}
        self.device = device

    @contextlib.contextmanager
    def phase(self, name):
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start

    def wrap(self, fn, name):
        """``fn`` that adds its run time to phase ``name`` (a callable: the name is chosen per call)."""
        def timed(*args, **kwargs):
            with self.phase(name() if callable(name) else name):
                return fn(*args, **kwargs)
        return timed

    def take(self):
        """The phases of the step just finished (and start a new one)."""
        current, self.current = self.current, {}
        return current


def logps_phase():
    """A forward with gradients is the policy's; one without is the reference's (or the old policy's)."""
    return "policy_forward" if torch.is_grad_enabled() else "reference_forward"


def time_steps(step, spec, timer):
    """Call ``step()`` spec["warmup"] + spec["steps"] times; return (phases, totals) of the timed calls (seconds)."""
    phases, totals = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        timer.take()
        synchronize(spec["device"])
        start = time.perf_counter()
        step()
        synchronize(spec["device"])
        total = time.perf_counter() - start
        if i >= spec["warmup"]:
            phases.append(timer.take())
            totals.append(total)
    return phases, totals


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
    return 2 * size ** 3 / best / 1e9


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


def prepare_weights(size, work_dir, tokenizer):
    """Write the size's weights as a MiniMind state dict (.pth) and a Qwen3ForCausalLM folder; return both paths."""
    from model.hf_qwen3 import save_qwen3_folder
    from model.model_minimind import MiniMindForCausalLM
    from trainer.checkpoints import build_config, load_weights
    hidden, layers, source = SIZES[size]
    torch.manual_seed(0)
    config = build_config(hidden, layers, 0)
    model = MiniMindForCausalLM(config)
    if source != "random":
        load_weights(model, source)
    pth = os.path.join(work_dir, f"{size}.pth")
    torch.save(model.state_dict(), pth)
    folder = os.path.join(work_dir, f"{size}_qwen3")
    save_qwen3_folder(model.state_dict(), config, folder, tokenizer=tokenizer)
    return pth, folder


def summarize(step_phases, step_totals, tokens_per_rollout, model_flops, peaks, dtype):
    """Median / min / max of the totals, median of each phase, tokens/s, and the MFU of the median step
    against the measured matmul peak of ``dtype`` (the run's --dtype)."""
    median = statistics.median(step_totals)
    phases = {name: statistics.median([p.get(name, 0.0) for p in step_phases]) for name in PHASES}
    phases["other"] = max(median - sum(phases.values()), 0.0)
    if any("server" in p for p in step_phases):  # sglang_engine: the /generate request, a part of "rollout"
        phases["server"] = statistics.median([p.get("server", 0.0) for p in step_phases])
    rollout = phases["rollout"]
    return {
        "step_s_median": median, "step_s_min": min(step_totals), "step_s_max": max(step_totals),
        "steps": len(step_totals), "phases_s": phases,
        "rollout_tokens_per_s": tokens_per_rollout / rollout if rollout > 0 else None,
        "mfu": model_flops / median / (peaks[dtype] * 1e9) if model_flops else None,
    }


def combine_runs(runs):
    """One contestant's figures over ``--repeats`` worker runs (dicts from ``summarize``).

    One run is returned as it is. Over several: the median of the runs' median step times, the min and max of
    those medians (the spread between runs, which a single run's min-max over its steps does not show), the
    median of each phase, of the tokens/s and of the MFU, the largest peak memory, and every run's median in
    ``run_medians``. A failed or skipped run is returned in place of the figures.
    """
    failed = [run for run in runs if "step_s_median" not in run]
    if failed or len(runs) == 1:
        return (failed or runs)[0]
    medians = [run["step_s_median"] for run in runs]
    combined = dict(runs[0], step_s_median=statistics.median(medians), step_s_min=min(medians),
                    step_s_max=max(medians), runs=len(runs), run_medians=medians)
    combined["phases_s"] = {name: statistics.median(run["phases_s"][name] for run in runs)
                            for name in runs[0]["phases_s"]}
    for key in ("rollout_tokens_per_s", "mfu"):
        values = [run[key] for run in runs if run.get(key)]
        combined[key] = statistics.median(values) if values else None
    for key in ("peak_rss_mib", "peak_gpu_mib"):
        if key in runs[0]:
            combined[key] = max(run[key] for run in runs)
    return combined


# ----------------------------------------------------------------------------- contestants (one per worker)
def grpo_args(spec):
    """train_grpo's own flags for this workload (rule rewards only: --reward_model_path none)."""
    from trainer.train_grpo import parse_args
    return parse_args([
        "--hidden_size", str(spec["hidden_size"]), "--num_hidden_layers", str(spec["num_hidden_layers"]),
        "--batch_size", str(NUM_PROMPTS), "--num_generations", str(NUM_GENERATIONS),
        "--max_gen_len", str(spec["gen_len"]), "--max_seq_len", "512", "--beta", "0.1", "--loss_type", "cispo",
        "--epsilon_high", "5.0", "--temperature", "1.0", "--reward_model_path", "none", "--dtype", spec["dtype"],
        "--torch_logprobs", spec["torch_logprobs"], *spec["ours_flags"],
    ])


def load_minimind(spec):
    """(MiniMindForCausalLM with the workload's weights, its config), fp32 on spec["device"]."""
    from model.model_minimind import MiniMindForCausalLM
    from trainer.checkpoints import build_config
    config = build_config(spec["hidden_size"], spec["num_hidden_layers"], 0)
    model = MiniMindForCausalLM(config)
    model.load_state_dict(torch.load(spec["pth"], map_location="cpu", weights_only=True))
    return model.to(spec["device"]), config


def run_ours_grpo(spec, tokenizer, timer):
    """Our GRPO step through train_grpo's own functions, each phase timed by wrapping what the step calls."""
    import trainer.train_grpo as grpo
    from trainer.optimizer import project_scale_only_gradients
    from trainer.rollout_engine import TorchRolloutEngine
    from trainer.optimizer import build_cosine_scheduler, build_policy_optimizer
    from trainer.dtypes import autocast_context
    args = grpo_args(spec)
    device = spec["device"]
    autocast = autocast_context(device, args.dtype)
    model, config = load_minimind(spec)
    ref_model, _ = load_minimind(spec)
    ref_model.eval().requires_grad_(False)
    model.train()
    optimizer = build_policy_optimizer(model, args.learning_rate, args.weight_decay, args.final_norm_learning_rate)
    scheduler = build_cosine_scheduler(optimizer, spec["warmup"] + spec["steps"])
    engine = TorchRolloutEngine(model, tokenizer, generator=torch.Generator(spec["device"]).manual_seed(0),
                                logprobs_mode=args.torch_logprobs, ignore_eos=not spec["natural_eos"])
    engine.rollout = timer.wrap(engine.rollout, "rollout")
    reward_fn = timer.wrap(grpo.calculate_rewards, "reward")
    grpo.compute_per_token_logps = timer.wrap(grpo.compute_per_token_logps, logps_phase)
    grpo.compute_group_per_token_logps = timer.wrap(grpo.compute_group_per_token_logps, logps_phase)
    batch = {"prompt": spec["prompts"], "answer": spec["answers"]}

    def step():
        loss, _, _ = grpo.grpo_step(batch, model, ref_model, engine, reward_fn, None, tokenizer, args, device,
                                    autocast)
        with timer.phase("policy_backward"):
            loss.backward()
        with timer.phase("optimizer"):
            project_scale_only_gradients(optimizer)  # the update as train_grpo.py's loop writes it
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    phases, totals = time_steps(step, spec, timer)
    num_rows = NUM_PROMPTS * NUM_GENERATIONS
    return phases, totals, num_rows * spec["gen_len"], config


def run_trl_grpo(spec, tokenizer, timer):
    """TRL's GRPOTrainer on the exported Qwen3ForCausalLM, same settings; phases timed by wrapping its methods."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.trainer_utils import calculate_rewards

    def reward_func(prompts, completions, answer, **kwargs):
        return calculate_rewards(prompts, completions, answer, None, 2.0)["rewards"].tolist()

    class StepClock(TrainerCallback):
        def __init__(self):
            self.totals, self.phases, self.start = [], [], None

        def on_step_begin(self, args, state, control, **kwargs):
            timer.take()
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            elapsed = time.perf_counter() - self.optimizer_start
            timer.current["optimizer"] = timer.current.get("optimizer", 0.0) + elapsed

        def on_step_end(self, args, state, control, **kwargs):
            self.totals.append(time.perf_counter() - self.start)
            self.phases.append(timer.take())

    steps = spec["warmup"] + spec["steps"]
    rows = NUM_PROMPTS * NUM_GENERATIONS
    dataset = Dataset.from_dict({"prompt": spec["prompts"] * steps, "answer": spec["answers"] * steps})
    config = GRPOConfig(
        output_dir=spec["tmp_dir"], per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS, max_completion_length=spec["gen_len"], temperature=1.0, top_k=0, top_p=1.0,
        beta=0.1, loss_type="cispo", epsilon_high=5.0, learning_rate=5e-5, max_grad_norm=1.0, max_steps=steps,
        logging_steps=1, report_to="none", use_cpu=spec["device"] == "cpu", bf16=spec["dtype"] == "bfloat16",
        gradient_checkpointing=False, save_strategy="no", disable_tqdm=True, seed=0,
        generation_kwargs={"min_new_tokens": spec["gen_len"]},  # ignore EOS: full-length work
        model_init_kwargs={"dtype": torch.float32},
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=spec["qwen3_folder"], reward_funcs=reward_func, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    trainer._generate = timer.wrap(trainer._generate, "rollout")
    trainer._calculate_rewards = timer.wrap(trainer._calculate_rewards, "reward")
    trainer._get_per_token_logps_and_entropies = timer.wrap(trainer._get_per_token_logps_and_entropies, logps_phase)
    trainer.accelerator.backward = timer.wrap(trainer.accelerator.backward, "policy_backward")
    trainer._clip_grad_norm = timer.wrap(trainer._clip_grad_norm, "optimizer")
    trainer.train()
    model_config = trainer.model.config
    return clock.phases[spec["warmup"]:], clock.totals[spec["warmup"]:], rows * spec["gen_len"], model_config


def run_rollouts(spec, tokenizer, timer, contestant):
    """Rollout alone: our TorchRolloutEngine (with its old log-probs) or transformers' generate, both under the
    workload's dtype (bf16 autocast, as the GRPO step runs its rollout)."""
    from trainer.rollout_engine import tokenize_prompts
    from trainer.dtypes import autocast_context
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, spec["prompts"], 512, spec["device"])
    rows = NUM_PROMPTS * NUM_GENERATIONS
    if contestant == "ours_rollout":
        from trainer.rollout_engine import TorchRolloutEngine
        model, config = load_minimind(spec)
        engine = TorchRolloutEngine(model, tokenizer, generator=torch.Generator(spec["device"]).manual_seed(0),
                                    logprobs_mode=spec["torch_logprobs"], ignore_eos=True)

        def rollout():
            with autocast_context(spec["device"], spec["dtype"]):
                return engine.rollout(prompt_ids, attention_mask, NUM_GENERATIONS, spec["gen_len"]).completion_ids
    else:
        from transformers import Qwen3ForCausalLM
        model = Qwen3ForCausalLM.from_pretrained(spec["qwen3_folder"], dtype=torch.float32).eval().to(spec["device"])
        config = model.config
        repeated_ids = prompt_ids.repeat_interleave(NUM_GENERATIONS, dim=0)  # [N, P]
        repeated_mask = attention_mask.repeat_interleave(NUM_GENERATIONS, dim=0)  # [N, P]

        def rollout():
            with torch.no_grad(), autocast_context(spec["device"], spec["dtype"]):
                return model.generate(repeated_ids, attention_mask=repeated_mask, do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, max_new_tokens=spec["gen_len"],
                                      min_new_tokens=spec["gen_len"], pad_token_id=tokenizer.pad_token_id)
    phases, totals = time_steps(timer.wrap(rollout, "rollout"), spec, timer)
    return phases, totals, rows * spec["gen_len"], config


def run_sglang_rollouts(spec, tokenizer, timer):
    """Rollout alone through ``SGLangRolloutEngine`` against the server at spec["url"] (launched on the
    workload's weights): the /generate request is the "server" phase, the engine's local recomputation of the
    old log-probs the rest. EOS is ignored (``ignore_eos``, no stop token) for full-length work."""
    from trainer import rollout_engine
    from trainer.rollout_engine import SGLangRolloutEngine, tokenize_prompts
    model, config = load_minimind(spec)
    stopping = rollout_engine.sglang_sampling_params
    rollout_engine.sglang_sampling_params = lambda *args: dict(stopping(*args), ignore_eos=True, stop_token_ids=[])
    engine = SGLangRolloutEngine(model.eval(), tokenizer, spec["url"], spec["tmp_dir"])
    engine.request = timer.wrap(engine.request, "server")
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, spec["prompts"], 512, "cpu")

    def rollout():
        return engine.rollout(prompt_ids, attention_mask, NUM_GENERATIONS, spec["gen_len"]).completion_ids
    phases, totals = time_steps(timer.wrap(rollout, "rollout"), spec, timer)
    return phases, totals, NUM_PROMPTS * NUM_GENERATIONS * spec["gen_len"], config


def without_flag(flags, name):
    """``flags`` (a list of words) without ``name`` and the value that follows it."""
    kept, skip = [], False
    for word in flags:
        if skip or word == name:
            skip = word == name
            continue
        kept.append(word)
    return kept


def run_ours_ppo(spec, tokenizer, timer):
    """Our PPO step (rollout of B = 12 prompts, GAE, 2 epochs of minibatches of 2) through train_ppo's functions."""
    import trainer.train_ppo as ppo
    from trainer.rollout_engine import TorchRolloutEngine
    from trainer.optimizer import adamw, build_cosine_scheduler, build_policy_optimizer
    rows = NUM_PROMPTS * NUM_GENERATIONS
    args = ppo.parse_args([
        "--hidden_size", str(spec["hidden_size"]), "--num_hidden_layers", str(spec["num_hidden_layers"]),
        "--batch_size", str(rows), "--max_gen_len", str(spec["gen_len"]), "--max_seq_len", "512",
        "--reward_model_path", "none", "--dtype", spec["dtype"], "--torch_logprobs", spec["torch_logprobs"],
        "--mini_batch_size", "2", "--lam", "0.95",  # as run_trl_ppo's PPOConfig: lam=0.95, minibatches of 2 rows
        *without_flag(spec["ours_flags"], "--shared_prefix"),  # a GRPO flag
    ])
    model, config = load_minimind(spec)
    ref_model, _ = load_minimind(spec)
    ref_model.eval().requires_grad_(False)
    from model.model_minimind import CriticModel
    critic = CriticModel(config)
    critic.load_actor_state_dict(model.state_dict())
    critic = critic.to(spec["device"])
    actor_optimizer = build_policy_optimizer(model, args.learning_rate, args.weight_decay,
                                             args.final_norm_learning_rate)
    critic_optimizer = adamw(critic.parameters(), lr=args.critic_learning_rate, weight_decay=args.weight_decay)
    steps = spec["warmup"] + spec["steps"]
    actor_scheduler = build_cosine_scheduler(actor_optimizer, steps)
    critic_scheduler = build_cosine_scheduler(critic_optimizer, steps)
    engine = TorchRolloutEngine(model, tokenizer, generator=torch.Generator(spec["device"]).manual_seed(0),
                                logprobs_mode=args.torch_logprobs, ignore_eos=not spec["natural_eos"])
    engine.rollout = timer.wrap(engine.rollout, "rollout")
    reward_fn = timer.wrap(ppo.calculate_rewards, "reward")
    ppo.compute_per_token_logps = timer.wrap(ppo.compute_per_token_logps, logps_phase)
    prompts = [spec["prompts"][i % NUM_PROMPTS] for i in range(rows)]
    answers = [spec["answers"][i % NUM_PROMPTS] for i in range(rows)]
    batch = {"prompt": prompts, "answer": answers}
    generator = torch.Generator().manual_seed(0)
    from trainer.dtypes import autocast_context
    autocast = autocast_context(spec["device"], args.dtype)

    def step():
        rollout_batch = ppo.ppo_rollout(batch, ref_model, critic, engine, reward_fn, None, tokenizer, args,
                                        spec["device"], autocast)
        ppo.ppo_update(rollout_batch, model, critic, actor_optimizer, critic_optimizer, actor_scheduler,
                       critic_scheduler, args, spec["device"], generator, autocast)

    phases, totals = time_steps(step, spec, timer)
    return phases, totals, rows * spec["gen_len"], config


def run_trl_ppo(spec, tokenizer, timer):
    """TRL 1.9.2's PPOTrainer with our PPO settings: 12 prompts, 1 answer each, 2 epochs of minibatches of 2.

    TRL needs a reward model and a value model (sequence classifiers): both are the same weights with a new
    scalar head (``Qwen3ForSequenceClassification``), so TRL's reward is one extra forward where ours is the
    rule reward. Generation is forced to full length by adding min_new_tokens to TRL's GenerationConfig.
    A step is the time between two ``on_step_end`` callbacks; only the rollout is split out.
    """
    sys.path.insert(0, spec["trl_ppo_path"])
    import transformers
    from datasets import Dataset
    from transformers import Qwen3ForCausalLM, Qwen3ForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo_module

    class StepClock(TrainerCallback):
        def __init__(self):
            self.totals, self.phases, self.last = [], [], time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.totals.append(now - self.last)
            self.phases.append(timer.take())
            self.last = now

    rows = NUM_PROMPTS * NUM_GENERATIONS
    steps = spec["warmup"] + spec["steps"]
    tokenizer.padding_side = "left"
    prompts = [spec["prompts"][i % NUM_PROMPTS] for i in range(rows)]
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]})
    folder = spec["qwen3_folder"]
    policy = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref_policy = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reward_model = Qwen3ForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32)
    value_model = Qwen3ForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32)
    for model in (policy, ref_policy, reward_model, value_model):
        model.config.pad_token_id = tokenizer.pad_token_id
    config = PPOConfig(
        output_dir=spec["tmp_dir"], per_device_train_batch_size=2, gradient_accumulation_steps=rows // 2,
        num_mini_batches=rows // 2, num_ppo_epochs=2, total_episodes=rows * steps, response_length=spec["gen_len"],
        temperature=1.0, kl_coef=0.02, vf_coef=0.5, cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95,
        learning_rate=1e-5, local_rollout_forward_batch_size=rows, report_to="none",
        use_cpu=spec["device"] == "cpu", bf16=spec["dtype"] == "bfloat16",
        gradient_checkpointing=False, num_sample_generations=0, save_strategy="no", seed=0, stop_token=None,
    )
    generation_config_class = trl_ppo_module.GenerationConfig

    def full_length_generation_config(**kwargs):  # ignore EOS: full-length work, as for every contestant
        return generation_config_class(**kwargs, min_new_tokens=kwargs["max_new_tokens"])

    trl_ppo_module.GenerationConfig = full_length_generation_config
    trl_ppo_module.batch_generation = timer.wrap(trl_ppo_module.batch_generation, "rollout")
    clock = StepClock()
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, train_dataset=dataset, value_model=value_model,
                         callbacks=[clock])
    clock.last = time.perf_counter()
    timer.take()
    trainer.train()
    transformers.logging.set_verbosity_error()
    return clock.phases[spec["warmup"]:], clock.totals[spec["warmup"]:], rows * spec["gen_len"], policy.config


def worker(spec):
    """Run one contestant on one workload; print one JSON line with its figures."""
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    timer = PhaseTimer(spec["device"])
    contestant = spec["contestant"]
    if contestant == "ours_grpo":
        phases, totals, tokens, config = run_ours_grpo(spec, tokenizer, timer)
    elif contestant == "trl_grpo":
        phases, totals, tokens, config = run_trl_grpo(spec, tokenizer, timer)
    elif contestant == "ours_ppo":
        phases, totals, tokens, config = run_ours_ppo(spec, tokenizer, timer)
    elif contestant == "trl_ppo":
        phases, totals, tokens, config = run_trl_ppo(spec, tokenizer, timer)
    elif contestant == SGLANG_CONTESTANT:
        phases, totals, tokens, config = run_sglang_rollouts(spec, tokenizer, timer)
    else:
        phases, totals, tokens, config = run_rollouts(spec, tokenizer, timer, contestant)
    rows = NUM_PROMPTS * NUM_GENERATIONS
    flops = grpo_model_flops(config, rows, spec["prompt_len"], spec["gen_len"]) if contestant.endswith("grpo") else 0
    result = summarize(phases, totals, tokens, flops, spec["peaks"], spec["dtype"])
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if torch.device(spec["device"]).type == "cuda":
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated(spec["device"]) / 2 ** 20
    print("BENCH_RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- the run
def contestant_available(name, trl_ppo_path, sglang_python=""):
    """None when the contestant can run here, else the reason it cannot."""
    if name == SGLANG_CONTESTANT:
        python = sglang_python or os.path.join(os.environ.get("SGLANG_VENV") or os.path.expanduser(
            os.path.join("~", ".cache", "minimind-rl", "sglang-venv")), "bin", "python")
        if not os.access(python, os.X_OK):
            return f"no SGLang server python at {python} (bash scripts/setup_sglang_env.sh, or --sglang_python)"
    if name == "trl_grpo" and importlib.util.find_spec("trl") is None:
        return "trl not installed (pip install -r requirements-bench.txt)"
    if name == "trl_ppo" and not os.path.isdir(os.path.join(trl_ppo_path, "trl", "experimental", "ppo")):
        return (f"TRL {TRL_PPO_VERSION} not in {trl_ppo_path} (pip install --no-deps --target {trl_ppo_path} "
                f"trl=={TRL_PPO_VERSION})")
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
            return json.loads(line[len("BENCH_RESULT "):])
    return {"error": (result.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def format_table(results, peaks):
    """The results as a plain-text table, one row per workload and contestant, with ours/theirs ratios."""
    lines = [f"matmul peaks measured in this run: fp32 {peaks['float32']:.1f} GFLOP/s (2048^3), "
             f"bf16 {peaks['bfloat16']:.1f} GFLOP/s (512^3); each row's MFU is against the peak of its dtype; "
             "min-max: over the timed steps of one run, or over the runs' medians with --repeats",
             "", "| workload | contestant | step s (median) | min-max | rollout | reward | ref fwd | policy fwd | "
             "policy bwd | optimizer | other | rollout tok/s | peak RSS MiB | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        r = row["result"]
        if "error" in r or "skipped" in r:
            lines.append(f"| {row['workload']} | {row['contestant']} | {r.get('error') or r.get('skipped')} |"
                         + " |" * 11)
            continue
        p = r["phases_s"]
        tok = f"{r['rollout_tokens_per_s']:.0f}" if r["rollout_tokens_per_s"] else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        lines.append(
            f"| {row['workload']} | {row['contestant']} | {r['step_s_median']:.2f} | "
            f"{r['step_s_min']:.2f}-{r['step_s_max']:.2f} | " + " | ".join(
                f"{p[name]:.2f}" for name in (*PHASES, "other")) + f" | {tok} | {r['peak_rss_mib']:.0f} | {mfu} |")
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
    parser.add_argument("--repeats", type=int, default=1,
                        help="worker runs of each contestant, in turn; >1 reports the median of the runs' medians "
                             "and their min-max")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: float32, and bfloat16 too where the machine has bf16 units (has_bf16_units)")
    parser.add_argument("--device", default="cpu", help="where every contestant runs: cpu or cuda[:N]")
    parser.add_argument("--torch_logprobs", default="sampler", choices=["sampler", "recompute"])
    parser.add_argument("--ours_flags", default="",
                        help="extra flags of our training scripts for our step contestants, e.g. \"--shared_prefix 0\" "
                             "(a lever switched off); TRL's contestants are not affected")
    parser.add_argument("--natural_eos", action="store_true",
                        help="our GRPO / PPO steps stop each answer at its EOS (ragged rows, as in training) instead "
                             "of full length; for comparing our layouts (--ours_flags), not against TRL")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per worker")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per worker")
    parser.add_argument("--json", default=os.path.join(ROOT, "out", "bench", "bench.json"))
    parser.add_argument("--trl_ppo_path", default=DEFAULT_TRL_PPO_PATH,
                        help=f"folder holding TRL {TRL_PPO_VERSION} (for trl_ppo; installed apart from the newer TRL)")
    parser.add_argument("--sglang_python", default="",
                        help=f"the server venv's python for {SGLANG_CONTESTANT} (default: launch_sglang.sh's)")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer hidden-64 model, 8 tokens, 1 timed step (keeps the script working)")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.lengths, args.steps, args.warmup = "tiny", "8", 1, 1
    for size in args.sizes.split(","):
        if size not in SIZES:
            parser.error(f"--sizes: unknown size {size!r}; valid: {', '.join(SIZES)}")
    for name in args.contestants.split(","):
        if name not in CONTESTANTS + (SGLANG_CONTESTANT,):
            parser.error(f"--contestants: unknown contestant {name!r}; valid: "
                         f"{', '.join(CONTESTANTS + (SGLANG_CONTESTANT,))}")
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
    prompts, answers = bench_prompts(tokenizer, os.path.join(ROOT, "dataset", "rlaif_train.jsonl"))
    prompt_len = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    peaks = {"float32": measure_matmul_peak(torch.float32, device=args.device),
             "bfloat16": measure_matmul_peak(torch.bfloat16, 512, 1, device=args.device)}
    print(f"threads {args.threads}, prompts of {prompt_len} tokens, matmul peaks fp32 {peaks['float32']:.1f} / "
          f"bf16 {peaks['bfloat16']:.1f} GFLOP/s", flush=True)
    dtypes = [args.dtype] if args.dtype != "auto" else ["float32"] + (["bfloat16"] * has_bf16_units(args.device))
    print(f"dtypes: {', '.join(dtypes)} (bf16 units here: {has_bf16_units(args.device)})", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as work_dir:
        weights = {size: prepare_weights(size, work_dir, tokenizer) for size in args.sizes.split(",")}
        for size, gen_len, dtype in itertools.product(args.sizes.split(","), args.lengths, dtypes):
            pth, folder = weights[size]
            hidden, layers, _ = SIZES[size]
            workload = f"{size} (h{hidden} x{layers}), {gen_len} tok, {dtype}"
            contestants = args.contestants.split(",")
            runs = {contestant: [] for contestant in contestants}
            for repeat, contestant in itertools.product(range(args.repeats), contestants):  # in turn: A B A B
                spec = dict(contestant=contestant, hidden_size=hidden, num_hidden_layers=layers, pth=pth,
                            qwen3_folder=folder, gen_len=gen_len, prompts=prompts, answers=answers,
                            prompt_len=prompt_len, steps=args.steps, warmup=args.warmup, dtype=dtype,
                            torch_logprobs=args.torch_logprobs, threads=args.threads, peaks=peaks,
                            device=args.device,
                            tmp_dir=os.path.join(work_dir, f"trl_{size}_{gen_len}_{dtype}_{repeat}"),
                            trl_ppo_path=args.trl_ppo_path, ours_flags=args.ours_flags.split(),
                            natural_eos=args.natural_eos)
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
                print(f"{workload} | {contestant} | run {repeat + 1}: " + (
                    f"{result['step_s_median']:.2f} s/step" if "step_s_median" in result else str(result)),
                    flush=True)
            for contestant in contestants:
                results.append({"workload": workload, "contestant": contestant, "size": size,
                                "gen_len": gen_len, "dtype": dtype, "result": combine_runs(runs[contestant])})
    table = format_table(results, peaks)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    report = {"torch": torch.__version__, "threads": args.threads, "dtype": args.dtype, "device": args.device,
              "repeats": args.repeats, "natural_eos": args.natural_eos,
              "prompt_tokens": prompt_len,
              "num_prompts": NUM_PROMPTS, "num_generations": NUM_GENERATIONS, "matmul_peak_gflops": peaks,
              "torch_logprobs": args.torch_logprobs, "ours_flags": args.ours_flags, "results": results,
              "table": table}
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, args.json)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
