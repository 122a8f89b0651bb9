"""MiniMind models from the flags, and their weights on disk: ``.pth`` names, strict loads, the policy of a run, the
fp16 files a run saves; the record of the tokenizer a checkpoint was trained with, checked at start.

Infrastructure, not RL: a learner can skip this file.
"""

import copy
import functools
import glob
import hashlib
import json
import os
import pickle
import re

import torch
from transformers import AutoTokenizer, Qwen3Config

from model.hf_qwen3 import load_qwen3_folder, minimind_config_from_qwen3, write_qwen3_folder
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from trainer.infra.distributed import Logger, unwrap_model
from trainer.infra.dtypes import resolve_dtype
from trainer.infra.files import DEFAULT_SAVE_DIR, DEFAULT_TOKENIZER_PATH, atomic_write, weight_path
from trainer.infra.errors import InputError
from trainer.infra.lora import adapter_folder, base_model, has_adapters, merged_state_dict, save_adapters


MERGE_HINT = (
    "merge the adapters into their base first (python scripts/convert_model.py merge_lora --adapter "
    "FOLDER --out merged.pth) and pass --from_weight merged.pth, with --lora_rank for new adapters on it"
)


def minimind_dims(state_dict):
    """The architecture flags a MiniMind state dict was trained with, read from its tensors' names and shapes:
    {"hidden_size", "num_hidden_layers", "use_moe", "vocab_size"}, or None when it is not a MiniMind state dict
    (no ``model.embed_tokens.weight``)."""
    embed = state_dict.get("model.embed_tokens.weight")
    if embed is None or embed.dim() != 2:
        return None
    layers = {int(name.split(".")[2]) for name in state_dict if name.startswith("model.layers.")}
    return {
        "hidden_size": int(embed.shape[1]),
        "num_hidden_layers": len(layers),
        "use_moe": int(any(".mlp.experts." in name for name in state_dict)),
        "vocab_size": int(embed.shape[0]),
    }


def describe_dims(dims):
    """'hidden_size 768, 8 layers, dense, vocab 6400' for ``minimind_dims``'s dict."""
    return (
        f"hidden_size {dims['hidden_size']}, {dims['num_hidden_layers']} layers, "
        f"{'MoE' if dims['use_moe'] else 'dense'}, vocab {dims['vocab_size']}"
    )


def check_state_dict_fits(path, own, state_dict, flag_hint, may_be_missing=()):
    """Raise unless ``state_dict`` (read from ``path``) has exactly the keys and shapes of ``own`` (a model's
    state dict); keys in ``may_be_missing`` may be absent from ``state_dict`` (a freshly initialised head).

    Raises:
        ValueError: naming ``path``, the parameter, both shapes and ``flag_hint`` on a shape mismatch, or listing
            the missing / unexpected keys (first 8 of each).
    """
    dims = minimind_dims(state_dict)
    found = ""
    if dims is not None:  # what the checkpoint holds, as the flags that build it
        flags = f"--hidden_size {dims['hidden_size']} --num_hidden_layers {dims['num_hidden_layers']}"
        found = f" ({path} holds a MiniMind of {describe_dims(dims)}: pass {flags} --use_moe {dims['use_moe']})"
    for name, tensor in state_dict.items():
        if name in own and own[name].shape != tensor.shape:
            raise InputError(
                f"{path}: parameter {name} has shape {tuple(tensor.shape)} but the model built from the flags "
                f"expects {tuple(own[name].shape)}; change {flag_hint} to match the checkpoint{found}"
            )
    missing = sorted(set(own) - set(state_dict) - set(may_be_missing))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise InputError(
            f"{path}: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}; check {flag_hint}{found}"
        )


