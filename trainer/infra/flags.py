"""Flags both RL scripts take (same names, same meanings) and their checks; each script adds its own.

Infrastructure, not RL: a learner can skip this file; ``python trainer/train_grpo.py --help`` lists every flag.
"""
import math
import os
import re

import torch

from trainer.infra.checkpoints import sglang_folder
from trainer.infra.files import check_creatable_dir, check_writable_dir
from trainer.infra.lora import add_lora_args, check_lora_args
from trainer.infra.dtypes import DTYPE_CHOICES, DTYPES
from trainer.infra.metrics import TRACKERS
from trainer.infra.reward_models import read_reward_model_config
from trainer.infra.sglang_client import (
    DEFAULT_ROLLOUT_CORRECTION_CAP, ROLLOUT_CORRECTIONS, ROLLOUT_ENGINES, SGLANG_LOGPROB_MODES,
)
from trainer.infra.files import DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, ROOT
from trainer.infra.weights import build_config

DEFAULT_REWARD_MODEL_PATH = os.path.join(ROOT, "out", "reward_model_256")  # trainer/train_reward.py, committed
BUNDLED_TRAIN_DATA = os.path.join(ROOT, "dataset", "rlaif_train.jsonl")
BUNDLED_VAL_DATA = os.path.join(ROOT, "dataset", "rlaif_val.jsonl")
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # a --save_weight: a file name, never a path


def add_bool_flag(parser, name, default=0, help=None):
    """A yes/no flag in MiniMind's 0/1 style: ``--name 1``, ``--name 0``, or a bare ``--name`` (= 1).

    The value is the int 0 or 1; anything else is an argparse error (exit 2) that names the flag.
    """
    parser.add_argument(name, type=int, default=default, choices=[0, 1], nargs="?", const=1, help=help)


def same_file(path, other):
    """True when ``path`` and ``other`` name the same existing file (another spelling of the path counts)."""
    return os.path.isfile(path) and os.path.isfile(other) and os.path.samefile(path, other)


