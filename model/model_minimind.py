"""MiniMind causal language model and the PPO critic.

Architecture (the MiniMind-3 / Qwen3 layout): token embedding, ``num_hidden_layers`` pre-norm blocks of
grouped-query attention (RMSNorm on q and k per head, rotary position embedding) and a SwiGLU MLP (or a routed
mixture of SwiGLU experts when ``use_moe``, ``model/model_moe.py``), a final RMSNorm and an LM head tied to the
embedding. Parameter names are those of MiniMind's published ``.pth`` checkpoints and of transformers'
``Qwen3ForCausalLM`` (``tests/test_model.py`` checks that both give the same logits).

Shapes in the docstrings: B batch, T tokens in this call, S tokens attended to (cache + T), H attention heads,
Hkv key/value heads, D head_dim, V vocabulary size.
"""

import math
import torch
import torch.nn.functional as F
from torch import nn
from dataclasses import dataclass
from typing import NamedTuple, Optional

from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.utils import ModelOutput

from model.model_moe import MOEFeedForward


class MiniMindConfig(PretrainedConfig):
    """Hyper-parameters of a MiniMind model; defaults are MiniMind-3's (hidden 768, 8 layers).

    ``intermediate_size`` defaults to ceil(hidden_size * pi / 64) * 64 and ``head_dim`` to
    hidden_size / num_attention_heads, as in MiniMind.

    Raises:
        ValueError: if hidden_size is not divisible by num_attention_heads (without an explicit head_dim)
            or num_attention_heads is not a multiple of num_key_value_heads.
    """

    model_type = "minimind"

    def __init__(
        self,
        hidden_size=768,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=None,
        intermediate_size=None,
        vocab_size=6400,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        dropout=0.0,
        initializer_range=0.02,
        use_moe=False,
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=None,
        norm_topk_prob=True,
        router_aux_loss_coef=5e-4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
        **kwargs,
    ):
        if head_dim is None and hidden_size % num_attention_heads != 0:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads}")
        if num_attention_heads % num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} must be a multiple of "
                f"num_key_value_heads={num_key_value_heads}"
            )
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size or math.ceil(hidden_size * math.pi / 64) * 64
        self.vocab_size = vocab_size
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.dropout = dropout
        self.initializer_range = initializer_range
        self.use_moe = use_moe
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size or self.intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.router_aux_loss_coef = router_aux_loss_coef
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


