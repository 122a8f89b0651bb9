"""Peak memory and time of one whole GRPO step, lever by lever: ``trainer/train_grpo.py`` at upstream MiniMind's sizes.

Each row runs ``trainer/train_grpo.py``'s ``main`` for one step in a process of its own, so the process's peak resident
memory (``ru_maxrss``, what ``/usr/bin/time -v`` reports as its maximum resident set size) is the row's own: the
start-up, the rollout (every answer forced to ``--max_gen_len`` tokens, ``full_length.py``), the rewards (rules and a
reward model), the reference's log-probs and the update. The final checkpoint is not written (it is not part of a
step). Weights are random (``--from_weight none``: memory and time do not depend on them); the prompts are the bundled
ones, tokenized by the bundled tokenizer (no tokenizer of a 151,936-token vocabulary exists offline: the policy samples
token ids, and ids beyond the tokenizer's decode to nothing).

Rows (``--rows``, comma-separated):
  upstream defaults: 768 x 8, vocabulary 6,400, 2 prompts x 6 answers, prompts <= 768 tokens, answers 1,024 tokens,
    CISPO with beta 0.1, fp32 and bf16 autocast; levers off (the script's defaults), then each lever, then all;
    with the tiny internlm2 reward model, or with one of internlm2-1_8b-reward's shape in bf16 (random weights from
    the published config in ../shared/compat/);
  qwen3-0.6b: 16 x 128 heads, 8 KV heads, 28 layers, intermediate 3,072, vocabulary 151,936, bf16, the same batch and
    lengths, the bf16 1.8 B-shaped reward model: all levers (and the moments in 8 bits), levers off (stopped at the
    memory bound); PPO (``trainer/train_ppo.py``, 12 prompts x 1 answer) with LoRA adapters of rank 16 on the policy
    and on the critic (``--lora_rank``: both), minibatches and micro-batches of 2, checkpointing and chunks;
  trl: TRL 1.16's ``GRPOTrainer.train()`` for one step on the same random 768 x 8 weights (exported as a
    ``Qwen3ForCausalLM`` folder), two bundled prompts x 6 answers forced to 1,024 tokens (``min_new_tokens``), CISPO
    with epsilon_high 5 and beta 0.1 (its reference: a full copy), one optimizer step on the 12 answers
    (``per_device_train_batch_size`` 12), its own ``gradient_checkpointing=True`` (non-reentrant), the rule rewards
    (``calculate_rewards`` without a reward model: the tiny one of our rows holds 6 M parameters), fp32 or ``bf16``.

A row whose memory passes 90 % of what the machine had available is stopped and reads "did not fit (> X)", X its
resident memory when it was stopped.

    python scripts/bench/memory.py --rows up_fp32_off,up_fp32_all --json_out scripts/bench/results/memory.json
    python scripts/bench/memory.py --list

Prints one table: peak RSS (MiB), its ratio to the first row's, and the seconds of the step.
"""

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for path in (ROOT, os.path.join(ROOT, "scripts", "bench"), os.path.join(ROOT, "tests", "support")):
    if path not in sys.path:
        sys.path.insert(0, path)

from lora_memory import run_watched  # noqa: E402  (one process per row, stopped at the memory bound)

