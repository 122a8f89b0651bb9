"""Convert MiniMind ``.pth`` weights <-> a transformers ``Qwen3ForCausalLM`` folder, both ways.

The folder (config.json + model.safetensors + the tokenizer) loads with
``transformers.Qwen3ForCausalLM.from_pretrained`` and with SGLang, so an SGLang server can be launched on
the SFT weights before a run with ``--rollout_engine sglang``. The mapping lives in ``model/hf_qwen3.py``
(also used by the SGLang engine's weight sync); the logits before and after agree (tests/test_convert_model.py).

Usage:
    python scripts/convert_model.py to_hf --weight full_sft --out out/full_sft_256_hf
    python scripts/convert_model.py to_hf --weight out/grpo_256.pth --out out/grpo_256_hf --dtype bfloat16
    python scripts/convert_model.py to_minimind --hf_dir out/grpo_256_hf --out out/grpo_hf_256.pth
    python scripts/convert_model.py merge_lora --adapter out/grpo_256_lora --out out/grpo_merged_256.pth
    python scripts/convert_model.py --merge_lora --adapter out/grpo_256_lora --out out/grpo_merged_256.pth  # the same

``merge_lora`` merges a LoRA adapter folder in peft's format (adapter_config.json + adapter_model.safetensors, as
the training scripts write it beside their weights under ``--lora_rank``: docs/lora.md) into its base MiniMind
weights, W + (alpha / R) B A, and writes MiniMind ``.pth`` weights that ``scripts/eval_policy.py``, the training
scripts' ``--from_weight`` and upstream MiniMind load. The base is the file the adapter folder names
(``base_model_name_or_path``) unless ``--weight`` names another.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from model.hf_qwen3 import DTYPES, load_qwen3_folder, save_qwen3_folder
from model.model_minimind import CriticModel, MiniMindForCausalLM
from trainer.infra.errors import InputError, run_script
from trainer.infra.flags import add_bool_flag
from trainer.infra.lora import VALUE_HEAD, merged_state_dict, peft_quiet
from trainer.infra.weights import (
    DEFAULT_SAVE_DIR,
    DEFAULT_TOKENIZER_PATH,
    build_config,
    init_model,
    load_tensors_only,
    minimind_dims,
    save_weights,
    weight_path,
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
    print(
        f"wrote {args.out} (hidden_size {lm_config.hidden_size}, num_hidden_layers {lm_config.num_hidden_layers}:"
        f" pass --hidden_size {lm_config.hidden_size} --num_hidden_layers {lm_config.num_hidden_layers} "
        f"--from_weight {args.out} to the training scripts)"
    )
    return args.out


def merge_lora(args):
    """LoRA adapter folder (peft's format) + its base MiniMind ``.pth`` -> merged MiniMind ``.pth`` (atomic,
    ``--dtype``, fp16 by default) with the tokenizer record beside it; returns its path. An adapter folder of PPO's
    critic (its value head among peft's ``modules_to_save``) gives ``CriticModel`` weights.

    Raises:
        InputError (a ValueError): naming the folder when it has no adapter_config.json or
            adapter_model.safetensors, names no base weights and ``--weight`` is not given, names a base that is not
            a file or not MiniMind weights, or holds tensors that do not fit the base (another size, other
            projections: the message names the tensors). Nothing is written then.
    """
    from peft import PeftConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    files = [os.path.join(args.adapter, name) for name in ("adapter_config.json", "adapter_model.safetensors")]
    for path in files:
        if not os.path.isfile(path):
            raise InputError(
                f"--adapter {args.adapter}: no {os.path.basename(path)}, so it is not a peft adapter "
                f"folder (a run with --lora_rank writes one as {{save_dir}}/{{name}}_{{hidden}}_lora/)"
            )
    peft_config = PeftConfig.from_pretrained(args.adapter)
    base = args.weight or peft_config.base_model_name_or_path
    if not base:
        raise InputError(f"{files[0]} names no base weights (base_model_name_or_path): pass --weight")
    if not os.path.isfile(base):
        raise InputError(f"the base weights of {args.adapter}, {base}, are not a file: pass --weight FILE")
    dims = minimind_dims(load_tensors_only(base, mmap=True))
    if dims is None:
        raise InputError(f"the base weights of {args.adapter}, {base}, are not a MiniMind .pth: pass --weight FILE")
    lm_config = build_config(dims["hidden_size"], dims["num_hidden_layers"], dims["use_moe"], dims["vocab_size"])
    actor, _ = init_model(lm_config, base, os.path.dirname(base), args.tokenizer_path)
    model = actor
    if VALUE_HEAD in (peft_config.modules_to_save or []):  # a critic's adapters: the backbone of the base + V = 0
        model = CriticModel(lm_config)
        model.load_actor_state_dict(actor.state_dict())
    model.name_or_path = peft_config.base_model_name_or_path  # kept as it is (get_peft_model records the model's)
    with peft_quiet():
        peft_model = get_peft_model(model, peft_config)
    adapters = load_file(files[1])
    expected = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    missing, unexpected = sorted(set(expected) - set(adapters)), sorted(set(adapters) - set(expected))
    shapes = [
        f"{k} {tuple(v.shape)} (the base needs {tuple(expected[k].shape)})"
        for k, v in adapters.items()
        if k in expected and v.shape != expected[k].shape
    ]
    if missing or unexpected or shapes:
        raise InputError(
            f"{files[1]} does not fit the base {base}: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, other shapes {shapes[:4]}; pass the base it was trained on as --weight"
        )
    set_peft_model_state_dict(peft_model, adapters)
    dtype = DTYPES[args.dtype]
    save_weights({k: v.to(dtype) for k, v in merged_state_dict(peft_model).items()}, args.out, args.tokenizer_path)
    print(
        f"wrote {args.out}: {base} with the adapters of {args.adapter} merged in (rank {peft_config.r}, "
        f"alpha {peft_config.lora_alpha}); pass --from_weight {args.out} --hidden_size {dims['hidden_size']} "
        f"--num_hidden_layers {dims['num_hidden_layers']} to the scripts"
    )
    return args.out


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--merge_lora"]:  # the flag spelling of the merge_lora command
        argv[0] = "merge_lora"
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
    merge = commands.add_parser("merge_lora", help="LoRA adapter folder + its base .pth -> merged MiniMind .pth")
    merge.add_argument("--adapter", required=True, help="peft adapter folder, e.g. out/grpo_256_lora")
    merge.add_argument(
        "--weight",
        default=None,
        help="the base weights' .pth file (default: the file the adapter folder names as base_model_name_or_path)",
    )
    merge.add_argument("--tokenizer_path", default=DEFAULT_TOKENIZER_PATH)
    merge.add_argument("--dtype", default="float16", choices=sorted(DTYPES), help="MiniMind releases use float16")
    merge.add_argument("--out", required=True, help=".pth file to write (atomically)")
    args = parser.parse_args(argv)
    if args.command == "to_hf" and args.use_moe:
        parser.error("--use_moe 1: MiniMind's MoE model has no Qwen3ForCausalLM counterpart")
    if args.command == "to_minimind" and not os.path.isdir(args.hf_dir):
        parser.error(f"--hf_dir {args.hf_dir} is not a folder")
    return args


def main(argv=None):
    args = parse_args(argv)
    with torch.no_grad():
        return {"to_hf": to_hf, "to_minimind": to_minimind, "merge_lora": merge_lora}[args.command](args)


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
