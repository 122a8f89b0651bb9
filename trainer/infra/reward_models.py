"""Reward-model folders: their checks (no model built yet), the loading of each kind, a classifier's text.

Infrastructure, not RL: a learner can skip this file. The chapter's scorer (8.3), ``LMForRewardModel`` in
``trainer/trainer_utils.py``, gets its tokenizer and model from ``load_reward_model_files``; how each kind is
scored is in docs/reward_model.md.
"""

import json
import os

from transformers import AutoTokenizer

from trainer.infra.internlm2_reward import (
    InternLM2RewardModel,
    InternLM2RewardTokenizer,
    is_internlm2_reward,
    require_sentencepiece,
)
from trainer.infra.errors import InputError


def read_reward_model_config(path, trust_remote_code):
    """Check a reward-model folder before anything is loaded; returns its config.json as a dict.

    An InternLM2 reward model (``auto_map`` naming ``InternLM2ForRewardModel``, upstream MiniMind's default
    ``internlm2-1_8b-reward``) loads without running its code (``trainer/infra/internlm2_reward.py``), so it needs no
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
        raise InputError(f"{config_path}:{err.lineno}: invalid JSON ({err.msg})") from err
    if is_internlm2_reward(config):
        try:
            require_sentencepiece(path)
        except ModuleNotFoundError as err:
            raise InputError(str(err)) from err
    elif config.get("auto_map") and not trust_remote_code:
        raise InputError(
            f"--reward_model_path {path} runs its own Python code (auto_map in config.json: "
            f"{sorted(config['auto_map'])}); pass --trust_remote_code to allow it "
            f"(after reading that code)"
        )
    return config


def render_reward_text(tokenizer, conversation):
    """(text, add_special_tokens) for a sequence-classification reward model.

    With a chat template the text is ``apply_chat_template(conversation, tokenize=False)`` and the template already
    holds any BOS token (add_special_tokens False); without one, "role: content" lines and the tokenizer's own
    special tokens.
    """
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(conversation, tokenize=False), False
    return "\n".join(f"{m['role']}: {m['content']}" for m in conversation), True


def load_reward_model_files(path, device, dtype, trust_remote_code):
    """(kind, tokenizer, model) of the reward-model folder ``path``, the model on ``device`` in ``dtype``, in eval
    mode and without gradients. kind "internlm2": ``trainer/infra/internlm2_reward.py``, no remote code; "remote": a
    remote-code model with ``get_score`` (``AutoModel``); "classifier": a sequence-classification model with one
    label, its tokenizer padding on the right and truncating on the left.
    Raises FileNotFoundError / ValueError as ``read_reward_model_config`` does; ValueError also for a classifier with
    more than one label or a remote-code model without ``get_score``.
    """
    from transformers import AutoModel, AutoModelForSequenceClassification

    config = read_reward_model_config(path, trust_remote_code)
    auto_map = config.get("auto_map") or {}
    if is_internlm2_reward(config):
        kind = "internlm2"
        tokenizer = InternLM2RewardTokenizer(path)
        model = InternLM2RewardModel.from_pretrained(path, config, dtype=dtype)
    elif auto_map and "AutoModelForSequenceClassification" not in auto_map:
        kind = "remote"
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=True)
        if not callable(getattr(model, "get_score", None)):
            raise InputError(
                f"--reward_model_path {path}: {type(model).__name__} has no "
                f"get_score(tokenizer, messages) and is not a sequence-classification model"
            )
    else:
        kind = "classifier"
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
        if model.config.num_labels != 1:
            raise InputError(
                f"--reward_model_path {path}: a reward model has one output label, this one has "
                f"{model.config.num_labels}"
            )
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"  # real tokens keep their positions: batched == one by one
        tokenizer.truncation_side = "left"  # a long history loses its start, never the answer
        model.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last non-pad token
    model = model.to(device).eval()
    model.requires_grad_(False)
    return kind, tokenizer, model
