"""GRPO's forward of a rollout with each prompt computed once for its G answers (``--shared_prefix 1``).

The G answers of a prompt share its P tokens, and with causal attention the keys and values of those tokens do not
depend on the answers. So the prompts run once, [B, P], their keys and values are repeated for the G answers of each
(``KVCache.repeat_interleave``), and the answers run on top, [B*G, R - 1]: the log-probs of the [B*G, P + R] forward,
with the prompt computed B times instead of B*G. The gradient of the repeated keys and values sums over the G answers,
as it does for separate rows (the "shared-prefix forward" of Prefix Grouper, Liu et al. 2025). Equal to the padded
forward in tests/test_forward_layouts.py; the speed it buys in docs/performance.md.
"""

import torch

from model.model_minimind import KVCache
from trainer.infra.distributed import unwrap_model
from trainer.rollout_engine import PolicyForward, compute_per_token_logps
from trainer.speed.chunked_logps import chunked_logps_from_hidden, lm_head_of
from trainer.speed.selective_log_softmax import selective_log_softmax, token_entropies


def shared_prefix_forward(model, rollout, num_generations, temperature=1.0, compute_entropy=True, logprob_chunk_size=0):
    """``PolicyForward`` of a rollout's B*G answers (chapter 8.2), each prompt's forward done once.

    model: a dense MiniMind causal LM or its DDP wrapper (both forwards go through it; with MoE the router loss of
    two forwards is not the padded batch's). rollout: a ``RolloutResult`` whose rows are B groups of G answers.
    Returns per_token_logps fp32 [B*G, R] (finite but meaningless after a row's EOS), the two forwards' router losses
    added, and the token entropies fp32 [B*G, R] with ``compute_entropy`` (else None). ``logprob_chunk_size`` C > 0:
    the answers' logits C tokens at a time (``chunked_logps.py``).
    """
    completion_ids, completion_mask = rollout.completion_ids, rollout.completion_mask  # [B*G, R]
    num_completion_tokens = completion_ids.size(1)
    if num_completion_tokens == 0:
        return compute_per_token_logps(
            model, rollout.output_ids, 0, rollout.attention_mask, temperature, compute_entropy
        )
    prompt_ids = rollout.output_ids[::num_generations, : rollout.prompt_mask.size(1)]  # [B, P], one row per group
    prompt_mask = rollout.prompt_mask[::num_generations]  # [B, P]
    cache = KVCache(unwrap_model(model).config.num_hidden_layers)
    prompt_out = model(
        prompt_ids, attention_mask=prompt_mask, past_key_values=cache, logits_to_keep=1
    )  # logits [B, 1, V]: the prompt's last position predicts answer token 0
    first_logits = prompt_out.logits.repeat_interleave(num_generations, dim=0)  # [B*G, 1, V]
    per_token_logps = selective_log_softmax(first_logits, completion_ids[:, :1], temperature)  # [B*G, 1]
    entropies = token_entropies(first_logits, temperature) if compute_entropy else None  # [B*G, 1]
    aux_loss = prompt_out.aux_loss
    if num_completion_tokens > 1:  # answer token t predicts t + 1
        cache = cache.repeat_interleave(num_generations, extra_capacity=num_completion_tokens - 1)
        repeated_prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # [B*G, P]
        full_mask = torch.cat([repeated_prompt_mask, completion_mask[:, :-1]], dim=1)  # [B*G, P + R - 1]
        completion_out = model(
            completion_ids[:, :-1], attention_mask=full_mask, past_key_values=cache, skip_logits=logprob_chunk_size > 0
        )  # logits [B*G, R - 1, V] (or the hidden states [B*G, R - 1, H] with chunks)
        if logprob_chunk_size:
            rest_logps, rest_entropies = chunked_logps_from_hidden(
                lm_head_of(model),
                completion_out.last_hidden_state,
                completion_ids[:, 1:],
                temperature,
                compute_entropy,
                logprob_chunk_size,
            )  # [B*G, R - 1] each
        else:
            rest_logps = selective_log_softmax(completion_out.logits, completion_ids[:, 1:], temperature)  # [B*G, R-1]
            rest_entropies = token_entropies(completion_out.logits, temperature) if compute_entropy else None
        per_token_logps = torch.cat([per_token_logps, rest_logps], dim=1)  # [B*G, R]
        if compute_entropy:
            entropies = torch.cat([entropies, rest_entropies], dim=1)  # [B*G, R]
        aux_loss = aux_loss + completion_out.aux_loss
    return PolicyForward(per_token_logps, aux_loss, entropies)