def add_common_rl_args(parser):
    """Flags shared by train_grpo.py and train_ppo.py (same names, same meanings); each script adds its own."""
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR, help="where weights and runs are written")
    parser.add_argument("--run_dir", default="", help="metrics folder (default: {save_dir}/runs/{save_weight}-TIME)")
    parser.add_argument("--data_path", default=BUNDLED_TRAIN_DATA,
                        help="RL prompts, MiniMind's RLAIF JSONL (the assistant turn, if any, is the reference answer)")
    parser.add_argument("--tokenizer_path", default=None,
                        help="tokenizer folder (default: the bundled model/); one named here is trusted for starting "
                             "weights that have no record of their tokenizer")
    parser.add_argument("--from_weight", default="full_sft", help="name in save_dir ({name}_{hidden}.pth) or a path")
    parser.add_argument("--hidden_size", type=int, default=256, help="model width (MiniMind: 512, 768)")
    parser.add_argument("--num_hidden_layers", type=int, default=4, help="model depth")
    add_bool_flag(parser, "--use_moe", help="1: mixture-of-experts MLPs")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the prompts (when --max_steps is 0)")
    parser.add_argument("--max_steps", type=int, default=300, help="stop after this many steps (0 = whole epochs)")
    parser.add_argument("--batch_size", type=int, default=4, help="prompts per step and rank")
    parser.add_argument("--learning_rate", type=float, default=2e-5, help="AdamW learning rate of the policy")
    parser.add_argument("--final_norm_learning_rate", type=float, default=1e-2,
                        help="learning rate of the policy's final RMSNorm gain, which sets how sharp its output "
                             "distribution is (0 = --learning_rate, one group)")
    parser.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="gradient-norm clipping")
    parser.add_argument("--max_seq_len", type=int, default=256, help="prompt tokens kept (from the right)")
    parser.add_argument("--max_gen_len", type=int, default=96, help="most tokens generated per answer")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollout")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling (1.0 = off)")
    parser.add_argument("--top_k", type=int, default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--dtype", default="auto",
                        help="autocast dtype of the policy/critic forwards (weights and log-softmax stay fp32): "
                             f"{', '.join(DTYPE_CHOICES)}; auto = bfloat16 on a CUDA GPU that supports it, float32 "
                             "elsewhere")
    parser.add_argument("--device", default="",
                        help="e.g. cuda:1 or cpu (default: the first GPU if there is one; under torchrun each "
                             "process takes the GPU of its LOCAL_RANK, and cpu keeps them all on the CPU)")
    add_bool_flag(parser, "--use_compile",
                  help="1: torch.compile the training forwards (policy; PPO's critic too), not the rollout's decode")
    parser.add_argument("--num_workers", type=int, default=0,
                        help="DataLoader worker processes that read the prompts (0 = in the training process)")
    parser.add_argument("--thinking_ratio", type=float, default=0.9, help="share of prompts that open <think>")
    parser.add_argument("--reward_model_path", default=DEFAULT_REWARD_MODEL_PATH,
                        help="reward model folder (sequence classification, or get_score remote code), or none")
    parser.add_argument("--reward_batch_size", type=int, default=16, help="answers per reward-model forward")
    parser.add_argument("--reward_device", default="", help="device of the reward model (default: the policy's)")
    parser.add_argument("--reward_dtype", default="", choices=["", *DTYPES],
                        help="dtype of the reward model (default: float16 on a GPU, as upstream MiniMind; the "
                             "policy's weights' dtype on the CPU)")
    add_bool_flag(parser, "--trust_remote_code",
                  help="allow a reward model that runs its own Python code (e.g. internlm2-1_8b-reward)")
    parser.add_argument("--answer_reward_weight", type=float, default=2.0,
                        help="weight of the 0/1 reward for a correct final number")
    parser.add_argument("--rollout_engine", default="torch", help=f"one of {', '.join(ROLLOUT_ENGINES)}")
    parser.add_argument("--sglang_url", "--sglang_base_url", default="http://127.0.0.1:30000",
                        help="server of --rollout_engine sglang (--sglang_base_url: upstream MiniMind's name)")
    parser.add_argument("--sglang_shared_path", default="",
                        help="folder the trainer writes synced weights to and the server reads "
                             "(default {save_dir}/sglang_{save_weight}_{hidden}: one per run; one run per folder)")
    parser.add_argument("--sglang_timeout", type=float, default=120.0,
                        help="seconds a request to the SGLang server may take before the run stops naming the server "
                             "(a CPU server answers a default batch in about 1 s and loads weights in a few)")
    parser.add_argument("--sglang_logprobs", default="recompute", choices=SGLANG_LOGPROB_MODES,
                        help="old log-probs: recomputed by the local policy, or the server's (checked at batch 1)")
    parser.add_argument("--rollout_correction", default="none", choices=ROLLOUT_CORRECTIONS,
                        help="with --sglang_logprobs server: weight each token's loss by pi_trainer / pi_server, per "
                             "token or per answer, truncated at the cap or masked beyond it (TRL's "
                             "vllm_importance_sampling_mode; docs/sglang.md)")
    parser.add_argument("--rollout_correction_cap", type=float, default=DEFAULT_ROLLOUT_CORRECTION_CAP,
                        help="the weight's upper bound C (TRL's vllm_importance_sampling_clip_max, 3.0): *_truncate "
                             "clips at C, *_mask sets weights above C to 0")
    parser.add_argument("--sglang_sync_interval", type=int, default=1,
                        help="push weights to SGLang every N policy updates (N > 1: rollouts up to N-1 updates old)")
    parser.add_argument("--sglang_export_dtype", default="float32", choices=sorted(DTYPES),
                        help="dtype of the weights synced to SGLang")
    parser.add_argument("--eval_data_path", default=None,
                        help="held-out prompts of the periodic evaluation (default: the bundled validation split "
                             "when --data_path is the bundled training data; no evaluation for other data)")
    parser.add_argument("--eval_interval", type=int, default=50,
                        help="held-out evaluation at step 0, every N steps and at the end (0 = off)")
    parser.add_argument("--eval_num_prompts", type=int, default=200,
                        help="held-out prompts per evaluation, each answered sampled and greedy")
    parser.add_argument("--log_interval", type=int, default=1, help="log line and metrics.jsonl every N steps")
    parser.add_argument("--save_interval", type=int, default=50, help="checkpoint and resume file every N steps")
    parser.add_argument("--seed", type=int, default=42, help="data order, initial state and sampling")
    add_bool_flag(parser, "--use_wandb", help="1: also send the metrics to --tracker (wandb or swanlab)")
    parser.add_argument("--tracker", default="wandb", choices=TRACKERS,
                        help="where --use_wandb 1 sends the metrics: wandb, or swanlab (upstream MiniMind's; "
                             "offline unless SWANLAB_MODE says otherwise)")
    parser.add_argument("--wandb_project", default="MiniMind-RL", help="wandb / swanlab project name")
    add_bool_flag(parser, "--debug_mode", help="1: print prompts, answers and reward parts")
    parser.add_argument("--debug_interval", type=int, default=20, help="--debug_mode prints every N steps")
    add_bool_flag(parser, "--from_resume",
                  help="1: continue from {save_dir}/{save_weight}_{hidden}_resume.pth when it exists")
    parser.add_argument("--max_bad_steps", type=int, default=3,
                        help="stop after this many updates in a row skipped for a NaN/inf")
    add_bool_flag(parser, "--allow_data_change",
                  help="1: resume although --data_path differs from the file the run was saved with (the position "
                       "is kept as a count of prompts)")
    add_lora_args(parser)  # --lora_rank R: adapters on the policy, the reference without them (infra/lora.py)


