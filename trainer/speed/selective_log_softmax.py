"""log_softmax(logits / T).gather(index) of the sampled tokens, with a backward that keeps no fp32 copy of the logits.

The chapter's log-prob forward (8.2, ``compute_per_token_logps`` in ``trainer/rollout_engine.py``) calls
``selective_log_softmax``; its values and gradient are those of the plain formula (``tests/test_rollout.py``), and
the hand-written backward of ``SelectiveLogSoftmax`` is a memory optimisation only (docs/performance.md). The
token entropies of the same logits (``token_entropies``) are computed one row at a time for the same reason.
Shapes: B rows, n positions, V vocabulary size.
"""

import torch
from torch.autograd.function import once_differentiable


class SelectiveLogSoftmax(torch.autograd.Function):
    """log_softmax(logits / T).gather(index) with a hand-written backward that keeps only the logits.

    Autograd of the plain formula saves an fp32 copy of every row (``logits.float() / T``): a second
    [B, n, V] tensor. This function saves the logits themselves (alive anyway as the model's output), the
    index and the per-position logsumexp [B, n], and recomputes one row's softmax at a time in backward:
    d logp / d logits = (onehot(index) - softmax(logits / T)) / T. Extra memory: one row's fp32 [n, V].
    """

    @staticmethod
    def forward(ctx, logits, index, temperature):
        """logits [B, n, V] any float dtype, index long [B, n], temperature float -> fp32 [B, n]."""
        per_token_logps, logsumexps = [], []
        for logits_row, index_row in zip(logits, index):  # [n, V], [n]
            row = logits_row.to(torch.promote_types(logits_row.dtype, torch.float32))  # bf16/fp16 -> fp32
            if temperature != 1.0:
                row = row / temperature
            logsumexp = torch.logsumexp(row, dim=-1)  # [n]
            per_token_logps.append(row.gather(-1, index_row.unsqueeze(-1)).squeeze(-1) - logsumexp)
            logsumexps.append(logsumexp)
        ctx.save_for_backward(logits, index, torch.stack(logsumexps))
        ctx.temperature = temperature
        return torch.stack(per_token_logps)  # [B, n] fp32

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        """grad_output fp32 [B, n] -> grad of the logits [B, n, V] in the logits' dtype (first order only)."""
        logits, index, logsumexps = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits)  # [B, n, V] in the logits' dtype
        for b in range(logits.size(0)):
            row = logits[b].to(logsumexps.dtype)
            if temperature != 1.0:
                row = row / temperature
            probs = torch.exp(row - logsumexps[b].unsqueeze(-1))  # [n, V] softmax
            grad_row = -probs * grad_output[b].unsqueeze(-1)
            grad_row.scatter_add_(-1, index[b].unsqueeze(-1), grad_output[b].unsqueeze(-1))
            grad_logits[b] = grad_row / temperature
        return grad_logits, None, None


def selective_log_softmax(logits, index, temperature=1.0):
    """log_softmax(logits / temperature, -1).gather(-1, index) without a [B, n, V] log-softmax tensor (chapter 8.2).
    logits: [B, n, V] any float dtype; index: long [B, n] -> fp32 [B, n] (fp64 for fp64 logits), computed per row
    in fp32 (also under bf16 autocast): one row's [n, V] of extra memory (``SelectiveLogSoftmax``)."""
    return SelectiveLogSoftmax.apply(logits, index, float(temperature))


@torch.no_grad()
def token_entropies(logits, temperature=1.0):
    """Entropy -sum_v p log p (nats) of softmax(logits / temperature) at every position, one row at a time: logits
    [B, n, V] any float dtype -> fp32 [B, n], no gradient. The policy's token entropy TRL and verl log."""
    entropies = []
    for logits_row in logits:  # [n, V]
        row = logits_row.float() / temperature
        logps = torch.log_softmax(row, dim=-1)  # [n, V]
        entropies.append(-(logps.exp() * logps).sum(dim=-1))
    return torch.stack(entropies) if entropies else logits.new_zeros(logits.shape[:2], dtype=torch.float32)
