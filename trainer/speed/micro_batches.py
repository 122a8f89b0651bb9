"""Micro-batches (``--micro_batch_size M``): the forwards of a rollout on M answers at a time, the same update.

The activations of a forward and its backward grow with the rows it takes; M rows at a time bound them by M whatever
the batch. The gradients of the micro-batches add up in ``.grad`` before the one optimizer step, so each micro-batch's
loss is weighted to make the sum the whole batch's loss (``micro_batch_weight``):

  - a mean over answers (cispo, grpo, sapo, luspo; dr_grpo's rows x L): a micro-batch's mean of m answers is weighted
    m / N, so the weighted sum is the mean over all N;
  - bnpo, one mean over the batch's answer tokens: a micro-batch's mean over its t tokens is weighted t / T;
  - dapo, vespo (a token sum over the window's tokens, ``TOKEN_SUM_LOSS_TYPES``): sums add up, weight 1;
  - the MoE router loss of each forward: weighted m / N, the mean of the micro-batches' (a router loss is a statistic
    of the rows it sees, so it is not the whole batch's, as under gradient accumulation in TRL and transformers).

Metrics are computed once on the micro-batches' detached tensors put back together, so they are the whole batch's.
Shapes: N rows of a batch, R answer tokens.
"""

from dataclasses import replace

from trainer.grpo_family import TOKEN_SUM_LOSS_TYPES


def micro_batch_slices(num_rows, micro_batch_size, group_size=1):
    """The row ranges of the micro-batches, in order: ``micro_batch_size`` rows each (the last may be shorter), one
    slice of all rows for 0. ``group_size``: the rows must come in whole groups of this many (GRPO's shared prefix
    runs a group's prompt once).

    Raises:
        ValueError: micro_batch_size < 0, or not a multiple of ``group_size``.
    """
    if micro_batch_size < 0:
        raise ValueError(f"micro_batch_size must be >= 0, got {micro_batch_size}")
    if micro_batch_size == 0 or micro_batch_size >= num_rows:
        return [slice(0, num_rows)]
    if micro_batch_size % group_size:
        raise ValueError(f"micro_batch_size {micro_batch_size} is not a multiple of the group size {group_size}")
    return [slice(start, min(start + micro_batch_size, num_rows)) for start in range(0, num_rows, micro_batch_size)]


def micro_batch_weight(loss_type, rows, total_rows, tokens, total_tokens):
    """The weight of one micro-batch's loss (module docstring): 1 for a token sum (dapo, vespo), tokens / total_tokens
    for bnpo (1 when the batch has no answer token), rows / total_rows for every mean over answers. Floats -> float."""
    if loss_type in TOKEN_SUM_LOSS_TYPES:
        return 1.0
    if loss_type == "bnpo":
        return float(tokens) / float(total_tokens) if total_tokens else 1.0
    return float(rows) / float(total_rows)


def rollout_rows(rollout, rows):
    """The ``RolloutResult`` of the rows ``rows`` (a slice) of ``rollout``: every per-row field cut, the metrics
    kept."""
    sampling = rollout.sampling_per_token_logps
    return replace(
        rollout,
        output_ids=rollout.output_ids[rows],
        completion_ids=rollout.completion_ids[rows],
        per_token_logps=rollout.per_token_logps[rows],
        completions=rollout.completions[rows],
        completion_mask=rollout.completion_mask[rows],
        prompt_mask=rollout.prompt_mask[rows],
        sampling_per_token_logps=None if sampling is None else sampling[rows],
    )