class RMSNorm(nn.Module):
    """Root-mean-square norm: weight * x / sqrt(mean(x^2) + eps), computed in fp32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        """x: [..., dim] any float dtype -> same shape; fp32 for an fp32 x. For a bf16 x (autocast) the norm is
        computed in fp32 and the fp32 weight promotes the result to fp32; the next matrix product casts it back."""
        if x.dtype == torch.float32:  # one fused op, the same formula (about 10% of a small model's decode step)
            return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotate_half(x):
    """[x1, x2] -> [-x2, x1] on the last dimension (the half-split RoPE layout of Llama/Qwen)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotary position embedding (Su et al. 2021, RoFormer).

    q: [B, H, T, D], k: [B, Hkv, T, D], cos/sin: [B, T, D] -> rotated q, k with the same shapes.
    """
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_rotated = q * cos + rotate_half(q) * sin
    k_rotated = k * cos + rotate_half(k) * sin
    return q_rotated.to(q.dtype), k_rotated.to(k.dtype)


class KVCache:
    """Per-layer key/value cache that grows in place (preallocate with ``capacity`` to avoid copies).

    keys[i], values[i]: [B, Hkv, capacity, D]; ``seq_len`` is how many positions are filled.
    """

    def __init__(self, num_layers, capacity=0):
        self.num_layers = num_layers
        self.capacity = capacity
        self.keys = [None] * num_layers
        self.values = [None] * num_layers
        self.seq_len = 0

    def update(self, layer_idx, key, value):
        """Write key/value [B, Hkv, T, D] after the cached positions; return the whole [B, Hkv, S, D]."""
        start = self.seq_len
        end = start + key.size(2)
        if self.keys[layer_idx] is None:
            shape = (key.size(0), key.size(1), max(self.capacity, end), key.size(3))
            self.keys[layer_idx] = key.new_zeros(shape)
            self.values[layer_idx] = value.new_zeros(shape)
        elif end > self.keys[layer_idx].size(2):
            grow = end - self.keys[layer_idx].size(2)
            pad_shape = (key.size(0), key.size(1), grow, key.size(3))
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key.new_zeros(pad_shape)], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value.new_zeros(pad_shape)], dim=2)
        self.keys[layer_idx][:, :, start:end] = key
        self.values[layer_idx][:, :, start:end] = value
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def repeat_interleave(self, repeats, extra_capacity=0):
        """A new cache whose row b * repeats + g (g < repeats) holds row b of this one (the rollout's P0,P0,..,P1
        order), with room for ``extra_capacity`` more positions. Differentiable: a forward that reads the new
        cache sends its gradient back to the keys and values of this one (summed over the repeats)."""
        repeated = KVCache(self.num_layers, capacity=self.seq_len + extra_capacity)
        repeated.seq_len = self.seq_len
        for i in range(self.num_layers):
            for source, target in ((self.keys, repeated.keys), (self.values, repeated.values)):
                filled = source[i][:, :, : self.seq_len].repeat_interleave(repeats, dim=0)  # [B*G, Hkv, S, D]
                room = filled.new_zeros((*filled.shape[:2], extra_capacity, filled.size(3)))  # [B*G, Hkv, extra, D]
                target[i] = torch.cat([filled, room], dim=2)  # [B*G, Hkv, S + extra, D]
        return repeated


class Attention(nn.Module):
    """Grouped-query self-attention with per-head q/k RMSNorm and RoPE (Qwen3 layout)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, attn_mask, past_key_values=None):
        """x: [B, T, hidden]; attn_mask: bool [B, 1, T, S] (True = attend) or None for plain causal."""
        batch, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # q [B, H, T, D], k [B, Hkv, T, D]
        if past_key_values is not None:
            k, v = past_key_values.update(self.layer_idx, k, v)  # [B, Hkv, S, D]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=attn_mask is None and seq > 1,
            enable_gqa=True,
        )  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MiniMindBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MOEFeedForward(config, FeedForward) if config.use_moe else FeedForward(config)

    def forward(self, x, cos, sin, attn_mask, past_key_values=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_attention_mask(attention_mask, query_len, past_len, device=None):
    """Combine causality with a key-padding mask.

    Args:
        attention_mask: long/bool [B, S] with 1 on real tokens (S = past_len + query_len), or None.
        query_len: T, the number of new positions in this call.
        past_len: positions already in the KV cache.
        device: where to build the mask when ``attention_mask`` is None.
    Returns:
        bool [B, 1, T, S], True where query t may attend key s; None when there is no padding and no
        cache (then SDPA's own causal path is used). Each query also attends itself, so a padding
        query never has an empty row (which would give NaN); padding outputs are never read.
    """
    if attention_mask is None and past_len == 0:
        return None
    device = attention_mask.device if attention_mask is not None else device
    key_pos = torch.arange(past_len + query_len, device=device)  # [S]
    query_pos = torch.arange(past_len, past_len + query_len, device=device)  # [T]
    causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [T, S]
    if attention_mask is None:
        return causal[None, None]
    mask = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)  # [B, T, S]
    mask = mask | (key_pos.unsqueeze(0) == query_pos.unsqueeze(1)).unsqueeze(0)
    return mask.unsqueeze(1)


