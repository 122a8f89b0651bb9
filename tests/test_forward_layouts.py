"""GRPO's shared-prefix forward (``group_policy_forward``, ``--shared_prefix``) gives the same log-probs,
losses and gradients as every answer with its own copy of the prompt.

The reference values come from each row scored alone (no padding at all, a plain log_softmax) and from the padded
forward with its attention mask, which tests/test_model.py checks against transformers' Qwen3.
"""

import math
import types

import pytest
import torch

from trainer.rollout_engine import compute_per_token_logps
from trainer.train_grpo import group_policy_forward, grpo_loss
from trainer.trainer_utils import completion_mask_from_ids

EOS = 2
PAD = 0


def grouped_batch():
    """Two left-padded prompts (3 and 5 tokens) with G = 3 answers each, of 4 columns: ragged, truncated and empty.

    Returns (prompt_ids [2, 5], prompt_mask [2, 5], completion_ids [6, 4], completion_mask [6, 4])."""
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]
    completions = [
        [41, 42, 43, 44],
        [EOS, PAD, PAD, PAD],
        [45, EOS, PAD, PAD],
        [51, 52, EOS, PAD],
        [53, 54, 55, 56],
        [EOS, PAD, PAD, PAD],
    ]
    prompt_ids = torch.tensor([[PAD] * (5 - len(p)) + p for p in prompts])  # [2, 5]
    prompt_mask = torch.tensor([[0] * (5 - len(p)) + [1] * len(p) for p in prompts])  # [2, 5]
    completion_ids = torch.tensor(completions)  # [6, 4]
    return prompt_ids, prompt_mask, completion_ids, completion_mask_from_ids(completion_ids, EOS)


def as_rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, num_generations):
    """The fields of a ``RolloutResult`` that the forwards read, in the rollout's own layout [B*G, P + R]."""
    output_ids, attention_mask = padded_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, num_generations)
    return types.SimpleNamespace(
        output_ids=output_ids,
        attention_mask=attention_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
    )


def padded_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, num_generations):
    """The rollout's own layout: each prompt repeated G times, then its answers -> (ids, mask), [B*G, P + R]."""
    input_ids = torch.cat([prompt_ids.repeat_interleave(num_generations, dim=0), completion_ids], dim=1)
    mask = torch.cat([prompt_mask.repeat_interleave(num_generations, dim=0), completion_mask], dim=1)
    return input_ids, mask


def test_shared_prompt_logps_equal_each_row_alone(policy):
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch()
    rollout = as_rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
    per_token_logps = group_policy_forward(policy, rollout, 3, temperature=0.7).per_token_logps  # [6, 4]
    assert per_token_logps.shape == (6, 4)
    for i in range(6):
        prompt = prompt_ids[i // 3][prompt_mask[i // 3].bool()]
        completion = completion_ids[i][completion_mask[i].bool()]
        row = torch.cat([prompt, completion])
        with torch.no_grad():
            logits = policy(row.unsqueeze(0)).logits[0, len(prompt) - 1 : -1] / 0.7  # [n, V]
        expected = torch.log_softmax(logits, dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        assert (per_token_logps[i, : len(completion)] - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("loss_type", ["cispo", "grpo"])
def test_shared_prompt_loss_and_gradients_equal_the_padded_batch(policy, loss_type):
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch()
    input_ids, attention_mask = padded_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
    torch.manual_seed(2)
    old = torch.randn(6, 4) * 0.1 - 8.0  # [6, 4]
    ref = torch.randn(6, 4) * 0.1 - 8.0  # [6, 4]
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.7, -1.4, 0.7])  # [6]
    results = []
    for shared in (False, True):
        policy.zero_grad()
        if shared:
            rollout = as_rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
            logps = group_policy_forward(policy, rollout, 3).per_token_logps
        else:
            logps = compute_per_token_logps(policy, input_ids, 4, attention_mask).per_token_logps
        loss, _, _ = grpo_loss(logps, old, ref, advantages, completion_mask, loss_type, beta=0.1)
        loss.backward()
        results.append(
            (
                logps.detach()[completion_mask.bool()],
                loss.item(),
                {name: p.grad.clone() for name, p in policy.named_parameters()},
            )
        )
    (padded_logps, padded_loss, padded_grads), (shared_logps, shared_loss, shared_grads) = results
    assert (padded_logps - shared_logps).abs().max() <= 1e-5
    assert shared_loss == pytest.approx(padded_loss, abs=1e-5)
    for name, grad in padded_grads.items():
        assert grad.abs().max() > 0, name  # every weight takes part, so the comparison below is not 0 == 0
        assert (shared_grads[name] - grad).abs().max() <= 1e-5, name


def test_shared_prompt_checks_the_group_size(policy):
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch()
    rollout = as_rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
    with pytest.raises(ValueError, match="6 completions are not groups of 4"):
        group_policy_forward(policy, rollout, 4)
    empty_rollout = as_rollout(prompt_ids, prompt_mask, completion_ids[:, :0], completion_mask[:, :0], 3)
    empty = group_policy_forward(policy, empty_rollout, 3).per_token_logps
    assert empty.shape == (6, 0)


@pytest.mark.parametrize("num_completion_tokens", [1, 2])
def test_shared_prompt_with_one_token_prompts_and_one_token_answers(policy, num_completion_tokens):
    """R = 1 (every answer EOS first, or --max_gen_len 1) has no answer forward; P = 1 is a prompt of one token."""
    prompt_ids = torch.tensor([[PAD, 11], [21, 22]])  # [2, 2]: a one-token prompt, left-padded
    prompt_mask = torch.tensor([[0, 1], [1, 1]])
    completion_ids = torch.tensor([[EOS, PAD], [41, EOS], [EOS, PAD], [51, 52]])[:, :num_completion_tokens]  # [4, R]
    completion_mask = completion_mask_from_ids(completion_ids, EOS)
    rollout = as_rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, 2)
    shared = group_policy_forward(policy, rollout, 2).per_token_logps
    input_ids, attention_mask = padded_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, 2)
    padded = compute_per_token_logps(policy, input_ids, num_completion_tokens, attention_mask).per_token_logps
    assert shared.shape == padded.shape == (4, num_completion_tokens)
    mask = completion_mask.bool()
    assert (shared - padded)[mask].abs().max() <= 1e-5


def test_token_entropies_equal_a_plain_sum_and_match_between_layouts(policy):
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch()
    rollout = as_rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
    shared = group_policy_forward(policy, rollout, 3, temperature=0.7)
    input_ids, attention_mask = padded_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
    padded = compute_per_token_logps(policy, input_ids, 4, attention_mask, temperature=0.7, compute_entropy=True)
    mask = completion_mask.bool()
    assert (shared.entropies - padded.entropies)[mask].abs().max() <= 1e-4
    prompt = prompt_ids[0][prompt_mask[0].bool()].tolist()  # row 0 alone: -sum p log p with Python floats
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + completion_ids[0].tolist()])).logits[0, len(prompt) - 1 : -1] / 0.7
    for t, row in enumerate(torch.softmax(logits.double(), dim=-1).tolist()):
        expected = -sum(p * math.log(p) for p in row if p > 0)
        assert padded.entropies[0, t].item() == pytest.approx(expected, abs=1e-4)
