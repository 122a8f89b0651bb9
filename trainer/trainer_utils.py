"""Pieces shared by the training scripts: logging, distributed set-up, seeding, model loading,
atomic checkpoints, the reward functions of chapter 8.3 and the k3 KL of chapter 8.6.

Nothing here reads a global: every function takes what it needs as arguments.
"""
import contextlib
import errno
import glob
import json
import math
import os
import random
import re

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from model.hf_qwen3 import DTYPES  # noqa: F401 (the --*_dtype flag values, defined once)
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_TOKENIZER_PATH = os.path.join(ROOT, "model")
DEFAULT_SAVE_DIR = os.path.join(ROOT, "out")
DEFAULT_REWARD_MODEL_PATH = os.path.join(ROOT, "out", "reward_model_256")  # trainer/train_reward.py, committed


# ----------------------------------------------------------------------------- processes and logging


def is_main_process():
    """True on rank 0, or when not running distributed."""
    return not dist.is_initialized() or dist.get_rank() == 0


def Logger(content):
    """Print on the main process only (flushes, so logs show up under torchrun and pipes)."""
    if is_main_process():
        print(content, flush=True)


def init_distributed_mode(device=""):
    """Initialise torch.distributed when launched by torchrun (RANK in the environment).

    Backend: nccl on CUDA (one device per LOCAL_RANK), gloo on CPU.
    Args:
        device: ``--device``: "" = the first GPU if there is one, else the CPU; "cpu" keeps every process on
            the CPU (gloo) even where CUDA exists; "cuda:N" picks the GPU of a single process (under torchrun
            each process takes the GPU of its LOCAL_RANK).
    Returns:
        (local_rank, device): local_rank is 0 without torchrun; device is a string like "cuda:1" or "cpu".
    """
    cuda = torch.cuda.is_available() and device != "cpu"
    if int(os.environ.get("RANK", -1)) == -1:
        device = device or ("cuda:0" if cuda else "cpu")
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(device)  # later calls without an index (bf16 support, memory) mean this GPU
        return 0, device
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(local_rank)
        return local_rank, f"cuda:{local_rank}"
    return local_rank, "cpu"


