"""Convert MiniMind ``.pth`` weights <-> a transformers ``Qwen3ForCausalLM`` folder, both ways.

The folder (config.json + model.safetensors + the tokenizer) loads with
``transformers.Qwen3ForCausalLM.from_pretrained`` and with SGLang, so an SGLang server can be launched on
the SFT weights before a run with ``--rollout_engine sglang``. The mapping lives in ``model/hf_qwen3.py``
(also used by the SGLang engine's weight sync); the logits before and after agree (tests/test_convert_model.py).

Usage:
    python scripts/convert_model.py to_hf --weight full_sft --out out/full_sft_256_hf
    python scripts/convert_model.py to_hf --weight out/grpo_256.pth --out out/grpo_256_hf --dtype bfloat16
    python scripts/convert_model.py to_minimind --hf_dir out/grpo_256_hf --out out/grpo_hf_256.pth
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from model.hf_qwen3 import DTYPES, load_qwen3_folder, save_qwen3_folder
from model.model_minimind import MiniMindForCausalLM
from trainer.infra.errors import run_script
from trainer.infra.flags import add_bool_flag
from trainer.infra.weights import (
    DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, build_config, init_model, save_weights, weight_path,
)


def to_hf(args):
    """MiniMind .pth (strict load through the architecture flags) -> Qwen3ForCausalLM folder; returns its path."""
    lm_config = build_config(args.hidden_size, args.num_hidden_layers, args.use_moe)
    model, tokenizer = init_model(lm_config, args.weight, args.save_dir, args.tokenizer_path)
    path = save_qwen3_folder(model.state_dict(), lm_config, args.out, tokenizer=tokenizer, dtype=DTYPES[args.dtype])
    source = weight_path(args.weight, args.save_dir, lm_config.hidden_size, lm_config.use_moe)
    print(f"wrote {path} from {source}")
    print(f"launch SGLang on it: python -m sglang.launch_server --model-path {path} --port 30000")
    return path


def to_minimind(args):
    """Qwen3ForCausalLM folder -> MiniMind .pth (atomic, ``--dtype``, fp16 by default); returns its path.

    Raises:
        ValueError: when the folder's tensors do not match the architecture its config.json describes.
    """
    lm_config, state_dict = load_qwen3_folder(args.hf_dir)
    model = MiniMindForCausalLM(lm_config)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(f"{args.hf_dir}: missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}")
    dtype = DTYPES[args.dtype]
    has_tokenizer = os.path.isfile(os.path.join(args.hf_dir, "tokenizer_config.json"))  # written beside it by to_hf
    save_weights({k: v.to(dtype) for k, v in state_dict.items()}, args.out, args.hf_dir if has_tokenizer else None)
    print(f"wrote {args.out} (hidden_size {lm_config.hidden_size}, num_hidden_layers {lm_config.num_hidden_layers}:"
          f" pass --hidden_size {lm_config.hidden_size} --num_hidden_layers {lm_config.num_hidden_layers} "
          f"--from_weight {args.out} to the training scripts)")
    return args.out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind .pth <-> transformers Qwen3ForCausalLM folder")
    commands = parser.add_subparsers(dest="command", required=True)
    hf = commands.add_parser("to_hf", help="MiniMind .pth -> Qwen3ForCausalLM folder")
    hf.add_argument("--weight", default="full_sft", help="name in save_dir ({name}_{hidden}.pth) or a path")
    hf.add_argument("--save_dir", default=DEFAULT_SAVE_DIR)
    hf.add_argument("--hidden_size", type=int, default=256)
    hf.add_argument("--num_hidden_layers", type=int, default=4)
    add_bool_flag(hf, "--use_moe", help="1: mixture-of-experts MLPs")
    hf.add_argument("--tokenizer_path", default=DEFAULT_TOKENIZER_PATH)
    hf.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="storage dtype of the weights")
    hf.add_argument("--out", required=True, help="folder to write (replaced atomically if it exists)")
    mm = commands.add_parser("to_minimind", help="Qwen3ForCausalLM folder -> MiniMind .pth")
    mm.add_argument("--hf_dir", required=True)
    mm.add_argument("--dtype", default="float16", choices=sorted(DTYPES), help="MiniMind releases use float16")
    mm.add_argument("--out", required=True, help=".pth file to write (atomically)")
    args = parser.parse_args(argv)
    if args.command == "to_hf" and args.use_moe:
        parser.error("--use_moe 1: MiniMind's MoE model has no Qwen3ForCausalLM counterpart")
    if args.command == "to_minimind" and not os.path.isdir(args.hf_dir):
        parser.error(f"--hf_dir {args.hf_dir} is not a folder")
    return args


def main(argv=None):
    args = parse_args(argv)
    with torch.no_grad():
        return to_hf(args) if args.command == "to_hf" else to_minimind(args)


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