class MiniMindModel(nn.Module):
    """Embedding + blocks + final norm; returns hidden states [B, T, hidden] and the MoE aux loss."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([MiniMindBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]
        # transformers' activation checkpointing sets these two (``activation_checkpointing_enable``): each block's
        # activations are then recomputed in the backward instead of kept (Chen et al. 2016)
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = None

    def rotary_embedding(self, position_ids, dtype):
        """position_ids: long [B, T] -> (cos, sin), each [B, T, D] in ``dtype``."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        """input_ids: long [B, T]; attention_mask: [B, S] (1 = real token) over cache + new tokens.

        Positions count real tokens only, so a left-padded row gets the same positions as when it is
        scored alone. With activation checkpointing on (``activation_checkpointing_enable``) a training forward
        with gradients keeps each block's input only and recomputes the block in the backward.

        Raises:
            ValueError: a checkpointed training forward with ``past_key_values``: the recomputation would write
                the cache a second time, after its filled positions.
        """
        batch, seq = input_ids.shape
        past_len = past_key_values.seq_len if past_key_values is not None else 0
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, S]
            position_ids = position_ids[:, attention_mask.size(1) - seq :]  # [B, T] (T = 0 gives [B, 0])
        else:
            position_ids = torch.arange(past_len, past_len + seq, device=input_ids.device).expand(batch, seq)
        hidden_states = self.dropout(self.embed_tokens(input_ids))  # [B, T, hidden]
        cos, sin = self.rotary_embedding(position_ids, hidden_states.dtype)
        attn_mask = build_attention_mask(attention_mask, seq, past_len, input_ids.device)
        checkpointed = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        if checkpointed and past_key_values is not None:
            raise ValueError(
                "activation checkpointing recomputes each block in the backward, which would write the KV cache "
                "again: a checkpointed training forward takes no past_key_values (GRPO: --shared_prefix 0)"
            )
        for layer in self.layers:
            if checkpointed:
                hidden_states = self._gradient_checkpointing_func(layer.__call__, hidden_states, cos, sin, attn_mask)
            else:
                hidden_states = layer(hidden_states, cos, sin, attn_mask, past_key_values)
        if past_key_values is not None:
            past_key_values.seq_len += seq
        hidden_states = self.norm(hidden_states)
        aux_loss = hidden_states.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            if isinstance(layer.mlp, MOEFeedForward):
                aux_loss = aux_loss + layer.mlp.aux_loss
        return hidden_states, aux_loss


@dataclass
class CausalLMOutput(MoeCausalLMOutputWithPast):
    """What ``MiniMindForCausalLM`` returns: transformers' MoE causal-LM output (``logits``, ``aux_loss``, ``cache``)
    and ``last_hidden_state`` [B, T or k, hidden], the final norm's output at the positions the logits are of."""

    last_hidden_state: Optional[torch.Tensor] = None