def load_tensors_only(path, mmap=False):
    """``torch.load(path, weights_only=True)`` on the CPU (``mmap``: tensors read when used).

    Raises:
        ValueError: naming ``path`` when the file holds pickled Python objects besides tensors (never run: unpickling
            them could run any code), with the way on.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL [\w.]+", str(err))
        raise InputError(
            f"{path} holds Python objects besides tensors "
            f"({found[0] if found else 'a pickle weights_only refuses'});"
            f" it is not loaded, since unpickling it could run code. If you trust the file, load it once "
            f"with torch.load(weights_only=False) and torch.save its state_dict()"
        ) from None


ARCHITECTURE_HINT = (
    "--hidden_size / --num_hidden_layers / --use_moe (and --num_attention_heads / --num_key_value_heads / "
    "--head_dim / --intermediate_size / --vocab_size where a model is not MiniMind's shape)"
)


def load_weights(model, path, flag_hint=ARCHITECTURE_HINT):
    """Load a ``.pth`` state dict into ``model`` strictly (weights_only=True), refusing a damaged file.

    Raises:
        FileNotFoundError: if ``path`` is missing; the message lists the ``.pth`` files next to it.
        ValueError: naming ``path`` when it cannot be read as a state dict (a truncated or foreign file), when a
            tensor holds a NaN or inf (a file damaged on disk: naming the tensor and how many values), on a shape
            mismatch (naming the parameter, both shapes and the flags to change) or missing/unexpected keys, and
            when the file is a peft state dict whose LoRA adapters are not merged in (``MERGE_HINT``).
    """
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.pth")))
        raise FileNotFoundError(f"weights not found: {path} (in {folder}: {found or 'no .pth files'})")
    try:
        state_dict = load_tensors_only(path)
    except ValueError:
        raise
    except Exception as err:  # torch raises RuntimeError, pickle errors, EOFError... for a damaged file
        raise InputError(
            f"{path} cannot be read as MiniMind weights ({type(err).__name__}: {err}); the file is "
            f"truncated or not a .pth state dict: copy it again or pass another --from_weight"
        ) from err
    if not isinstance(state_dict, dict):
        raise InputError(f"{path} holds a {type(state_dict).__name__}, not a state dict of MiniMind weights")
    adapter_keys = [key for key in state_dict if ".lora_A." in key or ".lora_B." in key]
    if adapter_keys:  # a peft model's state dict: the adapters are not merged into the weights
        raise InputError(
            f"{path} holds LoRA adapters ({adapter_keys[0]}, ...), not merged MiniMind weights: {MERGE_HINT}"
        )
    check_finite_state(state_dict, f"{path} (a damaged file? copy it again)", "refusing to load")
    own = model.state_dict()
    check_state_dict_fits(path, own, state_dict, flag_hint)
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state_dict.items()}, strict=True)


def build_config(hidden_size, num_hidden_layers, use_moe, vocab_size=6400, **architecture):
    """MiniMindConfig from the architecture flags every script shares; ``architecture``: more ``MiniMindConfig``
    fields (num_attention_heads, num_key_value_heads, head_dim, intermediate_size), None keeping MiniMind's default."""
    given = {name: value for name, value in architecture.items() if value is not None}
    return MiniMindConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        use_moe=bool(use_moe),
        vocab_size=vocab_size,
        **given,
    )


ARCHITECTURE_FLAGS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


def is_model_folder(from_weight):
    """Whether ``--from_weight`` names a transformers model folder (a folder holding config.json)."""
    return os.path.isfile(os.path.join(from_weight, "config.json"))


def config_from_args(args):
    """The run's ``MiniMindConfig``: a ``Qwen3ForCausalLM`` folder's own (``--from_weight FOLDER``: its config.json,
    every field), else the architecture flags (``--hidden_size``, ``--num_hidden_layers``, ``--use_moe``,
    ``--vocab_size`` and ``ARCHITECTURE_FLAGS``). Raises ValueError naming config.json for a folder that is not a
    dense Qwen3 causal LM."""
    if is_model_folder(args.from_weight):
        return folder_config(args.from_weight)
    architecture = {name: getattr(args, name, None) for name in ARCHITECTURE_FLAGS}
    return build_config(
        args.hidden_size, args.num_hidden_layers, args.use_moe, getattr(args, "vocab_size", 6400), **architecture
    )


def start_weight_path(args):
    """The ``.pth`` a run starts from (``weight_path`` of ``--from_weight``), or None for random weights ("none") and a
    model folder (whose tokenizer is its own): the file ``load_tokenizer`` checks the tokenizer against."""
    if args.from_weight == "none" or is_model_folder(args.from_weight):
        return None
    return weight_path(args.from_weight, args.save_dir, args.hidden_size, args.use_moe)


