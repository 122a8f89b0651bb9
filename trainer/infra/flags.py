"""Flags the RL scripts share (same names, same meanings), their ``--help`` groups and their checks: a flag's range
is declared with it (``in_range``), checks that involve several flags are ``check_common_rl_args``; each script adds
its own flags to the same groups.

Infrastructure, not RL: a learner can skip this file; ``python trainer/train_grpo.py --help`` lists every flag.
"""

import argparse
import math
import os
import re

import torch

from trainer.infra.checkpoints import sglang_folder
from trainer.infra.files import check_creatable_dir, check_writable_dir
from trainer.infra.lora import add_lora_args, check_lora_args
from trainer.infra.dtypes import DTYPE_CHOICES, DTYPES
from trainer.infra.metrics import TRACKERS
from trainer.infra.optimizer import OPTIMIZERS
from trainer.infra.reward_models import read_reward_model_config
from trainer.infra.sglang_client import ROLLOUT_ENGINES, SGLANG_LOGPROB_MODES
from trainer.infra.files import DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, ROOT
from trainer.infra.weights import ARCHITECTURE_FLAGS, config_from_args, folder_config, is_model_folder

DEFAULT_REWARD_MODEL_PATH = os.path.join(ROOT, "out", "reward_model_256")  # trainer/train_reward.py, committed
# --rollout_correction: the weight pi_trainer / pi_server per token or per answer, truncated or masked at the cap
# (TRL 1.16's vllm_importance_sampling_mode; trainer/grpo_family.py, the rollout correction)
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
DEFAULT_ROLLOUT_CORRECTION_CAP = 3.0  # TRL's vllm_importance_sampling_clip_max
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


