"""Per-token log-probs and entropies from the final hidden states, C tokens at a time (``--logprob_chunk_size``).

The chapter's forward (8.2, ``compute_per_token_logps``) builds the logits of every answer token at once, [N, R, V]:
with a 151,936-token vocabulary, 12 answers of 1,024 tokens make 7.5 GB in fp32, and their gradient as much again.
Here the model returns its final hidden states [N, R, hidden] (``skip_logits``), and the LM head, the log-softmax and
the gather run on C tokens at a time inside ``torch.utils.checkpoint``: a chunk's logits [C, V] exist while its
log-probs are computed and again, recomputed, while its gradient is; never all chunks' at once, in the forward or in
the backward. Each token's log-prob is that of the full forward (a row's log-softmax does not depend on other rows;
tests/test_memory_levers.py checks values and gradients). verl computes its entropies in chunks the same way
(``entropy_from_logits_with_chunking``); TRL's Liger loss fuses the head and the loss.
Shapes: N rows, R answer tokens, H hidden size, V vocabulary size, C tokens per chunk.
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from trainer.infra.distributed import unwrap_model
from trainer.rollout_engine import PolicyForward, compute_per_token_logps
from trainer.speed.selective_log_softmax import selective_log_softmax, token_entropies


def chunk_logps(lm_head, hidden_chunk, target_chunk, temperature, compute_entropy):
    """One chunk: hidden_chunk [1, C, H], target_chunk long [1, C] -> (log-probs fp32 [1, C], entropies fp32 [1, C]
    without gradient, or an empty tensor when ``compute_entropy`` is off)."""
    logits = lm_head(hidden_chunk)  # [1, C, V]
    per_token_logps = selective_log_softmax(logits, target_chunk, temperature)  # [1, C]
    entropies = token_entropies(logits, temperature) if compute_entropy else logits.new_zeros((1, 0))
    return per_token_logps, entropies


def chunked_logps_from_hidden(
    lm_head, hidden_states, target_ids, temperature=1.0, compute_entropy=False, chunk_size=1024
):
    """log_softmax(lm_head(hidden_states) / T).gather(target_ids) with at most ``chunk_size`` tokens' logits alive.

    lm_head: the model's LM head module (called as is, so LoRA layers and DDP's gradient hooks see it);
    hidden_states: [N, R, H] any float dtype, position r's state predicting target_ids[:, r]; target_ids: long [N, R];
    chunk_size: C >= 1 tokens per chunk (the N * R tokens are taken row-major). Returns (per_token_logps fp32 [N, R]
    with the gradient of the full computation, entropies fp32 [N, R] without gradient or None). The logits of a chunk
    are recomputed in the backward (non-reentrant ``checkpoint``), so the backward's peak is one chunk's too.
    Raises ValueError for chunk_size < 1.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 token, got {chunk_size}")
    num_rows, num_tokens = target_ids.shape
    flat_hidden = hidden_states.reshape(1, num_rows * num_tokens, -1)  # [1, N*R, H]
    flat_targets = target_ids.reshape(1, num_rows * num_tokens)  # [1, N*R]
    logps, entropies = [], []
    for start in range(0, num_rows * num_tokens, chunk_size):
        end = start + chunk_size
        chunk = checkpoint(
            chunk_logps,
            lm_head,
            flat_hidden[:, start:end],
            flat_targets[:, start:end],
            temperature,
            compute_entropy,
            use_reentrant=False,
        )  # ([1, C], [1, C] or [1, 0])
        logps.append(chunk[0])
        entropies.append(chunk[1])
    if not logps:
        empty = hidden_states.new_zeros((num_rows, num_tokens), dtype=torch.float32)  # [N, 0]
        return empty, (empty if compute_entropy else None)
    per_token_logps = torch.cat(logps, dim=1).reshape(num_rows, num_tokens)  # [N, R]
    entropies = torch.cat(entropies, dim=1).reshape(num_rows, num_tokens) if compute_entropy else None  # [N, R]
    return per_token_logps, entropies


def chunked_per_token_logps(
    model, input_ids, n_keep, attention_mask=None, temperature=1.0, compute_entropy=False, chunk_size=1024
):
    """``compute_per_token_logps`` (chapter 8.2) without the [B, R, V] logits: one forward to the final hidden
    states (``skip_logits``), then ``chunked_logps_from_hidden`` over ``chunk_size`` tokens at a time. Same
    arguments and ``PolicyForward`` result (per_token_logps fp32 [B, R], aux_loss, entropies fp32 [B, R] or None);
    ``model`` may be the DDP wrapper (the forward goes through it)."""
    if n_keep <= 0:
        empty = torch.zeros((input_ids.size(0), 0), dtype=torch.float32, device=input_ids.device)  # [B, 0]
        return PolicyForward(empty, torch.zeros((), device=input_ids.device), empty if compute_entropy else None)
    out = model(input_ids, attention_mask=attention_mask, logits_to_keep=n_keep + 1, skip_logits=True)
    hidden_states = out.last_hidden_state[:, :-1, :]  # [B, R, H], position t predicting token t + 1
    per_token_logps, entropies = chunked_logps_from_hidden(
        lm_head_of(model), hidden_states, input_ids[:, -n_keep:], temperature, compute_entropy, chunk_size
    )
    return PolicyForward(per_token_logps, out.aux_loss, entropies)


def lm_head_of(model):
    """The LM head module of a MiniMind causal LM, through DDP, ``torch.compile`` and peft wrappers."""
    return unwrap_model(model).get_output_embeddings()


def log_prob_forward(chunk_size):
    """The log-prob forward of ``--logprob_chunk_size``: the chapter's ``compute_per_token_logps`` for 0, else
    ``chunked_per_token_logps`` with ``chunk_size`` tokens per chunk (same arguments, same result)."""
    if chunk_size:
        return functools.partial(chunked_per_token_logps, chunk_size=chunk_size)
    return compute_per_token_logps