INTERNLM2_SOURCE = os.path.join(os.path.dirname(ROOT), "shared", "compat", "internlm2-1_8b-reward")
UPSTREAM_SHAPE = ["--hidden_size", "768", "--num_hidden_layers", "8"]
QWEN3_SHAPE = [
    "--hidden_size",
    "1024",
    "--num_hidden_layers",
    "28",
    "--num_attention_heads",
    "16",
    "--num_key_value_heads",
    "8",
    "--head_dim",
    "128",
    "--intermediate_size",
    "3072",
    "--vocab_size",
    "151936",
]
UPSTREAM_BATCH = ["--batch_size", "2", "--num_generations", "6", "--max_seq_len", "768", "--max_gen_len", "1024"]
CHUNK = ["--logprob_chunk_size", "1024"]
CHECKPOINTING = ["--gradient_checkpointing", "1"]
MICRO = ["--micro_batch_size", "2", "--shared_prefix", "0"]
ALL = CHECKPOINTING + MICRO + CHUNK + ["--ref_dtype", "bfloat16"]
EIGHT_BIT = ["--optimizer", "adamw_8bit"]
PPO_LORA_ALL = ["--lora_rank", "16", "--mini_batch_size", "2", "--micro_batch_size", "2", *CHECKPOINTING, *CHUNK]
ROWS = {  # name: (shape flags, dtype, reward model, lever flags); a "ppo_" row runs trainer/train_ppo.py
    "up_fp32_off": (UPSTREAM_SHAPE, "float32", "tiny", []),
    "up_fp32_checkpointing": (UPSTREAM_SHAPE, "float32", "tiny", CHECKPOINTING),
    "up_fp32_micro2": (UPSTREAM_SHAPE, "float32", "tiny", MICRO),
    "up_fp32_chunk": (UPSTREAM_SHAPE, "float32", "tiny", CHUNK),
    "up_fp32_ref_bf16": (UPSTREAM_SHAPE, "float32", "tiny", ["--ref_dtype", "bfloat16"]),
    "up_fp32_all": (UPSTREAM_SHAPE, "float32", "tiny", ALL),
    "up_bf16_off": (UPSTREAM_SHAPE, "bfloat16", "tiny", []),
    "up_bf16_all": (UPSTREAM_SHAPE, "bfloat16", "tiny", ALL),
    "up_fp32_rm18_off": (UPSTREAM_SHAPE, "float32", "1.8b", []),
    "up_fp32_rm18_all": (UPSTREAM_SHAPE, "float32", "1.8b", ALL),
    "up_bf16_rm18_all": (UPSTREAM_SHAPE, "bfloat16", "1.8b", ALL),
    "qwen3_bf16_rm18_all": (QWEN3_SHAPE, "bfloat16", "1.8b", ALL),
    "qwen3_bf16_rm18_off": (QWEN3_SHAPE, "bfloat16", "1.8b", []),
    "up_fp32_all_8bit": (UPSTREAM_SHAPE, "float32", "tiny", ALL + EIGHT_BIT),
    "qwen3_bf16_rm18_all_8bit": (QWEN3_SHAPE, "bfloat16", "1.8b", ALL + EIGHT_BIT),
    "ppo_qwen3_bf16_rm18_lora_all": (QWEN3_SHAPE, "bfloat16", "1.8b", PPO_LORA_ALL),
    "trl_fp32_checkpointing": (UPSTREAM_SHAPE, "float32", "TRL", ["gradient_checkpointing=True"]),
    "trl_bf16_checkpointing": (UPSTREAM_SHAPE, "bfloat16", "TRL", ["gradient_checkpointing=True"]),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="up_fp32_off,up_fp32_all", help="comma-separated row names (--list)")
    parser.add_argument("--list", action="store_true", help="print the rows and their flags, then exit")
    parser.add_argument("--reward_dir", default="", help="where the reward-model folders are built (default: a temp)")
    parser.add_argument("--json_out", default="", help="write every figure here too")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (peak resident memory of the process) or cuda:N (also torch's peak allocated and reserved GPU "
        "memory, the figures scripts/check_gpu.py prints)",
    )
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in args.rows.split(","):
        if name not in ROWS:
            parser.error(f"--rows: unknown row {name!r}; valid: {', '.join(ROWS)}")
    return args


def reward_folder(kind, reward_dir):
    """The internlm2 reward-model folder of ``kind`` ("tiny": hidden 64 x 2 layers; "1.8b": the published shape),
    built once from the published files (random fp16 weights, ``tiny_internlm2_reward.py``). Raises SystemExit when
    ../shared/compat/internlm2-1_8b-reward is missing."""
    from tiny_internlm2_reward import build_tiny_internlm2_reward

    if not os.path.isdir(INTERNLM2_SOURCE):
        raise SystemExit(f"the reward-model rows need {INTERNLM2_SOURCE} (the published code and config, no weights)")
    folder = os.path.join(reward_dir, f"internlm2_{kind}")
    if not os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        if kind == "tiny":
            build_tiny_internlm2_reward(INTERNLM2_SOURCE, folder)
        else:
            build_tiny_internlm2_reward(INTERNLM2_SOURCE, folder, dims={})  # the published shape
    return folder


def row_argv(name, reward_path, save_dir, device="cpu"):
    """``trainer/train_grpo.py``'s (``train_ppo.py``'s for a "ppo_" row) flags of row ``name``: one step, random
    weights, no evaluation, no tracker."""
    shape, dtype, kind, levers = ROWS[name]
    reward_dtype = "bfloat16" if kind == "1.8b" else "float32"
    batch = (
        ["--batch_size", "12", "--max_seq_len", "768", "--max_gen_len", "1024"]
        if name.startswith("ppo_")
        else UPSTREAM_BATCH
    )
    return [
        *shape,
        *batch,
        "--from_weight",
        "none",
        "--dtype",
        dtype,
        "--reward_model_path",
        reward_path,
        "--trust_remote_code",
        "1",
        "--reward_dtype",
        reward_dtype,
        "--max_steps",
        "1",
        "--eval_interval",
        "0",
        "--save_dir",
        save_dir,
        "--run_dir",
        os.path.join(save_dir, "run"),
        "--device",
        device,
        *levers,
    ]


