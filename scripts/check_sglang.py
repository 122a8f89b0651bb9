"""Check ``--rollout_engine sglang`` against a real SGLang server, on a GPU or on a CPU.

Steps: export the policy as a Qwen3ForCausalLM folder, launch a server on it (or use a running server with
``--sglang_url``), sample the same prompts with both rollout engines and print their tokens/s and the SGLang
log-prob gap (masked mean |server - trainer| per token), then run a few GRPO steps with
``--rollout_engine sglang`` and print each step's ``logprob_gap``. A server launched here is stopped at the end.

The server runs in its own Python environment (sglang pins other transformers than the trainer):
``--sglang_python`` names its python. On a GPU the command is ``PYTHON -m sglang.launch_server``; on a CPU
(``--server_device cpu``, the default without CUDA) it is ``scripts/launch_sglang.sh``, with the CPU flags and
the venv of ``scripts/setup_sglang_env.sh`` (docs/sglang.md).

Usage:
    bash scripts/setup_sglang_env.sh && python scripts/check_sglang.py          # CPU, the default venv
    python scripts/check_sglang.py --sglang_python /path/to/sglang-venv/bin/python \\
        --server_args "--mem-fraction-static 0.4 --dtype float32"                 # GPU
    python scripts/check_sglang.py --sglang_url http://127.0.0.1:30000   # a server that is already running
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import requests
import torch

from dataset.lm_dataset import RLAIFDataset
from model.hf_qwen3 import save_qwen3_folder
from scripts.sglang_cpu.server import launch_cpu_server, stop_server
from trainer.rollout_engine import SGLangRolloutEngine, TorchRolloutEngine, tokenize_prompts
from trainer.infra.errors import run_script
from trainer.infra.weights import DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, build_config, init_model, weight_path


def launch_server(folder, port, args, work_dir):
    """Start a server on ``folder`` at 127.0.0.1:``port`` and wait for GET /health == 200.

    ``args.server_device`` cuda: ``{sglang_python} -m sglang.launch_server ... {server_args}`` in its own process
    group; cpu: ``scripts/launch_sglang.sh folder port {server_args}`` (which waits for /health itself) with
    SGLANG_PYTHON = ``args.sglang_python`` when given. The environment is passed on without
    SGLANG_RETURN_ORIGINAL_LOGPROB, so log-probs are SGLang's default (temperature-scaled, the trainer's
    convention). Returns (process-group id, url).
    Raises:
        RuntimeError: if the server exits or does not answer within ``args.launch_timeout`` seconds.
    """
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_RETURN_ORIGINAL_LOGPROB"}
    url = f"http://127.0.0.1:{port}"
    if args.server_device == "cpu":
        print(f"launching scripts/launch_sglang.sh {folder} {port} {args.server_args}", flush=True)
        _, pgid = launch_cpu_server(
            folder, work_dir, args.sglang_python, port, shlex.split(args.server_args), env, args.launch_timeout
        )
        return pgid, url
    command = [
        args.sglang_python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        folder,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ] + shlex.split(args.server_args)
    print("launching:", " ".join(command), flush=True)
    process = subprocess.Popen(command, env=env, start_new_session=True)  # its own process group
    deadline = time.time() + args.launch_timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the SGLang server exited with code {process.returncode}: {' '.join(command)}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return process.pid, url
        except requests.RequestException:
            pass
        time.sleep(5)
    stop_server(process.pid)
    raise RuntimeError(f"the SGLang server did not answer {url}/health within {args.launch_timeout} s")


def timed_rollout(engine, prompt_ids, attention_mask, args):
    """(RolloutResult, generated tokens per second) of one rollout, CUDA synchronised around it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.time()
    result = engine.rollout(prompt_ids, attention_mask, args.num_generations, args.max_gen_len, args.temperature)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, result.completion_mask.sum().item() / (time.time() - start)