def folder_config(folder):
    """``MiniMindConfig`` of a ``Qwen3ForCausalLM`` folder's config.json. Raises InputError naming the file when it is
    not a dense Qwen3 causal LM (``minimind_config_from_qwen3``) or cannot be read."""
    config_path = os.path.join(folder, "config.json")
    try:
        return minimind_config_from_qwen3(Qwen3Config.from_pretrained(folder), config_path)
    except (OSError, ValueError) as err:
        raise InputError(f"--from_weight {folder}: {err}") from None


def init_model(
    lm_config,
    from_weight="none",
    save_dir=DEFAULT_SAVE_DIR,
    tokenizer_path=DEFAULT_TOKENIZER_PATH,
    device="cpu",
    tokenizer=None,
):
    """Build a ``MiniMindForCausalLM`` and its tokenizer, loading weights strictly unless from_weight == 'none'.

    Args:
        lm_config: ``MiniMindConfig``.
        from_weight: a weight name resolved as ``{save_dir}/{name}_{hidden}[_moe].pth`` (then in the
            repository's ``out/``, see ``weight_path``), a path to a ``.pth`` file, or 'none' for random init.
        tokenizer: an already loaded tokenizer (then ``tokenizer_path`` is not read again).
    Returns:
        (model fp32 on ``device``, tokenizer)
    Raises:
        FileNotFoundError / ValueError: see ``load_weights``; ValueError when ``from_weight`` is a LoRA adapter
            folder (the way on: ``MERGE_HINT``).
    """
    if os.path.isfile(os.path.join(from_weight, "adapter_config.json")):
        raise InputError(f"--from_weight {from_weight} is a LoRA adapter folder, not MiniMind weights: {MERGE_HINT}")
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(tokenizer_path)
    model = MiniMindForCausalLM(lm_config)
    if is_model_folder(from_weight):  # a Qwen3ForCausalLM folder: its safetensors, strictly
        load_folder_weights(model, from_weight)
        Logger(f"loaded the model folder {from_weight} ({describe_dims(minimind_dims(model.state_dict()))})")
    elif from_weight != "none":
        path = weight_path(from_weight, save_dir, lm_config.hidden_size, lm_config.use_moe)
        load_weights(model, path)
        Logger(f"loaded weights {path} ({describe_dims(minimind_dims(model.state_dict()))})")
        sizes = re.compile(rf"{re.escape(from_weight)}_\d+(_moe)?\.pth")  # other sizes of this weight, not ppo_critic
        others = sorted(
            p
            for p in glob.glob(os.path.join(glob.escape(save_dir), f"{glob.escape(from_weight)}_*.pth"))
            if sizes.fullmatch(os.path.basename(p)) and os.path.abspath(p) != os.path.abspath(path)
        )
        if others and not os.path.isfile(from_weight):  # e.g. upstream's full_sft_768.pth beside the bundled one
            Logger(
                f"note: {', '.join(map(os.path.basename, others))} in {save_dir} too: --hidden_size, "
                f"--num_hidden_layers and --use_moe choose which {from_weight} a run starts from"
            )
    if len(tokenizer) > lm_config.vocab_size:
        raise InputError(
            f"tokenizer {tokenizer_path} has {len(tokenizer)} tokens but vocab_size is {lm_config.vocab_size}"
        )
    return model.to(device), tokenizer


def load_folder_weights(model, folder):
    """Load a ``Qwen3ForCausalLM`` folder's safetensors into ``model`` strictly (``load_qwen3_folder``), refusing a NaN
    or inf. Raises FileNotFoundError / ValueError naming the folder, the tensor or the keys."""
    _, state_dict = load_qwen3_folder(folder)
    check_finite_state(state_dict, f"{folder} (a damaged file? copy it again)", "refusing to load")
    own = model.state_dict()
    check_state_dict_fits(folder, own, state_dict, "the folder's config.json")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state_dict.items()}, strict=True)


def load_policy(lm_config, from_weight, save_dir, tokenizer, device):
    """The policy of an RL run (chapter 8.1's actor): ``init_model`` with ``--from_weight``, ``--save_dir`` and the
    run's tokenizer; fp32 weights on ``device``. Raises what ``init_model`` raises; a missing file as
    FileNotFoundError whose message starts with the flag: "--from_weight NAME: weights not found: PATH (in ...)"."""
    try:
        model, _ = init_model(lm_config, from_weight, save_dir, device=device, tokenizer=tokenizer)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"--from_weight {from_weight}: {error}") from None
    return model


