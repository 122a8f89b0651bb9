"""MiniMind weights <-> a transformers ``Qwen3ForCausalLM`` folder (config.json + safetensors), the one mapping
between the two formats, used by ``scripts/convert_model.py`` and ``SGLangRolloutEngine`` (every weight sync).

MiniMind's dense model is the Qwen3 layout with ``Qwen3ForCausalLM``'s parameter names (``tests/test_model.py``
checks equal logits), so the state-dict keys pass through unchanged. Two things differ: with tied embeddings the
folder holds no ``lm_head.weight`` (transformers and SGLang tie it from ``tie_word_embeddings``; loading adds it
back), and ``MiniMindConfig`` fields become ``Qwen3Config`` fields (``qwen3_config_from_minimind``). The MoE
variant (``use_moe``) has no ``Qwen3ForCausalLM`` counterpart and is refused. Folders appear complete or not at
all (``write_folder_atomically``).
"""

import glob
import json
import os
import shutil
import uuid

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from model.model_minimind import MiniMindConfig

TIED_LM_HEAD_KEY = "lm_head.weight"
EMBED_KEY = "model.embed_tokens.weight"
WEIGHTS_NAME = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def qwen3_config_from_minimind(config):
    """``Qwen3Config`` (architectures = ["Qwen3ForCausalLM"]) with the same architecture as a ``MiniMindConfig``.

    Raises:
        ValueError: for a MoE config (``use_moe``), which Qwen3ForCausalLM cannot hold.
    """
    if config.use_moe:
        raise ValueError(
            "use_moe=True: MiniMind's MoE model has no Qwen3ForCausalLM counterpart; "
            "only dense models (--use_moe 0) can be exported"
        )
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def minimind_config_from_qwen3(qwen_config, source="config.json"):
    """``MiniMindConfig`` for a dense ``Qwen3Config``; ``source`` names the file in errors.

    Raises:
        ValueError: if the config is not a Qwen3 causal LM MiniMind can represent (model_type, attention bias,
            sliding window).
    """
    if qwen_config.model_type != "qwen3":
        raise ValueError(f"{source}: model_type is {qwen_config.model_type!r}, expected 'qwen3'")
    if qwen_config.attention_bias or qwen_config.use_sliding_window:
        raise ValueError(f"{source}: attention_bias / use_sliding_window are set; MiniMind supports neither")
    rope_theta = (qwen_config.rope_parameters or {}).get("rope_theta", getattr(qwen_config, "rope_theta", 1e6))
    return MiniMindConfig(
        hidden_size=qwen_config.hidden_size,
        num_hidden_layers=qwen_config.num_hidden_layers,
        num_attention_heads=qwen_config.num_attention_heads,
        num_key_value_heads=qwen_config.num_key_value_heads,
        head_dim=qwen_config.head_dim,
        intermediate_size=qwen_config.intermediate_size,
        vocab_size=qwen_config.vocab_size,
        hidden_act=qwen_config.hidden_act,
        max_position_embeddings=qwen_config.max_position_embeddings,
        rms_norm_eps=qwen_config.rms_norm_eps,
        rope_theta=rope_theta,
        tie_word_embeddings=qwen_config.tie_word_embeddings,
        bos_token_id=qwen_config.bos_token_id,
        eos_token_id=qwen_config.eos_token_id,
        pad_token_id=qwen_config.pad_token_id,
    )


def qwen3_state_dict(minimind_state_dict, tie_word_embeddings, dtype=torch.float32):
    """MiniMind state dict -> the tensors a Qwen3ForCausalLM folder stores: same keys, contiguous CPU copies in
    ``dtype``, without ``lm_head.weight`` when the embeddings are tied."""
    tensors = {}
    for name, tensor in minimind_state_dict.items():
        if tie_word_embeddings and name == TIED_LM_HEAD_KEY:
            continue
        tensors[name] = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
    return tensors


def minimind_state_dict(qwen3_tensors, tie_word_embeddings):
    """Tensors of a Qwen3ForCausalLM folder -> MiniMind state dict (adds the tied ``lm_head.weight``)."""
    state_dict = dict(qwen3_tensors)
    if tie_word_embeddings and TIED_LM_HEAD_KEY not in state_dict and EMBED_KEY in state_dict:
        state_dict[TIED_LM_HEAD_KEY] = state_dict[EMBED_KEY]
    return state_dict


def save_qwen3_folder(state_dict, config, path, tokenizer=None, dtype=torch.float32):
    """Write a transformers ``Qwen3ForCausalLM`` folder (config.json, model.safetensors[, tokenizer]) at ``path``,
    created or replaced atomically (``write_folder_atomically``); returns its absolute path.

    ``state_dict``: MiniMind weights (any device / dtype) of ``config`` (a ``MiniMindConfig``); ``tokenizer``: saved
    alongside when given (SGLang loads it from the model folder); ``dtype``: the stored dtype (float32 keeps the
    weights exact). Raises ValueError for a MoE config, OSError when the folder cannot be written.
    """
    path = os.path.abspath(path)
    write_folder_atomically(path, lambda folder: write_qwen3_folder(state_dict, config, folder, tokenizer, dtype))
    return path


def write_qwen3_folder(state_dict, config, folder, tokenizer=None, dtype=torch.float32):
    """Create ``folder`` and write the ``Qwen3ForCausalLM`` files into it, not atomically (``save_qwen3_folder`` and
    ``trainer/infra/files.atomic_write`` call it on a temporary folder). Arguments as ``save_qwen3_folder``'s."""
    qwen_config = qwen3_config_from_minimind(config)
    qwen_config.dtype = dtype
    tensors = qwen3_state_dict(state_dict, config.tie_word_embeddings, dtype)
    os.makedirs(folder)
    qwen_config.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config_json = json.load(f)
    # Older transformers/SGLang read these two keys; transformers 5 writes rope_parameters and dtype.
    config_json["rope_theta"] = config.rope_theta
    config_json["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    save_file(tensors, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def write_folder_atomically(path, write):
    """``write(tmp)`` creates the folder's content at a temporary sibling ``tmp`` (it makes the folder itself);
    every file is fsynced, then the folder is swapped in for ``path`` by two renames (the old one removed after), so
    a crash leaves the old folder or the new one, never part of one. On an error the temporary folder is removed;
    folders a killed writer left (``{path}.tmp*``, ``{path}.old-*``) are removed by the next write to ``path``."""
    for stale in glob.glob(glob.escape(path) + ".tmp*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = f"{path}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(tmp)
        for root, _, names in os.walk(tmp):
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
        old = f"{path}.old-{uuid.uuid4().hex[:8]}"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def load_qwen3_folder(path):
    """Read a ``Qwen3ForCausalLM`` folder -> (MiniMindConfig, MiniMind state dict in the stored dtype).

    Reads every ``*.safetensors`` file in the folder (single file or shards).
    Raises:
        FileNotFoundError: naming the folder when config.json or the weights are missing.
        ValueError: see ``minimind_config_from_qwen3``.
    """
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path}: no config.json (not a transformers model folder)")
    weight_files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not weight_files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    config = minimind_config_from_qwen3(Qwen3Config.from_pretrained(path), config_path)
    tensors = {}
    for weight_file in weight_files:
        tensors.update(load_file(weight_file))
    return config, minimind_state_dict(tensors, config.tie_word_embeddings)