def compare_engines(args, url, work_dir):
    """Sample the first ``num_prompts`` prompts with both engines; returns a dict of measurements."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    lm_config = build_config(args.hidden_size, args.num_hidden_layers, 0)
    model, tokenizer = init_model(lm_config, args.from_weight, args.save_dir, args.tokenizer_path, device)
    dataset = RLAIFDataset(args.data_path, tokenizer, seed=args.seed)
    prompts = [dataset[i]["prompt"] for i in range(min(args.num_prompts, len(dataset)))]
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts, args.max_seq_len, device)
    sglang_engine = SGLangRolloutEngine(
        model, tokenizer, url, os.path.join(work_dir, "shared_compare"), health_retries=3
    )
    torch_engine = TorchRolloutEngine(model, tokenizer)
    sglang_engine.rollout(prompt_ids[:1], attention_mask[:1], 1, 8, args.temperature)  # warm-up
    sglang_result, sglang_tps = timed_rollout(sglang_engine, prompt_ids, attention_mask, args)
    torch_result, torch_tps = timed_rollout(torch_engine, prompt_ids, attention_mask, args)
    return {
        "sglang_tokens_per_s": sglang_tps,
        "torch_tokens_per_s": torch_tps,
        "sglang_logprob_gap": sglang_result.metrics["logprob_gap"],
        "sglang_response_len": sglang_result.completion_mask.sum(1).float().mean().item(),
        "torch_response_len": torch_result.completion_mask.sum(1).float().mean().item(),
    }


def run_grpo_steps(args, url, work_dir):
    """``args.grpo_steps`` GRPO steps with ``--rollout_engine sglang``; returns each step's metrics row."""
    run_dir = os.path.join(work_dir, "run")
    weights = weight_path(args.from_weight, args.save_dir, args.hidden_size, 0)
    flags = [
        "--rollout_engine",
        "sglang",
        "--sglang_url",
        url,
        "--max_steps",
        str(args.grpo_steps),
        "--save_dir",
        work_dir,
        "--from_weight",
        weights,
        "--hidden_size",
        str(args.hidden_size),
        "--num_hidden_layers",
        str(args.num_hidden_layers),
        "--tokenizer_path",
        args.tokenizer_path,
        "--data_path",
        args.data_path,
        "--max_gen_len",
        str(args.max_gen_len),
        "--run_dir",
        run_dir,
        "--sglang_shared_path",
        os.path.join(work_dir, "shared_grpo"),
        "--temperature",
        str(args.temperature),
        "--num_generations",
        str(args.num_generations),
        "--save_interval",
        str(10**9),
        "--eval_interval",
        "0",
    ]  # the SGLang steps only: each row is a training step
    # run as a user runs it: the training script is a program, not a library
    subprocess.run([sys.executable, os.path.join(ROOT, "trainer", "train_grpo.py"), *flags], check=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Check the SGLang rollout engine against a real server")
    parser.add_argument("--from_weight", default="full_sft")
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--tokenizer_path", default=DEFAULT_TOKENIZER_PATH)
    parser.add_argument("--data_path", default=os.path.join(ROOT, "dataset", "rlaif_train.jsonl"))
    parser.add_argument("--work_dir", default=os.path.join(DEFAULT_SAVE_DIR, "check_sglang"))
    parser.add_argument("--sglang_url", default="", help="use this running server instead of launching one")
    parser.add_argument(
        "--sglang_python",
        default="",
        help="the server venv's python (default: cuda, this python; cpu, the venv of scripts/setup_sglang_env.sh)",
    )
    parser.add_argument(
        "--server_device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="auto: cuda when torch sees a GPU, else cpu (scripts/launch_sglang.sh)",
    )
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--server_args",
        default=None,
        help="extra arguments of sglang.launch_server (default: cuda, --mem-fraction-static 0.4, "
        "leaving GPU memory to the trainer; cpu, none beyond launch_sglang.sh's)",
    )
    parser.add_argument("--launch_timeout", type=int, default=900, help="seconds to wait for the server")
    parser.add_argument("--num_prompts", type=int, default=16)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_gen_len", type=int, default=256)
    parser.add_argument("--max_seq_len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--grpo_steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    for flag in ("num_prompts", "num_generations", "max_gen_len", "grpo_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.sglang_python and not os.access(args.sglang_python, os.X_OK):
        parser.error(
            f"--sglang_python {args.sglang_python} is not an executable (bash scripts/setup_sglang_env.sh "
            "prints the venv's python)"
        )
    if args.server_device == "auto":
        args.server_device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.server_args is None:
        args.server_args = "--mem-fraction-static 0.4" if args.server_device == "cuda" else ""
    return args


def main(argv=None):
    args = parse_args(argv)
    work_dir = os.path.abspath(args.work_dir)
    server_pgid, url = None, args.sglang_url.rstrip("/")
    if not url:
        os.makedirs(work_dir, exist_ok=True)
        lm_config = build_config(args.hidden_size, args.num_hidden_layers, 0)
        model, tokenizer = init_model(lm_config, args.from_weight, args.save_dir, args.tokenizer_path)
        folder = save_qwen3_folder(model.state_dict(), lm_config, os.path.join(work_dir, "launch"), tokenizer)
        del model
        server_pgid, url = launch_server(folder, args.port, args, work_dir)
    try:
        summary = compare_engines(args, url, work_dir)
        rows = run_grpo_steps(args, url, work_dir)
    finally:
        if server_pgid is not None:
            stop_server(server_pgid)
    summary["grpo_logprob_gap"] = [row["logprob_gap"] for row in rows]
    summary["grpo_reward"] = [row["reward"] for row in rows]
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
