"""InternLM2 reward models (upstream MiniMind's default ``internlm2-1_8b-reward``) loaded without their remote code.

Upstream MiniMind loads ``internlm2-1_8b-reward`` with ``AutoModel.from_pretrained(..., trust_remote_code=True)``
and scores with its ``get_score(tokenizer, messages)``. That remote code (``modeling_internlm2.py``, written for
transformers 4.41) imports modules that transformers 5 removed, reads config fields that transformers 5 rewrites, and
leaves the rotary ``inv_freq`` buffer uninitialised under transformers 5's loading (random scores, no error); the
fast tokenizer class that transformers 5 picks gives the special tokens other ids.

The design here: run none of that code. The network is Llama-shaped, so the weights go into transformers' own
``LlamaModel`` (kept working by transformers itself, release after release) plus a one-output ``v_head``; the
tokenizer is the folder's sentencepiece model (``tokenizer.model``) with the special-token ids written in its
``tokenizer_config.json``, and the chat template of that file rendered with jinja2 as transformers renders chat
templates. What is left to this file is plain: a renaming of weights and one split of a packed matrix.

Weight mapping (InternLM2 name -> Llama name, per layer i):
  ``model.tok_embeddings``        -> ``embed_tokens``
  ``model.layers.i.attention.wqkv`` -> ``layers.i.self_attn.{q,k,v}_proj`` (see ``split_wqkv``)
  ``model.layers.i.attention.wo`` -> ``layers.i.self_attn.o_proj``
  ``feed_forward.w1 / w3 / w2``   -> ``mlp.gate_proj / up_proj / down_proj`` (SwiGLU: w2(silu(w1 x) * w3 x))
  ``attention_norm / ffn_norm``   -> ``input_layernorm / post_attention_layernorm``
  ``model.norm``                  -> ``norm``;  ``v_head`` stays ``v_head`` (hidden -> 1, no bias)
Both models use the same rotary convention (``rotate_half``), RMSNorm (weight times the fp32-normalised input) and
grouped-query attention (query head j reads key/value head j // (heads / kv_heads)), so nothing else changes.

The score of a conversation is upstream's: the chat template (``<s><|im_start|>user ... <|im_end|>\\n<|reward|>``)
tokenized without extra special tokens, ``<|reward|>`` appended when the text does not end with it, and the
``v_head`` output at the last real token. Sources: InternLM2 technical report (arXiv:2403.17297); the model card and
files of internlm/internlm2-1_8b-reward; transformers' ``LlamaModel``.
"""

import json
import os
import re

import torch
from torch import nn

from trainer.infra.errors import InputError, MissingPackageError

INTERNLM2_REWARD_CLASS = "InternLM2ForRewardModel"
SENTENCEPIECE_HINT = "pip install sentencepiece"


def is_internlm2_reward(config):
    """True when a reward-model ``config.json`` (dict) names ``InternLM2ForRewardModel`` in its ``auto_map``.

    ``auto_map`` values are "module.Class" strings, or lists of them (tokenizers); only the class name counts.
    """
    auto_map = config.get("auto_map") or {}
    names = []
    for value in auto_map.values():
        names.extend(value if isinstance(value, (list, tuple)) else [value])
    return any(isinstance(name, str) and name.rsplit(".", 1)[-1] == INTERNLM2_REWARD_CLASS for name in names)


def require_sentencepiece(path):
    """Import and return the sentencepiece module.

    Raises:
        ModuleNotFoundError: when it is not installed; the message names ``path`` and the pip command.
    """
    try:
        import sentencepiece
    except ModuleNotFoundError as err:
        raise MissingPackageError(
            f"--reward_model_path {path}: this InternLM2 reward model's tokenizer "
            f"(tokenizer.model) needs the sentencepiece package: {SENTENCEPIECE_HINT}"
        ) from err
    return sentencepiece


