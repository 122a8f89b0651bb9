"""Which tokenizer a MiniMind checkpoint was trained with, and the start-up check that a run uses that one.

The embedding of a MiniMind checkpoint does not say which tokenizer it belongs to: this project's
``out/full_sft_256.pth`` keeps upstream's 6400-row embedding (``vocab_size`` 6400) while it was trained with the
project's 441-token tokenizer (``model/``), and an upstream ``full_sft_768.pth`` has the same 6400 rows but needs
upstream's 6400-token tokenizer. So every ``.pth`` this project's scripts save gets a record beside it,
``NAME.tokenizer.json`` (``write_tokenizer_record``): the number of tokens and a digest of the vocabulary of the
tokenizer it was trained with. ``check_tokenizer_fits_checkpoint`` then accepts

  - a checkpoint with a record: when the run's tokenizer has that size and that vocabulary;
  - a checkpoint without one (upstream's, or any other): when the run's tokenizer has as many tokens as the
    embedding has rows;

and stops the run otherwise, before any model is built, naming both sizes and ``--tokenizer_path``.
"""
import functools
import hashlib
import json
import os

import torch

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
    from transformers import AutoTokenizer
    return tokenizer_record(AutoTokenizer.from_pretrained(tokenizer_path))


def write_tokenizer_record(checkpoint_path, tokenizer_path):
    """Write ``tokenizer_record_path(checkpoint_path)``: the record of the tokenizer in ``tokenizer_path`` (JSON,
    written to a temporary file, then renamed into place). Returns the record's path."""
    path = tokenizer_record_path(checkpoint_path)
    record = dict(tokenizer_record_of(tokenizer_path), tokenizer_path=os.path.basename(os.path.abspath(tokenizer_path)))
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(temporary, path)
    return path


def embedding_rows(checkpoint_path):
    """Rows of ``model.embed_tokens.weight`` in a MiniMind ``.pth`` state dict (memory-mapped where the file allows,
    so the tensors are not read), or None when the file has no such tensor (the strict load names that later)."""
    try:
        state_dict = torch.load(checkpoint_path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be memory-mapped
        state_dict = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    tensor = state_dict.get(EMBEDDING_KEY) if isinstance(state_dict, dict) else None
    return None if tensor is None else tensor.shape[0]


def check_tokenizer_fits_checkpoint(tokenizer, tokenizer_path, checkpoint_path):
    """Stop a run whose tokenizer is not the one its starting checkpoint was trained with.

    Args:
        tokenizer: the run's tokenizer (transformers), loaded from ``tokenizer_path`` (named in the messages).
        checkpoint_path: the ``.pth`` the policy starts from, or None (random init): then only the tokens are checked.
    Raises:
        ValueError: the chat template's tokens (``CHAT_TOKENS``) are not single tokens of the tokenizer, or it has no
            EOS token; the checkpoint's record names another tokenizer (size or vocabulary); or, without a record,
            the tokenizer's size differs from the checkpoint's embedding rows. Each message names the sizes, the
            files and ``--tokenizer_path``.
    """
    vocab = tokenizer.get_vocab()
    missing = [t for t in CHAT_TOKENS if t not in vocab or tokenizer.encode(t, add_special_tokens=False) != [vocab[t]]]
    if missing:
        raise ValueError(f"--tokenizer_path {tokenizer_path}: the chat template needs {missing} as single tokens and "
                         f"this tokenizer of {len(tokenizer)} tokens lacks them (a MiniMind tokenizer has them)")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer_path {tokenizer_path}: the tokenizer has no EOS token "
                         f"(MiniMind's is <|im_end|>)")
    if checkpoint_path is None or not os.path.isfile(checkpoint_path):
        return
    record_path = tokenizer_record_path(checkpoint_path)
    if os.path.isfile(record_path):
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        ours = tokenizer_record(tokenizer)
        if record["tokenizer_size"] != ours["tokenizer_size"]:
            raise ValueError(f"{checkpoint_path} was trained with a tokenizer of {record['tokenizer_size']} tokens "
                             f"({record_path}), but --tokenizer_path {tokenizer_path} has {ours['tokenizer_size']}: "
                             f"pass --tokenizer_path with the tokenizer it was trained with")
        if record["vocab_sha256"] != ours["vocab_sha256"]:
            raise ValueError(f"{checkpoint_path} was trained with another vocabulary of the same size "
                             f"({record['tokenizer_size']} tokens, {record_path}) than --tokenizer_path "
                             f"{tokenizer_path}: pass --tokenizer_path with the tokenizer it was trained with")
        return
    rows = embedding_rows(checkpoint_path)
    if rows is not None and rows != len(tokenizer):
        raise ValueError(f"{checkpoint_path} has an embedding of {rows} rows (a {rows}-token vocabulary) and no "
                         f"record of its tokenizer ({os.path.basename(record_path)}), but --tokenizer_path "
                         f"{tokenizer_path} has {len(tokenizer)} tokens: pass --tokenizer_path with the tokenizer it "
                         f"was trained with (upstream MiniMind's checkpoints need upstream's tokenizer, its model/ "
                         f"folder of 6400 tokens)")