def frozen_copy(model, dtype_name=""):
    """A frozen copy of ``model`` for a role that is never trained (the reference, chapter 8.1): ``eval()``, no
    gradients, its weights in ``dtype_name`` ("" keeps the model's; "bfloat16" halves fp32's memory; the log-probs of
    a bf16 reference differ from the fp32 one's by the rounding of its weights: docs/memory.md measures it).
    Raises ValueError for an unknown dtype name."""
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    return frozen.to(resolve_dtype(dtype_name, next(model.parameters()).dtype))


def half_state_dict(model):
    """The model's state dict in fp16 on CPU (MiniMind's release format for ``.pth`` weights); a LoRA policy's with
    its adapters merged in (``lora.merged_state_dict``)."""
    raw = unwrap_model(model)
    return {k: v.detach().half().cpu() for k, v in merged_state_dict(raw).items()}


def check_finite_state(state_dict, what, action="refusing to save"):
    """Raise ValueError naming ``what``, the first tensor that holds a NaN or inf and how many such values it
    holds: weights are never saved or loaded with one (a file damaged on disk shows up here, not as a diverged
    policy steps later)."""
    for name, tensor in state_dict.items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            count = int((~torch.isfinite(tensor)).sum())
            raise InputError(f"{action} {what}: {name} holds {count} NaN or inf values")


def weight_writes(weights, save_dir, lm_config, tokenizer_path, export_folder=False):
    """What a checkpoint writes for its weights, as {path: write} for ``atomic_write``: each module as a MiniMind
    fp16 ``{save_dir}/{name}_{hidden}[_moe].pth`` (a LoRA model's with its adapters merged in) and its tokenizer
    record beside it; for a LoRA model also its adapters in peft's format, ``{name}_{hidden}[_moe]_lora/``
    (``lora.save_adapters``); with ``export_folder`` (a run started from a model folder) each causal LM also as a
    ``Qwen3ForCausalLM`` folder, ``{name}_{hidden}_hf/`` (``write_model_folder``).

    Args:
        weights: name -> module (unwrapped or not), e.g. {"ppo": actor, "ppo_critic": critic}.
    Raises:
        ValueError: a NaN or inf in the weights (nothing is written).
    """
    writes = {}
    for name, module in weights.items():
        path = weight_path(name, save_dir, lm_config.hidden_size, lm_config.use_moe, allow_file=False)
        state_dict = half_state_dict(module)
        check_finite_state(state_dict, path)
        writes[path] = functools.partial(torch.save, state_dict)
        writes[tokenizer_record_path(path)] = functools.partial(write_json, tokenizer_record_to_save(tokenizer_path))
        if has_adapters(unwrap_model(module)):
            writes[adapter_folder(path)] = functools.partial(save_adapters, unwrap_model(module))
        if export_folder and isinstance(base_model(unwrap_model(module)), MiniMindForCausalLM):
            writes[model_folder_path(path)] = functools.partial(
                write_model_folder, merged_state_dict(unwrap_model(module)), lm_config, tokenizer_path
            )  # the kind of folder the run started from, from the fp32 weights
    return writes


def model_folder_path(checkpoint_path):
    """``dir/NAME.pth`` -> ``dir/NAME_hf``: the ``Qwen3ForCausalLM`` folder a run started from a folder writes too."""
    return os.path.splitext(checkpoint_path)[0] + "_hf"


def write_model_folder(state_dict, lm_config, tokenizer_path, folder):
    """Write a ``Qwen3ForCausalLM`` folder at ``folder`` (created here): config.json, bf16 safetensors (Qwen3's
    release dtype) and the tokenizer of ``tokenizer_path``; ``Qwen3ForCausalLM.from_pretrained`` and an SGLang
    server load it, and ``--from_weight`` starts from it."""
    write_qwen3_folder(state_dict, lm_config, folder, AutoTokenizer.from_pretrained(tokenizer_path), torch.bfloat16)