class MiniMindPreTrainedModel(PreTrainedModel):
    """Common weight init for MiniMind models: normal(0, initializer_range) for linear and embedding."""

    config_class = MiniMindConfig
    base_model_prefix = "model"
    _supports_sdpa = True
    supports_gradient_checkpointing = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class MiniMindForCausalLM(MiniMindPreTrainedModel):
    """MiniMind language model: backbone + LM head (tied to the embedding by default)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config=None):
        config = config or MiniMindConfig()
        super().__init__(config)
        self.model = MiniMindModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.post_init()

    def forward(
        self,
        input_ids,
        attention_mask=None,
        past_key_values=None,
        use_cache=False,
        logits_to_keep=0,
        skip_logits=False,
        **kwargs,
    ):
        """Next-token logits.

        Args:
            input_ids: long [B, T].
            attention_mask: [B, S] with 1 on real tokens, S = cached + T (left padding supported).
            past_key_values: a ``KVCache`` or None; with ``use_cache`` and None, a new cache is made.
            logits_to_keep: k > 0 computes logits of the last k positions only; 0 keeps all T.
            skip_logits: return the final hidden states of those positions instead of their logits (``logits``
                None): a caller that applies ``lm_head`` chunk by chunk never holds [B, T, V]
                (``trainer/speed/chunked_logps.py``).
        Returns:
            ``CausalLMOutput`` with ``logits`` [B, T or k, V] (model dtype; None with ``skip_logits``),
            ``last_hidden_state`` [B, T or k, hidden] (after the final norm), ``aux_loss`` (scalar fp32, 0 without
            MoE) and ``cache`` (the ``KVCache``, or None).
        """
        if use_cache and past_key_values is None:
            past_key_values = KVCache(self.config.num_hidden_layers)
        hidden_states, aux_loss = self.model(input_ids, attention_mask, past_key_values)
        if logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:, :]
        logits = None if skip_logits else self.lm_head(hidden_states)
        return CausalLMOutput(logits=logits, aux_loss=aux_loss, cache=past_key_values, last_hidden_state=hidden_states)

    @torch.no_grad()
    def generate(
        self,
        input_ids,
        attention_mask=None,
        max_new_tokens=256,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        eos_token_id=2,
        pad_token_id=0,
        generator=None,
    ):
        """Sample continuations of left-padded prompts with a KV cache allocated once (chapter 8.2).

        input_ids: long [B, P]; attention_mask: [B, P] (1 = real token) or None. Each step takes logits /
        temperature, keeps the top_k most likely tokens (0 = all) and the smallest set reaching top_p
        (``sample_next_token``; do_sample=False is greedy). A row stops after ``eos_token_id``; its later
        positions get ``pad_token_id``; decoding stops once every row has. ``generator``: reproducible sampling.
        Returns ``Generation``: output_ids long [B, P + R], R <= max_new_tokens, and per_token_logps fp32 [B, R],
        log_softmax(logits / temperature) of each sampled token before top-k / top-p truncation (the convention of
        ``trainer/rollout_engine.py``), 0 after a row's EOS.
        Raises ValueError if temperature <= 0 while sampling, or top_p is not in (0, 1].
        """
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        batch, prompt_len = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        # one mask for all steps, filled in place: [B, P + R_max]
        full_mask = attention_mask.new_zeros((batch, prompt_len + max_new_tokens))
        full_mask[:, :prompt_len] = attention_mask
        cache = KVCache(self.config.num_hidden_layers, capacity=prompt_len + max_new_tokens)
        finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)  # [B]
        new_tokens, new_logps = [], []
        logits = self(input_ids, attention_mask=attention_mask, past_key_values=cache, logits_to_keep=1).logits
        for step in range(max_new_tokens):
            last_logits = logits[:, -1, :]  # [B, V]
            next_token = sample_next_token(last_logits, do_sample, temperature, top_p, top_k, generator)  # [B]
            next_token = torch.where(finished, torch.full_like(next_token, pad_token_id), next_token)
            new_tokens.append(next_token)
            row_logps = torch.log_softmax(last_logits.float() / (temperature if do_sample else 1.0), dim=-1)  # [B, V]
            picked = row_logps.gather(-1, next_token.unsqueeze(-1)).squeeze(-1)  # [B]
            new_logps.append(torch.where(finished, torch.zeros_like(picked), picked))
            finished = finished | (next_token == eos_token_id)
            if bool(finished.all()) or step + 1 == max_new_tokens:
                break
            full_mask[:, prompt_len + step] = (~finished).to(full_mask.dtype)
            logits = self(
                next_token.unsqueeze(1), attention_mask=full_mask[:, : prompt_len + step + 1], past_key_values=cache
            ).logits
        if not new_tokens:
            return Generation(input_ids, input_ids.new_zeros((batch, 0), dtype=torch.float32))
        output_ids = torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)  # [B, P + R]
        return Generation(output_ids, torch.stack(new_logps, dim=1))  # [B, P + R], [B, R]


class Generation(NamedTuple):
    """What ``MiniMindForCausalLM.generate`` returns."""

    output_ids: torch.Tensor  # long [B, P + R], the prompts followed by the completions
    per_token_logps: torch.Tensor  # fp32 [B, R], log pi of each sampled token at sampling time, 0 after EOS


def sample_next_token(logits, do_sample, temperature, top_p, top_k, generator=None):
    """Pick one token per row from logits [B, V] (temperature, top-k, nucleus top-p) -> long [B].

    Sampling is by inverse CDF: the first token whose cumulative probability (fp64) exceeds u * total,
    u ~ U[0, 1). It draws from exactly the same distribution as ``torch.multinomial(probs, 1)`` with one
    uniform number per row instead of V exponential ones (about 30x faster for V = 6400 on a CPU).
    A token of probability 0 (cut by top-k / top-p) is never picked.

    Raises:
        ValueError: naming the rows whose logits hold NaN/inf or are all -inf (``torch.multinomial`` raised
            on those too; sampling from them would return junk tokens silently).
    """
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and 0 < top_k < logits.size(-1):
        kth_value = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth_value, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keep the token that crosses top_p
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    cdf = logits.softmax(dim=-1).double().cumsum(dim=-1)  # [B, V]
    if not bool(torch.isfinite(cdf[:, -1]).all()):  # NaN/inf logits, or a row with every token cut
        bad_rows = (~torch.isfinite(cdf[:, -1])).nonzero().flatten().tolist()
        raise ValueError(
            f"cannot sample: the logits of rows {bad_rows} are NaN/inf or all -inf "
            f"(a diverged policy? see --max_bad_steps)"
        )
    u = torch.rand((logits.size(0), 1), generator=generator, dtype=torch.float64, device=logits.device)  # [B, 1]
    next_token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # [B]
    return next_token.clamp(max=logits.size(-1) - 1)


@dataclass
class CriticOutput(ModelOutput):
    """What ``CriticModel`` returns: ``values`` fp32 [B, T], V(s_t) at every position, and ``aux_loss``, the MoE
    load-balancing loss of the critic's own routers (a 0 tensor for a dense model)."""

    values: Optional[torch.Tensor] = None
    aux_loss: Optional[torch.Tensor] = None