def run_trl_worker(spec):
    """The TRL row in this process (module docstring). Returns the peak RSS (MiB) and TRL's own step time."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from dataset.lm_dataset import RLAIFDataset
    from model.hf_qwen3 import save_qwen3_folder
    from model.model_minimind import MiniMindForCausalLM
    from trainer.infra.weights import build_config
    from trainer.trainer_utils import calculate_rewards

    def reward_func(prompts, completions, answer, **kwargs):
        return calculate_rewards(prompts, completions, answer, None, 2.0)["rewards"].tolist()

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    torch.manual_seed(0)
    config = build_config(768, 8, 0)
    folder = save_qwen3_folder(
        MiniMindForCausalLM(config).state_dict(), config, os.path.join(spec["save_dir"], "policy"), tokenizer
    )
    data = RLAIFDataset(os.path.join(ROOT, "dataset", "rlaif_train.jsonl"), tokenizer, seed=42)
    rows = [data[i] for i in range(2)]
    dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})
    trl_config = GRPOConfig(
        output_dir=os.path.join(spec["save_dir"], "trl"),
        per_device_train_batch_size=12,
        gradient_accumulation_steps=1,
        num_generations=6,
        max_completion_length=1024,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.1,
        loss_type="cispo",
        epsilon_high=5.0,
        learning_rate=2e-5,
        max_grad_norm=1.0,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        use_cpu=spec.get("device", "cpu") == "cpu",
        bf16=spec["dtype"] == "bfloat16",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,
        generation_kwargs={"min_new_tokens": 1024},  # EOS never sampled: full-length answers
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(
        model=folder, reward_funcs=reward_func, args=trl_config, train_dataset=dataset, processing_class=tokenizer
    )
    output = trainer.train()
    step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    on_gpu = torch.cuda.is_available() and spec.get("device", "cpu") != "cpu"
    return {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": step_times[-1] if step_times else output.metrics["train_runtime"],
        "threads": torch.get_num_threads(),
        **(
            {
                "gpu_peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            }
            if on_gpu
            else {}
        ),
    }


def run_worker(spec):
    """One row in this process: ``train_grpo.main`` for one step with full-length answers and no final save. Returns
    the peak RSS (MiB), the step's seconds and the parameter count."""
    import torch
    from full_length import full_length_answers

    from trainer import train_grpo, train_ppo

    script = train_ppo if spec.get("script") == "ppo" else train_grpo
    script.save_checkpoint = lambda *args, **kwargs: None  # the final save is not part of a step
    with full_length_answers():
        script.main(spec["argv"])
    with open(os.path.join(spec["save_dir"], "run", "metrics.jsonl"), encoding="utf-8") as f:
        row = [json.loads(line) for line in f][-1]
    return {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": row["elapsed_s"],
        "response_len": row["response_len"],
        "threads": torch.get_num_threads(),
        **{key: row[key] for key in ("gpu_peak_memory_gib", "gpu_peak_reserved_gib") if key in row},
    }


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        for name, (shape, dtype, kind, levers) in ROWS.items():
            print(f"{name}: {' '.join(shape)} --dtype {dtype}, reward model {kind}, levers: {' '.join(levers) or '-'}")
        return
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(run_trl_worker(spec) if spec.get("trl") else run_worker(spec)))
        return
    reward_dir = args.reward_dir or tempfile.mkdtemp(prefix="memory_bench_rewards_")
    results, first_peak = [], None
    gpu = args.device.startswith("cuda")
    print(
        "| row | dtype | reward model | levers | peak RSS (MiB) | / first row | step (s) |"
        + (" GPU peak allocated / reserved (GiB) |" if gpu else "")
    )
    print("| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if gpu else ""), flush=True)
    for name in args.rows.split(","):
        shape, dtype, kind, levers = ROWS[name]
        with tempfile.TemporaryDirectory(prefix="memory_bench_") as save_dir:
            if kind == "TRL":
                spec = {"trl": True, "dtype": dtype, "save_dir": save_dir, "argv": [], "device": args.device}
            else:
                spec = {
                    "argv": row_argv(name, reward_folder(kind, reward_dir), save_dir, args.device),
                    "save_dir": save_dir,
                }
                spec["script"] = "ppo" if name.startswith("ppo_") else "grpo"
            started = time.time()
            returncode, stdout, stderr, largest_mib = run_watched(spec, script=os.path.abspath(__file__))
        if returncode is None:
            result = {"row": name, "stopped_at_mib": largest_mib, "wall_s": time.time() - started}
            peak = f"did not fit (> {largest_mib:,.0f})"
        elif returncode != 0:
            raise SystemExit(f"row {name} failed:\n{stderr[-3000:]}")
        else:
            result = dict(json.loads(stdout.strip().splitlines()[-1]), row=name, wall_s=time.time() - started)
            peak = f"{result['peak_rss_mib']:,.0f}"
        result.update(flags=spec["argv"])
        results.append(result)
        mib = result.get("peak_rss_mib") or result["stopped_at_mib"]
        first_peak = first_peak or mib
        step = f"{result['step_s']:.0f}" if "step_s" in result else "-"
        gpu_cell = (
            f" {result.get('gpu_peak_memory_gib', 0):.2f} / {result.get('gpu_peak_reserved_gib', 0):.2f} |"
            if gpu
            else ""
        )
        print(
            f"| {name} | {dtype} | {kind} | {' '.join(levers) or 'off'} | {peak} | {mib / first_peak:.2f} | {step} |"
            + gpu_cell,
            flush=True,
        )
    if args.json_out:
        import torch

        machine = {
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        }
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({**machine, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