def save_weights(state_dict, path, tokenizer_path=None):
    """Write a state dict as a MiniMind ``.pth`` (``torch.save``) and, with ``tokenizer_path``, the record of that
    tokenizer beside it, both in one ``atomic_write``. Returns ``path``. Raises ValueError for a NaN or inf
    (nothing is written) and OSError naming the path."""
    check_finite_state(state_dict, path)
    writes = {path: functools.partial(torch.save, state_dict)}
    if tokenizer_path is not None:
        writes[tokenizer_record_path(path)] = functools.partial(write_json, tokenizer_record_to_save(tokenizer_path))
    atomic_write(writes)
    return path


def write_json(value, path):
    """``value`` as indented UTF-8 JSON at ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")


# ----------------------------------------------------------------------------- the tokenizer of a checkpoint
# Which tokenizer a MiniMind checkpoint was trained with, and the start-up check that a run uses that one.
#
# The embedding of a MiniMind checkpoint does not say which tokenizer it belongs to: this project's
# ``out/full_sft_256.pth`` keeps upstream's 6400-row embedding (``vocab_size`` 6400) while it was trained with the
# project's 441-token tokenizer (``model/``), and an upstream ``full_sft_768.pth`` has the same 6400 rows but needs
# upstream's 6400-token tokenizer. So every ``.pth`` this project's scripts save gets a record beside it,
# ``NAME.tokenizer.json`` (``write_tokenizer_record``): the number of tokens and a digest of the vocabulary of the
# tokenizer it was trained with. ``check_tokenizer_fits_checkpoint`` then accepts
#
#   - a checkpoint with a record: when the run's tokenizer has that size and that vocabulary;
#   - a checkpoint without one (upstream's, or any other): when the run's tokenizer has as many tokens as the
#     embedding has rows;
#
# and stops the run otherwise, before any model is built, naming both sizes and ``--tokenizer_path``.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")  # written by the chat template, one id each
EMBEDDING_KEY = "model.embed_tokens.weight"


def tokenizer_record_path(checkpoint_path):
    """``dir/NAME.pth`` -> ``dir/NAME.tokenizer.json``."""
    return os.path.splitext(checkpoint_path)[0] + ".tokenizer.json"


def tokenizer_record(tokenizer):
    """{"tokenizer_size": len(tokenizer), "vocab_sha256": sha256 of the sorted (token, id) pairs of get_vocab()}."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return {"tokenizer_size": len(tokenizer), "vocab_sha256": hashlib.sha256(vocab.encode("utf-8")).hexdigest()}


@functools.lru_cache(maxsize=4)
def tokenizer_record_of(tokenizer_path):
    """``tokenizer_record`` of the tokenizer folder ``tokenizer_path`` (loaded once per process)."""
    return tokenizer_record(AutoTokenizer.from_pretrained(tokenizer_path))


def tokenizer_record_to_save(tokenizer_path):
    """The record written beside a checkpoint: ``tokenizer_record_of(tokenizer_path)`` and the folder's name."""
    return dict(tokenizer_record_of(tokenizer_path), tokenizer_path=os.path.basename(os.path.abspath(tokenizer_path)))


def write_tokenizer_record(checkpoint_path, tokenizer_path):
    """Write ``tokenizer_record_path(checkpoint_path)``, the record of the tokenizer in ``tokenizer_path``
    (``atomic_write``), for a checkpoint written by another route than a training run. Returns the record's path."""
    path = tokenizer_record_path(checkpoint_path)
    atomic_write({path: functools.partial(write_json, tokenizer_record_to_save(tokenizer_path))})
    return path


def embedding_rows(checkpoint_path):
    """Rows of ``model.embed_tokens.weight`` in a MiniMind ``.pth`` state dict (memory-mapped where the file allows,
    so the tensors are not read), or None when the file has no such tensor (the strict load names that later)."""
    try:
        state_dict = load_tensors_only(checkpoint_path, mmap=True)
    except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be memory-mapped
        state_dict = load_tensors_only(checkpoint_path)
    tensor = state_dict.get(EMBEDDING_KEY) if isinstance(state_dict, dict) else None
    return None if tensor is None else tensor.shape[0]


