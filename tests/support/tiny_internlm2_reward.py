"""A tiny internlm2-1_8b-reward folder built from the published files (code, tokenizer, weight index), for tests.

The published folder (``../shared/compat/internlm2-1_8b-reward/``, no weights) gives the remote code, the tokenizer
and the names of the weights (``model.safetensors.index.json``). ``build_tiny_internlm2_reward`` copies the code and
tokenizer files, writes a ``config.json`` with hidden 64, 2 layers, 4 heads, 2 KV heads (the vocabulary stays 92544,
the special tokens sit at its end) and random fp16 weights for the weight names of layers 0 and 1 and the
non-layer weights, in two shards named as in the index. The weights come from ``numpy.random.RandomState(seed)`` in
a fixed order, so the folder is the same on every machine; ``weights_digest`` fingerprints them.

Needs numpy and safetensors only (no torch, no transformers), so the recording script can run it under another
transformers release (``tests/support/record_internlm2_reward.py``).
"""

import hashlib
import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file

COPIED_FILES = (
    "configuration_internlm2.py",
    "modeling_internlm2.py",
    "tokenization_internlm2.py",
    "tokenization_internlm2_fast.py",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
TINY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def tiny_shape(name, config):
    """Shape of the weight ``name`` (an internlm2 weight name) under ``config`` (dict)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv_rows = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    suffix_shapes = {
        "attention.wqkv.weight": (qkv_rows, hidden),
        "attention.wo.weight": (hidden, hidden),
        "feed_forward.w1.weight": (inter, hidden),
        "feed_forward.w3.weight": (inter, hidden),
        "feed_forward.w2.weight": (hidden, inter),
        "attention_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "model.norm.weight": (hidden,),
        "model.tok_embeddings.weight": (vocab, hidden),
        "v_head.weight": (1, hidden),
    }
    for suffix, shape in suffix_shapes.items():
        if name.endswith(suffix):
            return shape
    raise KeyError(f"no shape for weight {name}")


def random_weight(rng, name, shape):
    """fp16 values: norms 1 + 0.1 N(0, 1); embeddings N(0, 1); matrices N(0, 1) / sqrt(fan_in); v_head x 8."""
    if name.endswith("norm.weight"):
        values = 1.0 + 0.1 * rng.standard_normal(shape)
    elif name.endswith("tok_embeddings.weight"):
        values = rng.standard_normal(shape)
    else:
        values = rng.standard_normal(shape) / np.sqrt(shape[1])
        if name == "v_head.weight":
            values = 8.0 * values  # scores of order 1, some beyond the clip at 3
    return values.astype(np.float16)


def weights_digest(folder):
    """sha256 of every weight (name, shape, fp16 bytes), in sorted name order, over the folder's shards."""
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "model.safetensors.index.json"), encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(load_file(os.path.join(folder, shard)))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(f"{name}{tensors[name].shape}".encode())
        digest.update(np.ascontiguousarray(tensors[name]).tobytes())
    return digest.hexdigest()


def build_tiny_internlm2_reward(source, target, seed=0, dims=TINY_DIMS):
    """Write the tiny folder to ``target`` (created) from the published files in ``source``; returns ``target``.
    ``dims``: the config fields replaced (``TINY_DIMS``; ``{}`` keeps the published 1.8 B shape, for the memory
    benchmark).

    Raises:
        FileNotFoundError: if a published file is missing from ``source``.
    """
    os.makedirs(target, exist_ok=True)
    for name in COPIED_FILES:
        shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
    with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.update(dims)
    with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(source, "model.safetensors.index.json"), encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    kept = {
        name: shard
        for name, shard in weight_map.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < config["num_hidden_layers"]
    }
    rng = np.random.RandomState(seed)
    shards = {}
    for name in sorted(kept):
        shards.setdefault(kept[name], {})[name] = random_weight(rng, name, tiny_shape(name, config))
    for shard, tensors in shards.items():
        save_file(tensors, os.path.join(target, shard), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.nbytes for s in shards.values() for t in s.values())},
        "weight_map": dict(sorted(kept.items())),
    }
    with open(os.path.join(target, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return target