def in_range(text, inside):
    """An argparse action that stores a flag's value and refuses one outside its range, at parse time, with
    ``parser.error`` (exit 2): "--flag must be {text}, got {value}". The range is declared with the flag:
    ``add_argument("--batch_size", type=int, action=AT_LEAST_1)``; a default is not checked."""

    class InRange(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            if not inside(values):
                parser.error(f"{option_string} must be {text}, got {values}")
            setattr(namespace, self.dest, values)

    return InRange


AT_LEAST_1 = in_range(">= 1", lambda v: v >= 1)
AT_LEAST_2 = in_range(">= 2", lambda v: v >= 2)
NON_NEGATIVE = in_range(">= 0", lambda v: v >= 0)
POSITIVE = in_range("> 0", lambda v: v > 0)
UNIT_INTERVAL = in_range("in [0, 1]", lambda v: 0 <= v <= 1)
FINITE_POSITIVE = in_range("a finite number > 0", lambda v: math.isfinite(v) and v > 0)

# --help's groups in the order a learner reads them: the chapter's flags first, then what comes after it
FLAG_GROUPS = {
    "data": ("data and model", "the prompts, the tokenizer and the policy the run starts from"),
    "rollout": ("rollout (8.2)", "the answers sampled for each prompt"),
    "rewards": ("rewards (8.3)", "rule reward + reward model + answer reward"),
    "algorithm": ("the algorithm (8.4, 8.5)", "its loss, its updates and their learning rates"),
    "kl": ("KL to the reference (8.6)", None),
    "engine": ("rollout engine", "an SGLang server instead of the policy's own generate (docs/sglang.md)"),
    "family": ("after the chapter", "the GRPO family, the advantage estimators, DAPO's batch techniques"),
    "lora": ("LoRA", "adapters instead of every weight (docs/lora.md)"),
    "memory": ("memory and parallelism", "devices, dtypes, compilation, accumulation"),
    "run": ("run and checkpoints", "length, saving, resuming, the held-out evaluation"),
    "tracking": ("tracking", "metrics, wandb / swanlab, printed samples"),
}


def flag_groups(parser):
    """The argparse groups of an RL script's ``--help`` (``FLAG_GROUPS``, in order), created on ``parser``, whose
    usage line then names no flag (``--help`` lists them by group). Returns {key: group}: ``add_common_rl_args`` and
    each script add their flags to them."""
    parser.usage = "%(prog)s [--flag value ...]  (every flag takes a default; --help lists them by group)"
    return {key: parser.add_argument_group(title, description) for key, (title, description) in FLAG_GROUPS.items()}


def add_common_rl_args(groups):
    """Flags shared by the RL scripts (same names, same meanings), each in its ``flag_groups`` group with its range;
    each script adds its own."""
    data, rollout, rewards, algorithm = groups["data"], groups["rollout"], groups["rewards"], groups["algorithm"]
    engine, memory, run, tracking = groups["engine"], groups["memory"], groups["run"], groups["tracking"]

    data.add_argument(
        "--data_path",
        default=BUNDLED_TRAIN_DATA,
        help="RL prompts, MiniMind's RLAIF JSONL (the assistant turn, if any, is the reference answer)",
    )
    data.add_argument(
        "--tokenizer_path",
        default=None,
        help="tokenizer folder (default: the bundled model/); one named here is trusted for starting "
        "weights that have no record of their tokenizer",
    )
    data.add_argument(
        "--from_weight",
        default="full_sft",
        help="name in save_dir ({name}_{hidden}.pth), a .pth path, or a transformers Qwen3ForCausalLM folder (its "
        "config.json sets the architecture, its tokenizer files the tokenizer; the run also saves such a folder)",
    )
    data.add_argument("--hidden_size", type=int, default=256, help="model width (MiniMind: 512, 768)")
    data.add_argument("--num_hidden_layers", type=int, default=4, help="model depth")
    add_bool_flag(data, "--use_moe", help="1: mixture-of-experts MLPs")
    for name, what in (
        ("--num_attention_heads", "attention heads (MiniMind: 8)"),
        ("--num_key_value_heads", "key/value heads (MiniMind: 4)"),
        ("--head_dim", "width of a head (MiniMind: hidden_size / heads)"),
        ("--intermediate_size", "MLP width (MiniMind: hidden_size x pi, rounded up to 64)"),
    ):
        data.add_argument(name, type=int, default=None, action=AT_LEAST_1, help=f"{what}; a model folder sets it")
    data.add_argument("--vocab_size", type=int, default=6400, action=AT_LEAST_1, help="embedding rows (MiniMind: 6400)")
    data.add_argument(
        "--max_seq_len", type=int, default=256, action=AT_LEAST_1, help="prompt tokens kept (from the right)"
    )
    data.add_argument(
        "--thinking_ratio", type=float, default=0.9, action=UNIT_INTERVAL, help="share of prompts that open <think>"
    )
    data.add_argument(
        "--num_workers",
        type=int,
        default=0,
        action=NON_NEGATIVE,
        help="DataLoader worker processes that read the prompts (0 = in the training process)",
    )

    rollout.add_argument("--batch_size", type=int, default=4, action=AT_LEAST_1, help="prompts per step and rank")
    rollout.add_argument(
        "--max_gen_len", type=int, default=96, action=AT_LEAST_1, help="most tokens generated per answer"
    )
    rollout.add_argument(
        "--temperature", type=float, default=1.0, action=POSITIVE, help="sampling temperature of the rollout"
    )
    rollout.add_argument(
        "--top_p",
        type=float,
        default=1.0,
        action=in_range("in (0, 1]", lambda v: 0 < v <= 1),
        help="nucleus sampling (1.0 = off)",
    )
    rollout.add_argument(
        "--top_k",
        type=int,
        default=0,
        action=in_range(">= 0 (0 = off)", lambda v: v >= 0),
        help="top-k sampling (0 = off)",
    )

    rewards.add_argument(
        "--reward_model_path",
        default=DEFAULT_REWARD_MODEL_PATH,
        help="reward model folder (sequence classification, or get_score remote code), or none",
    )
    rewards.add_argument(
        "--reward_batch_size", type=int, default=16, action=AT_LEAST_1, help="answers per reward-model forward"
    )
    rewards.add_argument("--reward_device", default="", help="device of the reward model (default: the policy's)")
    rewards.add_argument(
        "--reward_dtype",
        default="",
        choices=["", *DTYPES],
        help="dtype of the reward model (default: float16 on a GPU, as upstream MiniMind; the "
        "policy's weights' dtype on the CPU)",
    )
    add_bool_flag(
        rewards,
        "--trust_remote_code",
        help="allow a reward model that runs its own Python code (e.g. internlm2-1_8b-reward)",
    )
    rewards.add_argument(
        "--answer_reward_weight",
        type=float,
        default=2.0,
        action=NON_NEGATIVE,
        help="weight of the 0/1 reward for a correct final number",
    )

    algorithm.add_argument(
        "--learning_rate", type=float, default=2e-5, action=POSITIVE, help="AdamW learning rate of the policy"
    )
    algorithm.add_argument(
        "--final_norm_learning_rate",
        type=float,
        default=1e-2,
        action=in_range(">= 0 (0 = --learning_rate)", lambda v: v >= 0),
        help="learning rate of the policy's final RMSNorm gain, which sets how sharp its output "
        "distribution is (0 = --learning_rate, one group)",
    )
    algorithm.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    algorithm.add_argument("--grad_clip", type=float, default=1.0, action=POSITIVE, help="gradient-norm clipping")

    engine.add_argument("--rollout_engine", default="torch", help=f"one of {', '.join(ROLLOUT_ENGINES)}")
    engine.add_argument(
        "--sglang_url",
        "--sglang_base_url",
        default="http://127.0.0.1:30000",
        help="server of --rollout_engine sglang (--sglang_base_url: upstream MiniMind's name)",
    )
    engine.add_argument(
        "--sglang_shared_path",
        default="",
        help="folder the trainer writes synced weights to and the server reads "
        "(default {save_dir}/sglang_{save_weight}_{hidden}: one per run; one run per folder)",
    )
    engine.add_argument(
        "--sglang_timeout",
        type=float,
        default=120.0,
        action=in_range("> 0 seconds", lambda v: v > 0),
        help="seconds a request to the SGLang server may take before the run stops naming the server "
        "(a CPU server answers a default batch in about 1 s and loads weights in a few)",
    )
    engine.add_argument(
        "--sglang_logprobs",
        default="recompute",
        choices=SGLANG_LOGPROB_MODES,
        help="old log-probs: recomputed by the local policy, or the server's (checked at batch 1)",
    )
    engine.add_argument(
        "--rollout_correction",
        default="none",
        choices=ROLLOUT_CORRECTIONS,
        help="with --sglang_logprobs server: weight each token's loss by pi_trainer / pi_server, per "
        "token or per answer, truncated at the cap or masked beyond it (TRL's "
        "vllm_importance_sampling_mode; docs/sglang.md)",
    )
    engine.add_argument(
        "--rollout_correction_cap",
        type=float,
        default=DEFAULT_ROLLOUT_CORRECTION_CAP,
        action=FINITE_POSITIVE,
        help="the weight's upper bound C (TRL's vllm_importance_sampling_clip_max, 3.0): *_truncate "
        "clips at C, *_mask sets weights above C to 0",
    )
    engine.add_argument(
        "--sglang_sync_interval",
        type=int,
        default=1,
        action=AT_LEAST_1,
        help="push weights to SGLang every N policy updates (N > 1: rollouts up to N-1 updates old)",
    )
    engine.add_argument(
        "--sglang_export_dtype", default="float32", choices=sorted(DTYPES), help="dtype of the weights synced to SGLang"
    )

    add_lora_args(groups["lora"])  # --lora_rank R: adapters on the policy, the reference without them (infra/lora.py)

    memory.add_argument(
        "--dtype",
        default="auto",
        help="autocast dtype of the policy/critic forwards (weights and log-softmax stay fp32): "
        f"{', '.join(DTYPE_CHOICES)}; auto = bfloat16 on a CUDA GPU that supports it, float32 "
        "elsewhere",
    )
    memory.add_argument(
        "--device",
        default="",
        help="e.g. cuda:1 or cpu (default: the first GPU if there is one; under torchrun each "
        "process takes the GPU of its LOCAL_RANK, and cpu keeps them all on the CPU)",
    )
    add_bool_flag(
        memory,
        "--use_compile",
        help="1: torch.compile the training forwards (policy; PPO's critic too), not the rollout's decode",
    )
    add_bool_flag(
        memory,
        "--gradient_checkpointing",
        help="1: the policy (and PPO's critic) keep each block's input only and recompute the block in the "
        "backward (transformers' activation checkpointing, non-reentrant): less memory, about a third more compute",
    )
    add_bool_flag(
        memory,
        "--fsdp",
        help="1 (under torchrun): shard the policy, the reference and PPO's critic over the ranks with PyTorch's FSDP2 "
        "(each rank keeps 1/N of the weights, gradients and AdamW state; docs/distributed.md); 0: every rank a whole "
        "copy (DDP)",
    )
    add_bool_flag(
        memory,
        "--fsdp_reshard_after_forward",
        default=1,
        help="with --fsdp 1: 1 frees each decoder layer's gathered weights after its forward and gathers them again in "
        "the backward (less memory); 0 keeps them until the backward (one all-gather less per layer)",
    )
    add_bool_flag(
        memory,
        "--fsdp_cpu_offload",
        help="with --fsdp 1: keep the shards, their gradients and AdamW state in CPU memory and step there (for a GPU "
        "whose memory is the limit; slower)",
    )
    memory.add_argument(
        "--micro_batch_size",
        type=int,
        default=0,
        action=NON_NEGATIVE,
        help="answers per forward and backward in the update (GRPO) and per forward of the reference's log-probs "
        "(and PPO's values); the same update (0 = the whole batch at once; the agent script takes 0)",
    )
    memory.add_argument(
        "--logprob_chunk_size",
        type=int,
        default=0,
        action=NON_NEGATIVE,
        help="tokens whose logits exist at once in the log-prob forwards, recomputed in the backward "
        "(0 = every token's at once: the chapter's forward; 1024 keeps a 151,936-token vocabulary near 0.6 GB)",
    )
    memory.add_argument(
        "--optimizer",
        default="adamw",
        choices=OPTIMIZERS,
        help="adamw: torch's fused AdamW, moments in fp32 (8 bytes per parameter); adamw_8bit: torchao's AdamW8bit, "
        "moments in 8 bits (2 bytes per parameter; needs pip install torchao==0.18.0, not in requirements.txt: once "
        "installed, peft imports it in every run and it prints load warnings)",
    )
    memory.add_argument(
        "--ref_dtype",
        default="",
        choices=["", *DTYPES],
        help="dtype of the frozen reference's weights (default: the policy's, float32); bfloat16 halves them",
    )

    run.add_argument("--save_dir", default=DEFAULT_SAVE_DIR, help="where weights and runs are written")
    run.add_argument(
        "--epochs", type=int, default=1, action=AT_LEAST_1, help="passes over the prompts (when --max_steps is 0)"
    )
    run.add_argument(
        "--max_steps", type=int, default=300, action=NON_NEGATIVE, help="stop after this many steps (0 = whole epochs)"
    )
    run.add_argument(
        "--save_interval", type=int, default=50, action=AT_LEAST_1, help="checkpoint and resume file every N steps"
    )
    run.add_argument("--seed", type=int, default=42, help="data order, initial state and sampling")
    add_bool_flag(
        run, "--from_resume", help="1: continue from {save_dir}/{save_weight}_{hidden}_resume.pth when it exists"
    )
    run.add_argument(
        "--max_bad_steps",
        type=int,
        default=3,
        action=AT_LEAST_1,
        help="stop after this many updates in a row skipped for a NaN/inf",
    )
    add_bool_flag(
        run,
        "--allow_data_change",
        help="1: resume although --data_path differs from the file the run was saved with (the position "
        "is kept as a count of prompts)",
    )
    run.add_argument(
        "--eval_data_path",
        default=None,
        help="held-out prompts of the periodic evaluation (default: the bundled validation split "
        "when --data_path is the bundled training data; no evaluation for other data)",
    )
    run.add_argument(
        "--eval_interval",
        type=int,
        default=50,
        action=NON_NEGATIVE,
        help="held-out evaluation at step 0, every N steps and at the end (0 = off)",
    )
    run.add_argument(
        "--eval_num_prompts",
        type=int,
        default=200,
        action=AT_LEAST_1,
        help="held-out prompts per evaluation, each answered sampled and greedy",
    )

    tracking.add_argument("--run_dir", default="", help="metrics folder (default: {save_dir}/runs/{save_weight}-TIME)")
    tracking.add_argument(
        "--log_interval", type=int, default=1, action=AT_LEAST_1, help="log line and metrics.jsonl every N steps"
    )
    add_bool_flag(tracking, "--use_wandb", help="1: also send the metrics to --tracker (wandb or swanlab)")
    tracking.add_argument(
        "--tracker",
        default="wandb",
        choices=TRACKERS,
        help="where --use_wandb 1 sends the metrics: wandb, or swanlab (upstream MiniMind's; "
        "offline unless SWANLAB_MODE says otherwise)",
    )
    tracking.add_argument("--wandb_project", default="MiniMind-RL", help="wandb / swanlab project name")
    add_bool_flag(tracking, "--debug_mode", help="1: print prompts, answers and reward parts")
    tracking.add_argument(
        "--debug_interval", type=int, default=20, action=AT_LEAST_1, help="--debug_mode prints every N steps"
    )


def check_common_rl_args(parser, args):
    """argparse-style errors (exit 2) for the shared flags that involve files, devices or other flags, before any
    model is built. Also records whether ``--tokenizer_path`` was named (``args.tokenizer_path_named``) before filling
    in its default."""
    args.tokenizer_path_named = int(args.tokenizer_path is not None)
    if is_model_folder(args.from_weight):
        use_model_folder(parser, args)
    args.tokenizer_path = args.tokenizer_path or DEFAULT_TOKENIZER_PATH
    if args.eval_data_path is None:  # the bundled validation prompts fit the bundled training data only
        args.eval_data_path = BUNDLED_VAL_DATA if same_file(args.data_path, BUNDLED_TRAIN_DATA) else ""
    if args.eval_interval and args.eval_data_path and not os.path.isfile(args.eval_data_path):
        parser.error(f"--eval_data_path {args.eval_data_path} does not exist (--eval_interval 0 turns evaluation off)")
    if args.dtype not in DTYPE_CHOICES:
        upstream = (
            " (upstream MiniMind's fp16 autocast needs a loss scaler, which these scripts do not have)"
            if args.dtype == "float16"
            else ""
        )
        parser.error(
            f"--dtype {args.dtype} is not supported{upstream}; use one of {', '.join(DTYPE_CHOICES)} "
            f"(bfloat16 on a GPU: its range needs no loss scaler)"
        )
    if args.rollout_engine not in ROLLOUT_ENGINES:
        parser.error(f"--rollout_engine {args.rollout_engine!r} is unknown; valid: {', '.join(ROLLOUT_ENGINES)}")
    if not os.path.isfile(args.data_path):
        parser.error(f"--data_path {args.data_path} does not exist")
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
        parser.error(
            f"--save_weight must be a plain name (letters, digits, '.', '_', '+', '-'; not a path), got "
            f"{save_weight!r}: the run writes {{save_dir}}/NAME_{args.hidden_size}.pth; choose the folder "
            f"with --save_dir"
        )
    if args.run_dir:
        if os.path.lexists(args.run_dir) and not os.path.isdir(args.run_dir):
            parser.error(
                f"--run_dir {args.run_dir} exists and is not a folder (a file, or a link that leads to no "
                f"folder); give a folder for the metrics"
            )
        try:
            check_creatable_dir(args.run_dir)  # made by the run, after the checks that need no model
        except OSError as err:
            parser.error(f"--run_dir: {err.strerror}")
    if args.rollout_engine == "sglang" and args.use_moe:
        parser.error("--rollout_engine sglang needs a dense model (--use_moe 0): MoE weights have no Qwen3 export")
    if not args.sglang_url.startswith(("http://", "https://")):
        parser.error(f"--sglang_url must start with http:// or https://, got {args.sglang_url!r}")
    if args.optimizer == "adamw_8bit":  # before any model is built; it also lets a resume file's 8-bit state load
        try:
            import torchao.optim  # noqa: F401  (registers its state tensors with torch.load(weights_only=True))
        except ImportError as err:
            parser.error(f"--optimizer adamw_8bit needs torchao: pip install torchao==0.18.0 ({err})")
    if args.ref_dtype and args.lora_rank:
        parser.error(
            f"--ref_dtype {args.ref_dtype} with --lora_rank {args.lora_rank}: the reference is the policy with its "
            f"adapters switched off, one model in the policy's dtype; leave --ref_dtype out"
        )
    check_fsdp_args(parser, args)
    check_rollout_correction_args(parser, args)
    check_lora_args(parser, args)


def check_fsdp_args(parser, args):
    """argparse-style errors for ``--fsdp 1`` with what it does not take, and its own flags without it."""
    if not args.fsdp:
        if args.fsdp_cpu_offload or not args.fsdp_reshard_after_forward:
            parser.error("--fsdp_cpu_offload and --fsdp_reshard_after_forward act with --fsdp 1 only: add --fsdp 1")
        return
    if "RANK" not in os.environ:
        parser.error(
            "--fsdp 1 shards the models over the processes of torchrun: run it as torchrun --nproc_per_node N "
            "trainer/... --fsdp 1 (one process holds a whole model anyway)"
        )
    if args.lora_rank:
        parser.error(
            f"--fsdp 1 with --lora_rank {args.lora_rank}: LoRA already leaves the frozen base without gradients or "
            f"AdamW state (its trainable adapters are about 1% of it), which is most of what sharding saves; run "
            f"LoRA under DDP (--fsdp 0), or train every weight with --fsdp 1"
        )
    if args.use_compile:
        parser.error(
            "--use_compile 1 with --fsdp 1: these scripts compile the DDP forward only; leave --use_compile out"
        )
    if args.use_moe:
        parser.error(
            "--use_moe 1 with --fsdp 1: an expert that got no token on one rank has no gradient there, so the ranks "
            "would reduce different sets of gradients; run MoE under DDP (--fsdp 0), which is told to expect them"
        )
    if args.optimizer != "adamw":
        parser.error(
            f"--optimizer {args.optimizer} with --fsdp 1: only torch's AdamW state is saved and loaded sharded here; "
            f"use --optimizer adamw (its state is sharded too: 4 bytes per parameter per rank with 2 ranks)"
        )


def use_model_folder(parser, args):
    """``--from_weight FOLDER`` (a ``Qwen3ForCausalLM`` folder): the architecture flags take the folder's values
    (a flag given with another value is an error naming both), and the tokenizer is the folder's own unless
    ``--tokenizer_path`` is named."""
    try:
        config = folder_config(args.from_weight)
    except ValueError as err:
        parser.error(str(err))
    for name in ("hidden_size", "num_hidden_layers", "vocab_size", *ARCHITECTURE_FLAGS):
        given, folder_value = getattr(args, name), getattr(config, name)
        if given is not None and given != parser.get_default(name) and given != folder_value:
            parser.error(
                f"--{name} {given} but --from_weight {args.from_weight} holds a model of {name} {folder_value} "
                f"(its config.json sets the architecture): leave --{name} out"
            )
        setattr(args, name, folder_value)
    args.use_moe = 0
    has_tokenizer = any(
        os.path.isfile(os.path.join(args.from_weight, name)) for name in ("tokenizer.json", "tokenizer_config.json")
    )
    if args.tokenizer_path is None and has_tokenizer:
        args.tokenizer_path = args.from_weight
        args.tokenizer_path_named = 1  # the model's own tokenizer


def check_rollout_correction_args(parser, args):
    """Refuse a ``--rollout_correction`` that cannot act, naming the flags that make it act (exit 2)."""
    correction = args.rollout_correction
    if correction == "none":
        return
    if args.rollout_engine != "sglang":
        parser.error(
            f"--rollout_correction {correction} weighs the trainer's log-probs against an SGLang server's: "
            f"the torch engine samples with the trainer's own, so there is no mismatch to correct; add "
            f"--rollout_engine sglang --sglang_logprobs server, or leave --rollout_correction out"
        )
    if args.sglang_logprobs != "server":
        parser.error(
            f"--rollout_correction {correction} needs the server's log-probs: with --sglang_logprobs "
            f"{args.sglang_logprobs} the loss never sees them; add --sglang_logprobs server"
        )
    if getattr(args, "loss_type", None) == "vespo" and correction.startswith("sequence"):
        parser.error(
            f"--loss_type vespo reads the correction's per-token weights inside its gamma weight (TRL): use "
            f"--rollout_correction token_truncate or token_mask, not {correction}"
        )


def rollout_engine_kwargs(args):
    """Constructor arguments of the ``--rollout_engine`` chosen (chapter 8.2)."""
    kwargs = dict(top_p=args.top_p, top_k=args.top_k)
    if args.rollout_engine == "sglang":
        kwargs.update(
            url=args.sglang_url,
            shared_path=sglang_folder(args),
            logprobs_mode=args.sglang_logprobs,
            sync_interval=args.sglang_sync_interval,
            rollout_correction=args.rollout_correction != "none",
            export_dtype=DTYPES[args.sglang_export_dtype],
            timeout_s=args.sglang_timeout,
            vocab_size=config_from_args(args).vocab_size,
            resume_hint=f"A checkpoint is saved every --save_interval {args.save_interval} steps: rerun the same "
            f"command with --from_resume 1 to continue from the last one.",
        )
    return kwargs