class CriticModel(MiniMindPreTrainedModel):
    """PPO value model (chapter 8.4.1): the MiniMind backbone and final norm, then value_head: Linear(hidden, 1).

    forward(input_ids, attention_mask) -> ``CriticOutput`` (values fp32 [B, T], aux_loss). It is initialised
    from the actor's SFT weights with ``load_actor_state_dict``, which loads strictly except for the new
    ``value_head.weight`` / ``value_head.bias`` (and ignores the LM head, which the critic does not have).
    The value head starts at zero, so the critic predicts V = 0 until it has learned something. The final RMSNorm
    is applied once, ``MiniMindModel``'s own (the chapter's critic applies it twice: docs/departures.md).
    """

    def __init__(self, config=None):
        config = config or MiniMindConfig()
        super().__init__(config)
        self.model = MiniMindModel(config)
        self.value_head = nn.Linear(config.hidden_size, 1)
        self.post_init()
        # V(s) = 0 at the start: the first advantages are the (discounted) reward itself rather than the noise of
        # a random head, which whitening would blow up to the scale of the reward signal.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        """``CriticOutput``: values fp32 [B, T] and the critic's router loss, which PPO adds to its loss as it does
        the actor's."""
        hidden_states, aux_loss = self.model(input_ids, attention_mask)  # [B, T, hidden], already normed
        values = self.value_head(hidden_states).squeeze(-1).float()  # [B, T]
        return CriticOutput(values=values, aux_loss=aux_loss)

    def load_actor_state_dict(self, state_dict):
        """Load an actor (``MiniMindForCausalLM``) state dict into the backbone.

        Raises:
            RuntimeError: if any backbone weight is missing, or a key other than ``lm_head.weight`` is
                unexpected; the only keys left at their fresh init are ``value_head.weight/bias``.
        """
        backbone = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        result = self.load_state_dict(backbone, strict=False)
        missing = set(result.missing_keys) - {"value_head.weight", "value_head.bias"}
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"critic init from actor weights: missing {sorted(missing)}, "
                f"unexpected {sorted(result.unexpected_keys)}"
            )