RANGES = {"at_least_1": (lambda v: v >= 1, ">= 1"), "at_least_2": (lambda v: v >= 2, ">= 2"),
          "positive": (lambda v: v > 0, "> 0"), "non_negative": (lambda v: v >= 0, ">= 0"),
          "unit_interval": (lambda v: 0 <= v <= 1, "in [0, 1]")}


def check_ranges(parser, args, **flags_by_range):
    """``parser.error`` (exit 2) naming the first flag outside its range: ``flags_by_range`` maps a key of
    ``RANGES`` (at_least_1, at_least_2, positive, non_negative, unit_interval) to the flags that must lie in it."""
    for range_name, flags in flags_by_range.items():
        inside, text = RANGES[range_name]
        for flag in flags:
            if not inside(getattr(args, flag)):
                parser.error(f"--{flag} must be {text}, got {getattr(args, flag)}")


def check_common_rl_args(parser, args):
    """argparse-style errors (exit 2) for out-of-range shared flags, before any model is built. Also records whether
    ``--tokenizer_path`` was named (``args.tokenizer_path_named``) before filling in its default."""
    args.tokenizer_path_named = int(args.tokenizer_path is not None)
    args.tokenizer_path = args.tokenizer_path or DEFAULT_TOKENIZER_PATH
    for flag in ("batch_size", "max_gen_len", "max_seq_len", "epochs", "log_interval",
                 "save_interval", "debug_interval", "reward_batch_size", "max_bad_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.max_steps < 0:
        parser.error(f"--max_steps must be >= 0, got {args.max_steps}")
    if args.eval_interval < 0 or args.eval_num_prompts < 1:
        parser.error(f"--eval_interval must be >= 0 and --eval_num_prompts >= 1, got {args.eval_interval} and "
                     f"{args.eval_num_prompts}")
    if args.eval_data_path is None:  # the bundled validation prompts fit the bundled training data only
        args.eval_data_path = BUNDLED_VAL_DATA if same_file(args.data_path, BUNDLED_TRAIN_DATA) else ""
    if args.eval_interval and args.eval_data_path and not os.path.isfile(args.eval_data_path):
        parser.error(f"--eval_data_path {args.eval_data_path} does not exist (--eval_interval 0 turns evaluation off)")
    if args.dtype not in DTYPE_CHOICES:
        upstream = (" (upstream MiniMind's fp16 autocast needs a loss scaler, which these scripts do not have)"
                    if args.dtype == "float16" else "")
        parser.error(f"--dtype {args.dtype} is not supported{upstream}; use one of {', '.join(DTYPE_CHOICES)} "
                     f"(bfloat16 on a GPU: its range needs no loss scaler)")
    if args.learning_rate <= 0:
        parser.error(f"--learning_rate must be > 0, got {args.learning_rate}")
    if args.final_norm_learning_rate < 0:
        parser.error(f"--final_norm_learning_rate must be >= 0 (0 = --learning_rate), got "
                     f"{args.final_norm_learning_rate}")
    if args.temperature <= 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top_p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.thinking_ratio <= 1:
        parser.error(f"--thinking_ratio must be in [0, 1], got {args.thinking_ratio}")
    if args.rollout_engine not in ROLLOUT_ENGINES:
        parser.error(f"--rollout_engine {args.rollout_engine!r} is unknown; valid: {', '.join(ROLLOUT_ENGINES)}")
    if not os.path.isfile(args.data_path):
        parser.error(f"--data_path {args.data_path} does not exist")
    if args.num_workers < 0:
        parser.error(f"--num_workers must be >= 0, got {args.num_workers}")
    if args.device:
        try:
            device_type = torch.device(args.device).type
        except RuntimeError:
            parser.error(f"--device {args.device!r} is not a device (e.g. cpu, cuda, cuda:1)")
        if device_type not in ("cpu", "cuda"):
            parser.error(f"--device {args.device!r}: the scripts run on cpu or cuda")
        if device_type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: this machine has no CUDA GPU (torch.cuda.is_available() is False)")
        index = torch.device(args.device).index
        if device_type == "cuda" and index is not None and index >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if args.grad_clip <= 0:
        parser.error(f"--grad_clip must be > 0, got {args.grad_clip}")
    if args.top_k < 0:
        parser.error(f"--top_k must be >= 0 (0 = off), got {args.top_k}")
    if args.reward_model_path != "none":
        try:
            read_reward_model_config(args.reward_model_path, args.trust_remote_code)
        except (OSError, ValueError) as err:
            parser.error(str(err))
    try:
        check_writable_dir(args.save_dir)
    except OSError as err:
        parser.error(f"--save_dir: {err.strerror}")
    save_weight = getattr(args, "save_weight", None)
    if save_weight is not None and not PLAIN_NAME.fullmatch(save_weight):
        parser.error(f"--save_weight must be a plain name (letters, digits, '.', '_', '+', '-'; not a path), got "
                     f"{save_weight!r}: the run writes {{save_dir}}/NAME_{args.hidden_size}.pth; choose the folder "
                     f"with --save_dir")
    if args.run_dir:
        if os.path.lexists(args.run_dir) and not os.path.isdir(args.run_dir):
            parser.error(f"--run_dir {args.run_dir} exists and is not a folder (a file, or a link that leads to no "
                         f"folder); give a folder for the metrics")
        try:
            check_creatable_dir(args.run_dir)  # made by the run, after the checks that need no model
        except OSError as err:
            parser.error(f"--run_dir: {err.strerror}")
    if args.sglang_timeout <= 0:
        parser.error(f"--sglang_timeout must be > 0 seconds, got {args.sglang_timeout}")
    if args.sglang_sync_interval < 1:
        parser.error(f"--sglang_sync_interval must be >= 1, got {args.sglang_sync_interval}")
    if args.rollout_engine == "sglang" and args.use_moe:
        parser.error("--rollout_engine sglang needs a dense model (--use_moe 0): MoE weights have no Qwen3 export")
    if not args.sglang_url.startswith(("http://", "https://")):
        parser.error(f"--sglang_url must start with http:// or https://, got {args.sglang_url!r}")
    check_rollout_correction_args(parser, args)
    check_lora_args(parser, args)


def check_rollout_correction_args(parser, args):
    """Refuse a ``--rollout_correction`` that cannot act, naming the flags that make it act (exit 2)."""
    correction = args.rollout_correction
    if not (math.isfinite(args.rollout_correction_cap) and args.rollout_correction_cap > 0):
        parser.error(f"--rollout_correction_cap must be a finite number > 0, got {args.rollout_correction_cap}")
    if correction == "none":
        return
    if args.rollout_engine != "sglang":
        parser.error(f"--rollout_correction {correction} weighs the trainer's log-probs against an SGLang server's: "
                     f"the torch engine samples with the trainer's own, so there is no mismatch to correct; add "
                     f"--rollout_engine sglang --sglang_logprobs server, or leave --rollout_correction out")
    if args.sglang_logprobs != "server":
        parser.error(f"--rollout_correction {correction} needs the server's log-probs: with --sglang_logprobs "
                     f"{args.sglang_logprobs} the loss never sees them; add --sglang_logprobs server")
    if getattr(args, "loss_type", None) == "vespo" and correction.startswith("sequence"):
        parser.error(f"--loss_type vespo reads the correction's per-token weights inside its gamma weight (TRL): use "
                     f"--rollout_correction token_truncate or token_mask, not {correction}")


def rollout_engine_kwargs(args):
    """Constructor arguments of the ``--rollout_engine`` chosen (chapter 8.2)."""
    kwargs = dict(top_p=args.top_p, top_k=args.top_k)
    if args.rollout_engine == "sglang":
        kwargs.update(
            url=args.sglang_url, shared_path=sglang_folder(args),
            logprobs_mode=args.sglang_logprobs, sync_interval=args.sglang_sync_interval,
            rollout_correction=args.rollout_correction != "none",
            export_dtype=DTYPES[args.sglang_export_dtype],
            timeout_s=args.sglang_timeout,
            vocab_size=build_config(args.hidden_size, args.num_hidden_layers, args.use_moe).vocab_size,
            resume_hint=f"A checkpoint is saved every --save_interval {args.save_interval} steps: rerun the same "
                        f"command with --from_resume 1 to continue from the last one.",
        )
    return kwargs