def setup_seed(seed):
    """Seed the Python, NumPy and torch (CPU and CUDA) RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def add_bool_flag(parser, name, default=0, help=None):
    """A yes/no flag in MiniMind's 0/1 style: ``--name 1``, ``--name 0``, or a bare ``--name`` (= 1).

    The value is the int 0 or 1; anything else is an argparse error (exit 2) that names the flag.
    """
    parser.add_argument(name, type=int, default=default, choices=[0, 1], nargs="?", const=1, help=help)


# ----------------------------------------------------------------------------- models and checkpoints


def weight_path(from_weight, save_dir, hidden_size, use_moe, allow_file=True):
    """MiniMind's naming: ``{save_dir}/{name}_{hidden}[_moe].pth``.

    For loading (``allow_file``): ``from_weight`` itself if it is a file; else the name in ``save_dir``; else,
    when that file does not exist, the name in the repository's ``out/`` (the bundled starting policy), so
    that ``--save_dir runs/exp1`` still starts from ``out/full_sft_256.pth``. When neither exists the path in
    ``save_dir`` is returned (and ``load_weights`` names it). Saves pass ``allow_file=False``: they always
    write into ``save_dir``.
    """
    if allow_file and os.path.isfile(from_weight):
        return from_weight
    suffix = "_moe" if use_moe else ""
    file_name = f"{from_weight}_{hidden_size}{suffix}.pth"
    path = os.path.join(save_dir, file_name)
    bundled = os.path.join(DEFAULT_SAVE_DIR, file_name)
    if allow_file and not os.path.isfile(path) and os.path.isfile(bundled):
        return bundled
    return path


def check_state_dict_fits(path, own, state_dict, flag_hint, may_be_missing=()):
    """Raise unless ``state_dict`` (read from ``path``) has exactly the keys and shapes of ``own`` (a model's
    state dict); keys in ``may_be_missing`` may be absent from ``state_dict`` (a freshly initialised head).

    Raises:
        ValueError: naming ``path``, the parameter, both shapes and ``flag_hint`` on a shape mismatch, or listing
            the missing / unexpected keys (first 8 of each).
    """
    for name, tensor in state_dict.items():
        if name in own and own[name].shape != tensor.shape:
            raise ValueError(
                f"{path}: parameter {name} has shape {tuple(tensor.shape)} but the model built from the flags "
                f"expects {tuple(own[name].shape)}; change {flag_hint} to match the checkpoint"
            )
    missing = sorted(set(own) - set(state_dict) - set(may_be_missing))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"{path}: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}; "
                         f"check {flag_hint}")


def load_weights(model, path, flag_hint="--hidden_size / --num_hidden_layers / --use_moe"):
    """Load a ``.pth`` state dict into ``model`` strictly (weights_only=True).

    Raises:
        FileNotFoundError: if ``path`` is missing; the message lists the ``.pth`` files next to it.
        ValueError: on a shape mismatch (naming the parameter, both shapes and the flags to change) or
            missing/unexpected keys.
    """
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.pth")))
        raise FileNotFoundError(f"weights not found: {path} (in {folder}: {found or 'no .pth files'})")
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
    own = model.state_dict()
    check_state_dict_fits(path, own, state_dict, flag_hint)
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state_dict.items()}, strict=True)


def build_config(hidden_size, num_hidden_layers, use_moe, vocab_size=6400):
    """MiniMindConfig from the architecture flags every script shares."""
    return MiniMindConfig(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                          use_moe=bool(use_moe), vocab_size=vocab_size)


def init_model(lm_config, from_weight="none", save_dir=DEFAULT_SAVE_DIR, tokenizer_path=DEFAULT_TOKENIZER_PATH,
               device="cpu", tokenizer=None):
    """Build a ``MiniMindForCausalLM`` and its tokenizer, loading weights strictly unless from_weight == 'none'.

    Args:
        lm_config: ``MiniMindConfig``.
        from_weight: a weight name resolved as ``{save_dir}/{name}_{hidden}[_moe].pth`` (then in the
            repository's ``out/``, see ``weight_path``), a path to a ``.pth`` file, or 'none' for random init.
        tokenizer: an already loaded tokenizer (then ``tokenizer_path`` is not read again).
    Returns:
        (model fp32 on ``device``, tokenizer)
    Raises:
        FileNotFoundError / ValueError: see ``load_weights``.
    """
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(tokenizer_path)
    model = MiniMindForCausalLM(lm_config)
    if from_weight != "none":
        path = weight_path(from_weight, save_dir, lm_config.hidden_size, lm_config.use_moe)
        load_weights(model, path)
        Logger(f"loaded weights {path}")
    if len(tokenizer) > lm_config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer_path} has {len(tokenizer)} tokens but vocab_size is "
                         f"{lm_config.vocab_size}")
    return model.to(device), tokenizer


def atomic_save(obj, path):
    """torch.save to ``path`` through a temporary file in the same folder, fsync, then os.replace.

    A crash, a SIGKILL or a full disk leaves the previous file at ``path`` intact (a temporary file left by a
    killed writer is removed by the next save to ``path``).
    Raises:
        OSError: naming ``path`` when the folder is not writable or the write fails.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp{os.getpid()}"
    for stale in glob.glob(glob.escape(path) + ".tmp*"):  # left by a process killed mid-write
        os.remove(stale)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch's zip writer reports a full disk as a RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = getattr(err, "strerror", None) or str(err)
        code = getattr(err, "errno", None) or errno.EIO
        raise OSError(code, f"could not save checkpoint to {path}: {reason}") from err


def half_state_dict(model):
    """The model's state dict in fp16 on CPU (MiniMind's release format for ``.pth`` weights)."""
    raw = unwrap_model(model)
    return {k: v.detach().half().cpu() for k, v in raw.state_dict().items()}


def unwrap_model(model):
    """The module inside a DistributedDataParallel (or torch.compile) wrapper."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


# ----------------------------------------------------------------------------- resume, signals, bad steps


def check_writable_dir(path):
    """Create ``path`` if needed and prove a file can be written there.

    Raises:
        OSError: naming ``path`` (not a folder, no permission, read-only or full disk).
    """
    probe = os.path.join(path, f".write_probe{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as err:
        raise OSError(err.errno, f"{path} is not a writable folder: {err.strerror}") from err


def shutdown_distributed():
    """End a distributed run explicitly: a barrier, so that every rank has finished its collectives, then
    ``destroy_process_group``. Callers delete their DistributedDataParallel wrappers first: a wrapper freed
    later, while Python tears down ``main``'s locals, joins gloo's worker threads from its destructor and can
    deadlock on the GIL (pytorch#75097, #56297), so that a finished run never exits. No-op when not distributed.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()


def build_policy_optimizer(model, learning_rate, weight_decay, final_norm_learning_rate):
    """AdamW for an RL policy, with the final RMSNorm gain in a parameter group of its own that learns one number:
    the sharpness of the output distribution (an output temperature).

    The final RMSNorm gain (``model.model.norm.weight``, [hidden], entries ~1) multiplies every logit (the LM
    head is tied to the embeddings and has no bias), so scaling it by c is sampling at temperature 1 / c.
    Adam moves every parameter by about ``learning_rate`` per step whatever its size: at a rate small enough
    that the noisy policy gradient does not wreck the matrices (entries ~0.03), the gain moves by a few
    thousandths of a percent per step and the policy cannot grow more confident in what it already knows.
    With ``final_norm_learning_rate`` > 0 the gain gets that rate, no weight decay, and the flag
    ``scale_only``: ``project_scale_only_gradients`` keeps only the part of its gradient along the gain itself,
    so it is scaled as a whole instead of taking a noisy step in each of its ``hidden`` entries.
    0 keeps one plain AdamW group at ``learning_rate`` (the chapter's optimizer). Both groups follow the same
    schedule (``build_cosine_scheduler``).

    Args:
        model: a MiniMind causal LM (not the DDP wrapper: its parameters are the same objects).
        learning_rate, weight_decay: of every other parameter.
        final_norm_learning_rate: float >= 0.
    Returns:
        torch.optim.AdamW (the fused kernel, ``adamw``); group 0 holds every other parameter, group 1 (when
        used) the gain.
    Raises:
        ValueError: a negative ``final_norm_learning_rate``, or a model without ``model.norm.weight``.
    """
    if final_norm_learning_rate < 0:
        raise ValueError(f"final_norm_learning_rate must be >= 0, got {final_norm_learning_rate}")
    if not final_norm_learning_rate:
        return adamw(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
    final_norm = getattr(getattr(getattr(model, "model", None), "norm", None), "weight", None)
    if final_norm is None:
        raise ValueError(f"{type(model).__name__} has no model.norm.weight for final_norm_learning_rate")
    others = [p for p in model.parameters() if p is not final_norm]
    return adamw([{"params": others, "lr": learning_rate, "weight_decay": weight_decay},
                  {"params": [final_norm], "lr": final_norm_learning_rate, "weight_decay": 0.0, "scale_only": True}],
                 lr=learning_rate)


def adamw(params, **kwargs):
    """``torch.optim.AdamW(params, fused=True, **kwargs)``: the update of Loshchilov & Hutter 2019, as torch's
    default implementation computes it, to float rounding (tests/test_optimizer.py). On the CPU the default
    is a loop of about ten passes over each tensor, the fused kernel one pass; on CUDA the default is the
    multi-tensor (foreach) path, and the fused kernel does the whole update in fewer launches. Raises what
    ``torch.optim.AdamW`` raises (a bad learning rate, parameters on a device without a fused kernel)."""
    return torch.optim.AdamW(params, fused=True, **kwargs)


def load_optimizer_state(optimizer, state):
    """``optimizer.load_state_dict(state)`` that keeps this optimizer's kernel (``fused``, ``foreach``).

    ``load_state_dict`` takes every group option from the saved state, so a checkpoint written by another
    kernel (one from before ``adamw`` was fused) would bring that kernel back, silently. State dicts with
    another number of groups go to ``load_state_dict`` unchanged, which raises its ValueError.
    """
    saved_groups = state["param_groups"]
    if len(saved_groups) == len(optimizer.param_groups):
        kernel_options = [{key: group[key] for key in ("fused", "foreach") if key in group}
                          for group in optimizer.param_groups]
        state = dict(state, param_groups=[dict(saved, **options)
                                          for saved, options in zip(saved_groups, kernel_options)])
    optimizer.load_state_dict(state)


def project_scale_only_gradients(optimizer):
    """For every parameter of a ``scale_only`` group (``build_policy_optimizer``): grad <- (grad . w / w . w) w,
    the gradient of the loss with respect to a common factor c of w = c * w_now, put back along w.

    Call it after the backward (and after DDP has averaged the gradients: the projection is linear and every
    rank holds the same w, so all ranks get the same result) and before clipping and ``optimizer.step()``.
    A parameter without a gradient, or with w = 0, is left alone.
    """
    for group in optimizer.param_groups:
        if not group.get("scale_only"):
            continue
        for param in group["params"]:
            if param.grad is None:
                continue
            weight = param.detach()
            norm_sq = (weight * weight).sum()
            if norm_sq > 0:
                param.grad.copy_((param.grad * weight).sum() / norm_sq * weight)


def cosine_lr(step, total_steps, learning_rate, min_lr_ratio=0.1):
    """Cosine decay from ``learning_rate`` to ``min_lr_ratio * learning_rate`` over ``total_steps`` optimizer steps."""
    progress = min(step / max(total_steps, 1), 1.0)
    return learning_rate * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_cosine_scheduler(optimizer, total_steps, min_lr_ratio=0.1):
    """LambdaLR that follows ``cosine_lr`` (state_dict-able, so a resume restores it)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_lr(step, total_steps, 1.0, min_lr_ratio)
    )


# ----------------------------------------------------------------------------- masks and KL


def completion_mask_from_ids(completion_ids, eos_token_id):
    """Mask of the completion tokens that count: every token up to and including the first EOS.

    completion_ids: long [N, R] -> long [N, R] of 0/1. A row without EOS (truncated) is all ones.
    Everything after the first EOS (padding or stray tokens) is 0.
    """
    is_eos = completion_ids == eos_token_id  # [N, R]
    positions = torch.arange(completion_ids.size(1), device=completion_ids.device).expand_as(completion_ids)
    first_eos = torch.where(is_eos, positions, torch.full_like(positions, completion_ids.size(1))).min(dim=1).values
    return (positions <= first_eos.unsqueeze(1)).long()


def masked_mean(values, mask, dim=None):
    """Mean of ``values`` over positions where mask == 1 (sum / count, count clamped to >= 1); chapter 8.4.2-8.6.

    values, mask: same shape (mask 0/1, any dtype). dim=None averages over all entries -> scalar;
    an int averages along that dimension. An all-zero mask gives 0, never NaN.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1)


def k3_kl(ref_per_token_logps, per_token_logps, mask=None):
    """k3 estimator of KL(pi_theta || pi_ref) per token (Schulman 2020, "Approximating KL divergence"; chapter 8.6).

    k3 = exp(ref - logp) - (ref - logp) - 1, elementwise on [N, R] fp32 log-probs (nats); >= 0, and 0 where
    the two log-probs are equal. With ``mask`` ([N, R] 0/1), the log-ratio is set to 0 at masked positions
    *before* ``exp``, so k3 is 0 there and its gradient is 0, never 0 * inf = NaN (a padded position can
    hold any log-prob, e.g. -95, whose exp overflows).
    """
    log_ratio = ref_per_token_logps - per_token_logps  # [N, R]
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    return torch.exp(log_ratio) - log_ratio - 1


# ----------------------------------------------------------------------------- rewards (chapter 8.3)


def rep_penalty(text, n=3, cap=0.5):
    """n-gram repetition penalty of MiniMind's reward (chapter 8.3), in [0, cap].

    Words and punctuation marks (regex ``\\w+|[^\\w\\s]``, lower-cased) form n-grams; the penalty is
    min(cap, 2 * cap * (#n-grams - #distinct n-grams) / #n-grams), 0 for text with fewer than n tokens.
    """
    tokens = re.findall(r"\w+|[^\w\s]", text.lower())
    ngrams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not ngrams:
        return 0.0
    repeated = len(ngrams) - len(set(ngrams))
    return min(cap, repeated * cap * 2 / len(ngrams))


def split_thinking(response):
    """(thinking, answer): text before / after the first '</think>', or ('', response) without one."""
    if "</think>" in response:
        thinking, answer = response.split("</think>", 1)
        return thinking, answer.strip()
    return "", response.strip()


def rule_reward(response):
    """Rule reward of one response (chapter 8.3), a float.

    +0.5 if 20 <= len(response.strip()) <= 800 else -0.5;
    if the response contains '</think>': +1.0 if 20 <= len(thinking.strip()) <= 300 else -0.5, and
    +0.25 if '</think>' occurs exactly once else -0.25;
    minus ``rep_penalty`` of the answer (the text after '</think>', or the whole response).
    """
    reward = 0.5 if 20 <= len(response.strip()) <= 800 else -0.5
    if "</think>" in response:
        thinking, _ = response.split("</think>", 1)
        reward += 1.0 if 20 <= len(thinking.strip()) <= 300 else -0.5
        reward += 0.25 if response.count("</think>") == 1 else -0.25
    _, answer = split_thinking(response)
    return reward - rep_penalty(answer)


NUMBER_PATTERN = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_number(text):
    """The last number in ``text`` (commas removed), or None. '#### 42' and 'The answer is 42.' -> '42'."""
    matches = NUMBER_PATTERN.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "").rstrip(".")


def answer_reward(response, reference):
    """Verifiable answer reward: 1.0 if the last number of the answer part equals ``reference``, else 0.0.

    ``reference`` "" (no reference answer) gives 0.0. Numbers compare as numbers ("42.0" == "42").
    """
    if not reference:
        return 0.0
    _, answer = split_thinking(response)
    predicted = extract_final_number(answer)
    expected = extract_final_number(reference)
    if predicted is None or expected is None:
        return 0.0
    try:
        return 1.0 if float(predicted) == float(expected) else 0.0
    except ValueError:
        return 0.0


CHAT_TURN_PATTERN = re.compile(r"<\|im_start\|>(system|user|assistant)\s+(.*?)<\|im_end\|>", re.DOTALL)


def prompt_to_messages(prompt):
    """Rebuild [{"role", "content"}] from a chat-templated prompt (the chapter 8.3 regex).

    Every closed ``<|im_start|>role ... <|im_end|>`` turn (system, user, assistant; any number of turns) becomes
    one message with its content stripped; the open generation prompt at the end is not a turn.
    """
    return [{"role": role, "content": content.strip()} for role, content in CHAT_TURN_PATTERN.findall(prompt)]


HISTORY_HEADER = "以上是对话历史。我的新问题是："  # MiniMind's LMForRewardModel.get_score, verbatim


def reward_model_messages(messages, response):
    """The two-turn conversation that the external reward model scores (chapter 8.3, MiniMind's LMForRewardModel).

    Exactly upstream MiniMind's text: every turn before the last becomes a "role: content" line (contents as
    they are, thinking included, as upstream does), and the user turn is
    ``f"{history}\\n以上是对话历史。我的新问题是：\\n{last query}"``, or the last query alone when there is
    no history.
    The assistant turn is the final answer of ``response`` (the text after '</think>', ``split_thinking``).

    Args:
        messages: list of {"role", "content"} of the prompt (``prompt_to_messages``); may be empty.
        response: the sampled completion (str), with or without a thinking part.
    Returns:
        [{"role": "user", "content": str}, {"role": "assistant", "content": str}].
    """
    history_text = "\n".join(f"{m['role']}: {m['content']}" for m in messages[:-1])
    last_query = messages[-1]["content"] if messages else ""
    context = f"{history_text}\n{HISTORY_HEADER}\n{last_query}" if history_text else last_query
    return [{"role": "user", "content": context}, {"role": "assistant", "content": split_thinking(response)[1]}]


def render_reward_text(tokenizer, conversation):
    """(text, add_special_tokens) for a sequence-classification reward model.

    With a chat template the text is ``apply_chat_template(conversation, tokenize=False)`` and the template already
    holds any BOS token (add_special_tokens False); without one, "role: content" lines and the tokenizer's own
    special tokens.
    """
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(conversation, tokenize=False), False
    return "\n".join(f"{m['role']}: {m['content']}" for m in conversation), True


def read_reward_model_config(path, trust_remote_code):
    """Check a reward-model folder before anything is loaded; returns its config.json as a dict.

    An InternLM2 reward model (``auto_map`` naming ``InternLM2ForRewardModel``, upstream MiniMind's default
    ``internlm2-1_8b-reward``) loads without running its code (``trainer/internlm2_reward.py``), so it needs no
    ``trust_remote_code``; it needs the sentencepiece package.

    Raises:
        FileNotFoundError: if ``path`` or its config.json does not exist.
        ValueError: if config.json is not JSON, or the model needs remote code (an ``auto_map`` in config.json)
            and ``trust_remote_code`` is false, or an InternLM2 reward model while sentencepiece is not installed
            (the message gives the pip command).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"--reward_model_path {path} does not exist (use 'none' to disable)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"--reward_model_path {path}: no config.json, not a transformers model folder")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path}:{err.lineno}: invalid JSON ({err.msg})") from err
    from trainer.internlm2_reward import is_internlm2_reward, require_sentencepiece

    if is_internlm2_reward(config):
        try:
            require_sentencepiece(path)
        except ModuleNotFoundError as err:
            raise ValueError(str(err)) from err
    elif config.get("auto_map") and not trust_remote_code:
        raise ValueError(f"--reward_model_path {path} runs its own Python code (auto_map in config.json: "
                         f"{sorted(config['auto_map'])}); pass --trust_remote_code to allow it "
                         f"(after reading that code)")
    return config


TRAIN_DTYPES = ("float32", "bfloat16")
DTYPE_CHOICES = ("auto", *TRAIN_DTYPES)


def resolve_train_dtype(name, device):
    """``--dtype`` as one of ``TRAIN_DTYPES``: "auto" is bfloat16 on a CUDA GPU that supports it (upstream
    MiniMind's default) and float32 elsewhere (a CPU without bf16 matrix units runs bf16 slower than fp32)."""
    if name != "auto":
        return name
    if torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported():
        return "bfloat16"
    return "float32"


def has_bf16_units(device):
    """True where bf16 matrix products run on dedicated units: a CUDA GPU that supports bf16, or a CPU whose
    flags (/proc/cpuinfo) list amx_bf16 or avx512_bf16. Elsewhere bf16 is emulated and slower than fp32."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def autocast_context(device, dtype_name):
    """The context for the policy's (and critic's) forwards under ``--dtype``.

    "auto": ``resolve_train_dtype``. "float32": no autocast. "bfloat16": ``torch.autocast`` on the device's type
    (CPU or CUDA); weights, gradients and optimizer states stay fp32, matrix products run in bf16, and every
    log-softmax of this project casts its logits to fp32 first (``selective_log_softmax``), so log-probs, KL and
    losses are fp32.
    bf16 is only faster on hardware with bf16 matrix units (CUDA GPUs, CPUs with AMX / AVX512-BF16); on a
    CPU without them it is much slower (``scripts/bench.py`` measures both peaks).

    Args:
        device: a torch.device or string ("cpu", "cuda:0").
        dtype_name: one of ``DTYPE_CHOICES``.
    Raises:
        ValueError: for another name.
    """
    if dtype_name not in DTYPE_CHOICES:
        raise ValueError(f"unknown --dtype {dtype_name!r}; valid: {', '.join(DTYPE_CHOICES)}")
    dtype_name = resolve_train_dtype(dtype_name, device)
    if dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[dtype_name])


def resolve_dtype(name, default):
    """torch dtype of a --*_dtype flag value ("float32", "bfloat16", "float16"), or ``default`` for "".

    Raises:
        ValueError: for any other name, listing the valid ones.
    """
    if not name:
        return default
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


class LMForRewardModel:
    """External reward model of chapter 8.3: ``get_scores`` -> one score per answer, clipped to [-3, 3].

    Three kinds load:
      (a) a transformers sequence-classification model with one label (``AutoModelForSequenceClassification``,
          e.g. ``Qwen3ForSequenceClassification`` as written by ``trainer/train_reward.py``): the conversation of
          ``reward_model_messages`` is rendered with the reward model's own chat template and scored in
          right-padded forwards of at most ``batch_size`` answers; the score is the logit at the last non-pad token;
      (b) an InternLM2 reward model (``auto_map`` naming ``InternLM2ForRewardModel``: upstream MiniMind's default
          ``internlm2-1_8b-reward``): loaded into transformers' ``LlamaModel`` without running its remote code
          (``trainer/internlm2_reward.py``) and scored as its ``get_scores`` scores, in chunks of ``batch_size``;
      (c) another remote-code model exposing ``get_score(tokenizer, messages)`` (and optionally the batched
          ``get_scores(tokenizer, list of messages)``, whose result may be a bare float for one conversation);
          loaded with ``AutoModel.from_pretrained(..., trust_remote_code=True)`` only when ``trust_remote_code``.
    Kinds (b) and (c), upstream's interface, score upstream's text (``answer_text``); kind (a) scores the stripped
    final answer, the text ``train_reward.py`` trains on.

    Args:
        path: model folder. device: e.g. "cpu", "cuda:0". dtype: torch dtype of the weights.
        batch_size: answers per forward (``--reward_batch_size``). max_length: tokens kept per answer (from the right,
            so the answer is never cut). trust_remote_code: allow kind (c).
    Raises:
        FileNotFoundError / ValueError: see ``read_reward_model_config`` (and ``InternLM2RewardModel.from_pretrained``
            for kind (b)); ValueError also for a sequence-classification model with more than one label, or a
            remote-code model without ``get_score``.
    """

    def __init__(self, path, device="cpu", dtype=torch.float32, batch_size=16, max_length=2048,
                 trust_remote_code=False):
        from transformers import AutoModel, AutoModelForSequenceClassification

        from trainer.internlm2_reward import InternLM2RewardModel, InternLM2RewardTokenizer, is_internlm2_reward

        config = read_reward_model_config(path, trust_remote_code)
        auto_map = config.get("auto_map") or {}
        if is_internlm2_reward(config):
            self.kind = "internlm2"
            self.tokenizer = InternLM2RewardTokenizer(path)
            self.model = InternLM2RewardModel.from_pretrained(path, config, dtype=dtype)
        elif auto_map and "AutoModelForSequenceClassification" not in auto_map:
            self.kind = "remote"
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=True)
            if not callable(getattr(self.model, "get_score", None)):
                raise ValueError(f"--reward_model_path {path}: {type(self.model).__name__} has no "
                                 f"get_score(tokenizer, messages) and is not a sequence-classification model")
        else:
            self.kind = "classifier"
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code)
            if self.model.config.num_labels != 1:
                raise ValueError(f"--reward_model_path {path}: a reward model has one output label, this one has "
                                 f"{self.model.config.num_labels}")
            if self.tokenizer.pad_token_id is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.tokenizer.padding_side = "right"  # real tokens keep their positions: batched == one by one
            self.tokenizer.truncation_side = "left"  # a long history loses its start, never the answer
            self.model.config.pad_token_id = self.tokenizer.pad_token_id  # the head reads the last non-pad token
        self.model = self.model.to(device).eval()
        self.model.requires_grad_(False)
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length

    @staticmethod
    def score_list(scores, count):
        """``count`` floats from what a remote ``get_scores`` returned: a list, a tensor, or a bare float (its
        ``squeeze().tolist()`` for one conversation). Raises ValueError when the number of scores is not ``count``."""
        values = torch.as_tensor(scores, dtype=torch.float32).reshape(-1).tolist()
        if len(values) != count:
            raise ValueError(f"the reward model's get_scores returned {len(values)} scores for {count} conversations")
        return values

    @staticmethod
    def answer_text(response):
        """The answer text that upstream MiniMind's ``calculate_rewards`` gives the reward model: the text after the
        first '</think>', stripped, or the whole response unchanged when it has no '</think>'."""
        if "</think>" in response:
            return response.split("</think>", 1)[1].strip()
        return response

    @torch.no_grad()
    def raw_scores(self, conversations):
        """Unclipped fp32 scores (list of floats) of conversations ([user, assistant] messages), in chunks."""
        scores = []
        for start in range(0, len(conversations), self.batch_size):
            chunk = conversations[start:start + self.batch_size]
            if self.kind == "internlm2":
                scores.extend(self.model.get_scores(self.tokenizer, chunk, max_length=self.max_length))
            elif self.kind == "remote" and callable(getattr(self.model, "get_scores", None)):
                scores.extend(self.score_list(self.model.get_scores(self.tokenizer, chunk), len(chunk)))
            elif self.kind == "remote":
                scores.extend(float(self.model.get_score(self.tokenizer, c)) for c in chunk)
            else:
                scores.extend(self.classifier_scores(chunk))
        return scores

    def classifier_scores(self, conversations):
        """One right-padded forward of a sequence-classification model over ``conversations`` -> list of floats."""
        rendered = [render_reward_text(self.tokenizer, c) for c in conversations]
        enc = self.tokenizer([text for text, _ in rendered], return_tensors="pt", padding=True, truncation=True,
                             max_length=self.max_length, add_special_tokens=rendered[0][1]).to(self.device)
        logits = self.model(**enc).logits  # [b, 1]
        return logits[:, 0].float().tolist()

    def get_scores(self, messages_list, responses):
        """Scores of a batch of answers (chapter 8.3), each clipped to [-3, 3].

        Args:
            messages_list: list of N message lists (the prompts, ``prompt_to_messages``).
            responses: list of N completions; the final answer is scored (after '</think>'; see the class
                docstring for the text of each kind).
        Returns:
            list of N floats in [-3, 3].
        """
        conversations = [reward_model_messages(m, r) for m, r in zip(messages_list, responses)]
        if self.kind != "classifier":  # upstream's interface: upstream's text
            for conversation, response in zip(conversations, responses):
                conversation[-1]["content"] = self.answer_text(response)
        return [max(min(score, 3.0), -3.0) for score in self.raw_scores(conversations)]

    def get_score(self, messages, response):
        """The score of one answer, clipped to [-3, 3] (the chapter's one-sample interface)."""
        return self.get_scores([messages], [response])[0]


def calculate_rewards(prompts, responses, answers, reward_model, answer_reward_weight):
    """Sequence rewards of a batch (chapter 8.3): rule reward + reward-model score + weighted answer reward.

    Args:
        prompts: list[str] of length N (for GRPO, each prompt repeated num_generations times, in place).
        responses: list[str] of length N, the decoded completions (without the EOS token).
        answers: list[str] of length N, reference answers ("" when a sample has none).
        reward_model: an ``LMForRewardModel`` or None (``--reward_model_path none``).
        answer_reward_weight: weight of ``answer_reward``.
    Returns:
        dict of float32 tensors [N]: "rewards" (the total) and its parts "rule_rewards",
        "reward_model_scores", "answer_rewards".
    """
    rule_rewards = torch.tensor([rule_reward(r) for r in responses], dtype=torch.float32)  # [N]
    answer_rewards = torch.tensor([answer_reward(r, a) for r, a in zip(responses, answers)],
                                  dtype=torch.float32)  # [N]
    reward_model_scores = torch.zeros(len(responses), dtype=torch.float32)  # [N]
    if reward_model is not None:
        messages_list = [prompt_to_messages(p) for p in prompts]
        reward_model_scores = torch.tensor(reward_model.get_scores(messages_list, responses),
                                           dtype=torch.float32)  # [N], one batched call
    rewards = rule_rewards + reward_model_scores + answer_reward_weight * answer_rewards  # [N]
    return {"rewards": rewards, "rule_rewards": rule_rewards, "reward_model_scores": reward_model_scores,
            "answer_rewards": answer_rewards}