def check_tokenizer_fits_checkpoint(tokenizer, tokenizer_path, checkpoint_path, named=False):
    """Stop a run whose tokenizer is not the one its starting checkpoint was trained with.

    Args:
        tokenizer: the run's tokenizer (transformers), loaded from ``tokenizer_path`` (named in the messages).
        checkpoint_path: the ``.pth`` the policy starts from, or None (random init): then only the tokens are checked.
        named: the user named ``--tokenizer_path`` on the command line. For a checkpoint without a record whose
            embedding has another number of rows than the tokenizer has tokens (the project's own checkpoints keep
            upstream's 6400 rows for a smaller tokenizer), a named tokenizer that fits in the embedding is trusted,
            with a warning; an unnamed one is refused.
    Raises:
        ValueError: the chat template's tokens (``CHAT_TOKENS``) are not single tokens of the tokenizer, or it has no
            EOS token; the checkpoint's record names another tokenizer (size or vocabulary); or, without a record,
            the tokenizer's size differs from the checkpoint's embedding rows. Each message names the sizes, the
            files and ``--tokenizer_path``.
    """
    vocab = tokenizer.get_vocab()
    missing = [t for t in CHAT_TOKENS if t not in vocab or tokenizer.encode(t, add_special_tokens=False) != [vocab[t]]]
    if missing:
        raise InputError(
            f"--tokenizer_path {tokenizer_path}: the chat template needs {missing} as single tokens and "
            f"this tokenizer of {len(tokenizer)} tokens lacks them (a MiniMind tokenizer has them)"
        )
    if tokenizer.eos_token_id is None:
        raise InputError(
            f"--tokenizer_path {tokenizer_path}: the tokenizer has no EOS token (MiniMind's is <|im_end|>)"
        )
    if checkpoint_path is None or not os.path.isfile(checkpoint_path):
        return
    record_path = tokenizer_record_path(checkpoint_path)
    if os.path.isfile(record_path):
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        ours = tokenizer_record(tokenizer)
        if record["tokenizer_size"] != ours["tokenizer_size"]:
            raise InputError(
                f"{checkpoint_path} was trained with a tokenizer of {record['tokenizer_size']} tokens "
                f"({record_path}), but --tokenizer_path {tokenizer_path} has {ours['tokenizer_size']}: "
                f"pass --tokenizer_path with the tokenizer it was trained with"
            )
        if record["vocab_sha256"] != ours["vocab_sha256"]:
            raise InputError(
                f"{checkpoint_path} was trained with another vocabulary of the same size "
                f"({record['tokenizer_size']} tokens, {record_path}) than --tokenizer_path "
                f"{tokenizer_path}: pass --tokenizer_path with the tokenizer it was trained with"
            )
        return
    rows = embedding_rows(checkpoint_path)
    if rows is None or rows == len(tokenizer):
        return
    if named and len(tokenizer) <= rows:
        Logger(
            f"warning: {checkpoint_path} has no record of its tokenizer ({os.path.basename(record_path)}); "
            f"trusting --tokenizer_path {tokenizer_path} as named ({len(tokenizer)} tokens for an embedding of "
            f"{rows} rows). If these weights were trained with another tokenizer, the run trains on wrong ids."
        )
        return
    raise InputError(
        f"{checkpoint_path} has an embedding of {rows} rows (a {rows}-token vocabulary) and no "
        f"record of its tokenizer ({os.path.basename(record_path)} beside it), but --tokenizer_path "
        f"{tokenizer_path} has {len(tokenizer)} tokens. Copy the record beside the weights, or name "
        f"the tokenizer they were trained with on the command line (--tokenizer_path DIR: it is then "
        f"trusted when it fits the embedding); upstream MiniMind's checkpoints need upstream's "
        f"tokenizer, its model/ folder of 6400 tokens"
    )


def load_tokenizer(tokenizer_path, checkpoint_path, named=False):
    """The run's tokenizer (``AutoTokenizer`` of ``--tokenizer_path``), checked against the starting checkpoint
    (``check_tokenizer_fits_checkpoint``; ``checkpoint_path`` None for random init; ``named``: the user named the
    tokenizer). Raises what that raises."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    check_tokenizer_fits_checkpoint(tokenizer, tokenizer_path, checkpoint_path, named)
    return tokenizer