def llama_config_from_internlm2(config):
    """A transformers ``LlamaConfig`` with the dimensions of an InternLM2 ``config.json`` (dict).

    Raises:
        ValueError: for a ``rope_scaling`` other than null (the linear / dynamic variants of InternLM2's remote code
            are not mapped here), naming the value.
    """
    from transformers import LlamaConfig

    if config.get("rope_scaling") is not None:
        raise InputError(
            f"InternLM2 rope_scaling {config['rope_scaling']!r} is not supported here "
            f"(only null, as in internlm2-1_8b-reward)"
        )
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return LlamaConfig(
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=hidden // heads,
        hidden_act=config.get("hidden_act", "silu"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        rope_parameters={"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000))},
        attention_bias=bool(config.get("bias", False)),
        mlp_bias=False,
        tie_word_embeddings=False,
        pad_token_id=config.get("pad_token_id"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        attn_implementation=config.get("attn_implementation") or "sdpa",
        reward_token_id=config.get("reward_token_id", 92527),
    )  # 92527: the remote InternLM2Config's default


def split_wqkv(wqkv, num_heads, num_key_value_heads, head_dim):
    """Split InternLM2's packed ``wqkv`` (weight [(H + 2K) * d, hidden], or bias [(H + 2K) * d]) into q, k, v.

    The rows are grouped by key/value head: for each of the K kv heads, its H/K query heads, then its key, then its
    value, d rows each (the remote code's ``rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=2 + H/K)``).
    Returns (q [H*d, ...], k [K*d, ...], v [K*d, ...]), query heads in the order kv head by kv head, which is the
    order Llama's ``repeat_kv`` expects (query head j reads kv head j // (H/K)).
    """
    groups = num_heads // num_key_value_heads
    packed = wqkv.reshape(num_key_value_heads, groups + 2, head_dim, *wqkv.shape[1:])
    q = packed[:, :groups].reshape(num_heads * head_dim, *wqkv.shape[1:])
    k = packed[:, groups].reshape(num_key_value_heads * head_dim, *wqkv.shape[1:])
    v = packed[:, groups + 1].reshape(num_key_value_heads * head_dim, *wqkv.shape[1:])
    return q, k, v


LAYER_RENAMES = {
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LAYER_PATTERN = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def convert_internlm2_weight(name, tensor, llama_config):
    """[(name in ``InternLM2RewardModel``, tensor)] for one weight of an InternLM2 reward checkpoint.

    Raises:
        KeyError: for a name that is not part of an InternLM2 reward model.
    """
    if name == "model.tok_embeddings.weight":
        return [("model.embed_tokens.weight", tensor)]
    if name == "model.norm.weight":
        return [("model.norm.weight", tensor)]
    if name == "v_head.weight":
        return [("v_head.weight", tensor)]
    match = LAYER_PATTERN.fullmatch(name)
    if match:
        layer, module, kind = match.groups()
        prefix = f"model.layers.{layer}."
        if module == "attention.wqkv":
            q, k, v = split_wqkv(
                tensor, llama_config.num_attention_heads, llama_config.num_key_value_heads, llama_config.head_dim
            )
            return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in (("q", q), ("k", k), ("v", v))]
        if module in LAYER_RENAMES:
            return [(f"{prefix}{LAYER_RENAMES[module]}.{kind}", tensor)]
    raise KeyError(f"{name} is not a weight of an InternLM2 reward model")


def checkpoint_shards(path):
    """The safetensors files of a model folder: those of ``model.safetensors.index.json``, or ``model.safetensors``.

    Raises:
        FileNotFoundError: when neither exists, or a shard named by the index is missing (naming it).
    """
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"--reward_model_path {path}: no model.safetensors.index.json or model.safetensors "
            f"(the weights of the reward model)"
        )
    files = [os.path.join(path, shard) for shard in shards]
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"--reward_model_path {path}: {os.path.basename(file)} is missing "
                f"(named by model.safetensors.index.json)"
            )
    return files


class InternLM2RewardModel(nn.Module):
    """InternLM2 reward model as transformers' ``LlamaModel`` + ``v_head`` (a linear map hidden -> 1, no bias).

    ``forward(input_ids [B, T] long, attention_mask [B, T] 0/1, right padding)`` -> scores [B] fp32: ``v_head`` of
    the final hidden state at each row's last real token (the remote code's ``attention_mask.cumsum(1).argmax(1)``).
    """

    def __init__(self, llama_config):
        super().__init__()
        from transformers import LlamaModel

        self.config = llama_config
        self.model = LlamaModel(llama_config)
        self.v_head = nn.Linear(llama_config.hidden_size, 1, bias=False)

    @classmethod
    def from_pretrained(cls, path, config, dtype=torch.float32):
        """Build from the folder ``path`` whose ``config.json`` is ``config`` (dict); weights cast to ``dtype``.

        Every weight of the checkpoint must map to a parameter and every parameter must be filled.
        Raises:
            FileNotFoundError: no weights (``checkpoint_shards``).
            ValueError: a weight name that is not InternLM2's, a shape that differs from config.json, or a parameter
                that no weight fills (the message names the file and the weights).
        """
        from safetensors import safe_open

        llama_config = llama_config_from_internlm2(config)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # parameters created in the weights' dtype: one copy in memory, not two
        try:
            model = cls(llama_config)
        finally:
            torch.set_default_dtype(default_dtype)
        parameters = dict(model.named_parameters())
        filled = set()
        for file in checkpoint_shards(path):
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():
                    try:
                        converted = convert_internlm2_weight(name, shard.get_tensor(name), llama_config)
                    except KeyError as err:
                        raise InputError(f"{file}: {err.args[0]}") from err
                    for target, tensor in converted:
                        if tuple(tensor.shape) != tuple(parameters[target].shape):
                            raise InputError(
                                f"{file}: {name} has shape {tuple(tensor.shape)}, config.json gives "
                                f"{tuple(parameters[target].shape)} for {target}"
                            )
                        with torch.no_grad():
                            parameters[target].copy_(tensor)
                        filled.add(target)
        missing = sorted(set(parameters) - filled)
        if missing:
            raise InputError(
                f"--reward_model_path {path}: the checkpoint has no weights for {missing[:4]}"
                f"{' ...' if len(missing) > 4 else ''} ({len(missing)} of {len(parameters)})"
            )
        return model.eval()

    def forward(self, input_ids, attention_mask):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        values = self.v_head(hidden)[..., 0]  # [B, T]
        last = attention_mask.long().cumsum(dim=1).argmax(dim=1)  # [B], the last real token (right padding)
        return values.gather(1, last[:, None])[:, 0].float()  # [B]

    @torch.no_grad()
    def get_scores(self, tokenizer, conversations, max_length=None):
        """Scores (list of N floats, also for N = 1) of N conversations, in one right-padded forward.

        Args:
            tokenizer: an ``InternLM2RewardTokenizer`` of the same folder.
            conversations: list of N lists of {"role", "content"}.
            max_length: tokens kept per conversation, from the right (the reward token and the answer survive);
                None keeps all (as upstream does).
        """
        rows = [tokenizer.conversation_ids(c, self.config.reward_token_id) for c in conversations]
        if max_length:
            rows = [ids[-max_length:] for ids in rows]
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # [N, T]
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [N, T]
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        device = self.v_head.weight.device
        return self(input_ids.to(device), attention_mask.to(device)).tolist()

    def get_score(self, tokenizer, conversation):
        """The score (float) of one conversation."""
        return self.get_scores(tokenizer, [conversation])[0]


class InternLM2RewardTokenizer:
    """The tokenizer of an InternLM2 reward folder: sentencepiece plus the special tokens of tokenizer_config.json.

    ``encode(text)`` splits the text at the special tokens (``<s>``, ``<|im_start|>``, ``<|reward|>``, ...; the
    longest match first), maps each to the id that ``added_tokens_decoder`` gives it and encodes the text between
    them with ``tokenizer.model``; no BOS is added (the chat template writes ``<s>``). This is what the remote
    tokenizer classes do under transformers 4.x (``encode(text, add_special_tokens=False)``).

    Raises (constructor):
        ModuleNotFoundError: sentencepiece missing (``require_sentencepiece``).
        FileNotFoundError: no tokenizer.model or tokenizer_config.json in the folder.
        ValueError: no chat_template in tokenizer_config.json.
    """

    def __init__(self, path):
        sentencepiece = require_sentencepiece(path)
        for name in ("tokenizer.model", "tokenizer_config.json"):
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"--reward_model_path {path}: {name} is missing")
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            tokenizer_config = json.load(f)
        self.sp_model = sentencepiece.SentencePieceProcessor(model_file=os.path.join(path, "tokenizer.model"))
        self.special_tokens = {
            entry["content"]: int(token_id)
            for token_id, entry in tokenizer_config.get("added_tokens_decoder", {}).items()
        }
        self.special_pattern = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(self.special_tokens, key=len, reverse=True)) + ")"
        )
        self.chat_template = tokenizer_config.get("chat_template")
        if not self.chat_template:
            raise InputError(f"--reward_model_path {path}: tokenizer_config.json has no chat_template")
        self.template_tokens = {
            key: tokenizer_config[key]
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if key in tokenizer_config
        }
        self.pad_token_id = self.token_id(tokenizer_config.get("pad_token", "</s>"))

    def token_id(self, token):
        """Id of a special token (its ``added_tokens_decoder`` entry) or of a sentencepiece piece."""
        return self.special_tokens[token] if token in self.special_tokens else self.sp_model.piece_to_id(token)

    def encode(self, text):
        """Token ids (list of ints) of ``text``, special tokens recognised, no BOS/EOS added."""
        ids = []
        for i, part in enumerate(self.special_pattern.split(text)):
            if i % 2:
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(self.sp_model.encode(part))
        return ids

    def apply_chat_template(self, conversation):
        """The conversation rendered by tokenizer_config.json's chat template (str), as transformers renders it:
        a sandboxed jinja2 environment with trim_blocks and lstrip_blocks, ``add_generation_prompt`` False."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return environment.from_string(self.chat_template).render(
            messages=conversation, add_generation_prompt=False, **self.template_tokens
        )

    def conversation_ids(self, conversation, reward_token_id):
        """Token ids of a rendered conversation, ending with ``reward_token_id`` (appended when missing)."""
        ids = self.encode(self.apply_chat_template(conversation))
        if not ids or ids[-1] != reward_token_id:
            ids.append(reward_token_id)
        return ids
