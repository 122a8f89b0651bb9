"""Forward layouts that skip work: --flush_left (``flush_left_batch``) and GRPO's shared prompts
(``compute_group_per_token_logps``) give the same log-probs, losses and gradients as the padded batch with its mask.

The reference values come from each row scored alone (no padding at all, a plain log_softmax) and from the padded
forward with its attention mask, which tests/test_model.py checks against transformers' Qwen3.
"""
import pytest
import torch

from model.model_minimind import CriticModel, MiniMindForCausalLM
from trainer.rollout_engine import compute_group_per_token_logps, compute_per_token_logps, flush_left_batch
from trainer.train_grpo import grpo_loss
from trainer.trainer_utils import build_config, completion_mask_from_ids

EOS = 2
PAD = 0


def ragged_batch():
    """Three rows of a rollout's layout: left-padded prompts of 3, 5 and 2 tokens, then completions of 4 columns:
    a truncated answer (4 tokens, no EOS), an answer of 2 tokens + EOS, and an empty answer (EOS first).

    Returns (input_ids long [3, 9], attention_mask long [3, 9], completion_mask long [3, 4])."""
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32]]
    completions = [[41, 42, 43, 44], [51, 52, EOS, PAD], [EOS, PAD, PAD, PAD]]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p + c for p, c in zip(prompts, completions)])  # [3, 9]
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [3, 5]
    completion_mask = completion_mask_from_ids(torch.tensor(completions), EOS)  # [3, 4]
    return input_ids, torch.cat([prompt_mask, completion_mask], dim=1), completion_mask


@pytest.fixture
def policy():
    torch.manual_seed(0)
    config = build_config(hidden_size=64, num_hidden_layers=2, use_moe=0)
    config.initializer_range = 0.1
    return MiniMindForCausalLM(config)


def test_flush_left_layout_by_hand():
    input_ids, attention_mask, _ = ragged_batch()
    flushed_ids, logit_positions = flush_left_batch(input_ids, attention_mask, n_keep=4)
    # real lengths 7, 8, 3: L = 8; each row is read from its first real column on, a row that runs out repeats
    # the last column (row 0's 44): those columns come after the row's real tokens, so causal attention never
    # lets them reach one
    assert flushed_ids.tolist() == [[11, 12, 13, 41, 42, 43, 44, 44],
                                    [21, 22, 23, 24, 25, 51, 52, EOS],
                                    [31, 32, EOS, PAD, PAD, PAD, PAD, PAD]]
    # completion token j of a row with a prompt of p real tokens is predicted at aligned position p - 1 + j
    assert logit_positions.tolist() == [[2, 3, 4, 5], [4, 5, 6, 7], [1, 2, 3, 4]]


def test_flush_left_logps_equal_each_row_alone(policy):
    input_ids, attention_mask, completion_mask = ragged_batch()
    per_token_logps = compute_per_token_logps(policy, input_ids, 4, attention_mask, temperature=0.7,
                                              flush_left=True)  # [3, 4]
    for i in range(3):
        row = input_ids[i][attention_mask[i].bool()]  # the real tokens only
        n = int(completion_mask[i].sum())
        with torch.no_grad():
            logits = policy(row.unsqueeze(0)).logits[0, -n - 1:-1] / 0.7  # [n, V]
        expected = torch.log_softmax(logits, dim=-1).gather(-1, row[-n:].unsqueeze(-1)).squeeze(-1)
        assert (per_token_logps[i, :n] - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("loss_type", ["cispo", "grpo"])
def test_flush_left_loss_and_gradients_equal_the_padded_batch(policy, loss_type):
    input_ids, attention_mask, completion_mask = ragged_batch()
    mask = completion_mask.bool()
    torch.manual_seed(1)
    old = torch.randn(3, 4) * 0.1 - 8.0  # [3, 4] near the log-probs of a 6,400-token random model
    ref = torch.randn(3, 4) * 0.1 - 8.0  # [3, 4]
    advantages = torch.tensor([1.0, -0.5, 0.25])  # [3]
    results = {}
    for flush_left in (False, True):
        policy.zero_grad()
        logps = compute_per_token_logps(policy, input_ids, 4, attention_mask, flush_left=flush_left)
        loss, _, _ = grpo_loss(logps, old, ref, advantages, completion_mask, loss_type, beta=0.1)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in policy.named_parameters()}
        results[flush_left] = (logps.detach()[mask], loss.item(), grads)
    (padded_logps, padded_loss, padded_grads), (free_logps, free_loss, free_grads) = results[False], results[True]
    assert (padded_logps - free_logps).abs().max() <= 1e-5
    assert free_loss == pytest.approx(padded_loss, abs=1e-5)
    assert free_grads.keys() == padded_grads.keys()
    for name, grad in padded_grads.items():
        assert grad.abs().max() > 0, name  # every weight takes part, so the comparison below is not 0 == 0
        assert (free_grads[name] - grad).abs().max() <= 1e-5, name


def test_flush_left_critic_values_equal_the_padded_batch(policy):
    from trainer.train_ppo import compute_values
    critic = CriticModel(policy.config)
    critic.load_actor_state_dict(policy.state_dict())
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)  # a non-zero head, so the values differ per position
    input_ids, attention_mask, completion_mask = ragged_batch()
    mask = completion_mask.bool()
    padded = compute_values(critic, input_ids, 4, attention_mask, flush_left=False)  # [3, 4]
    free = compute_values(critic, input_ids, 4, attention_mask, flush_left=True)  # [3, 4]
    assert free.shape == padded.shape == (3, 4)
    assert (free - padded)[mask].abs().max() <= 1e-5
    for i in range(3):  # V(s_t): the value at the position before completion token t, row alone
        row = input_ids[i][attention_mask[i].bool()]
        n = int(mask[i].sum())
        with torch.no_grad():
            expected = critic(row.unsqueeze(0))[0, -n - 1:-1]  # [n]
        assert (free[i, :n] - expected).abs().max() <= 1e-5


def test_flush_left_refuses_holes_and_empty_rows():
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="padding between real tokens"):
        flush_left_batch(input_ids, torch.tensor([[1, 0, 1, 1]]), 2)
    with pytest.raises(ValueError, match="no real token"):
        flush_left_batch(input_ids, torch.tensor([[0, 0, 0, 0]]), 2)


def grouped_batch():
    """Two left-padded prompts (3 and 5 tokens) with G = 3 answers each, of 4 columns: ragged, truncated and empty.

    Returns (prompt_ids [2, 5], prompt_mask [2, 5], completion_ids [6, 4], completion_mask [6, 4])."""
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]
    completions = [[41, 42, 43, 44], [EOS, PAD, PAD, PAD], [45, EOS, PAD, PAD],
                   [51, 52, EOS, PAD], [53, 54, 55, 56], [EOS, PAD, PAD, PAD]]
    prompt_ids = torch.tensor([[PAD] * (5 - len(p)) + p for p in prompts])  # [2, 5]
    prompt_mask = torch.tensor([[0] * (5 - len(p)) + [1] * len(p) for p in prompts])  # [2, 5]
    completion_ids = torch.tensor(completions)  # [6, 4]
    return prompt_ids, prompt_mask, completion_ids, completion_mask_from_ids(completion_ids, EOS)


def padded_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, num_generations):
    """The rollout's own layout: each prompt repeated G times, then its answers -> (ids, mask), [B*G, P + R]."""
    input_ids = torch.cat([prompt_ids.repeat_interleave(num_generations, dim=0), completion_ids], dim=1)
    mask = torch.cat([prompt_mask.repeat_interleave(num_generations, dim=0), completion_mask], dim=1)
    return input_ids, mask


def test_shared_prompt_logps_equal_each_row_alone(policy):
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch()
    per_token_logps = compute_group_per_token_logps(policy, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                    3, temperature=0.7)  # [6, 4]
    assert per_token_logps.shape == (6, 4)
    for i in range(6):
        prompt = prompt_ids[i // 3][prompt_mask[i // 3].bool()]
        completion = completion_ids[i][completion_mask[i].bool()]
        row = torch.cat([prompt, completion])
        with torch.no_grad():
            logits = policy(row.unsqueeze(0)).logits[0, len(prompt) - 1:-1] / 0.7  # [n, V]
        expected = torch.log_softmax(logits, dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        assert (per_token_logps[i, :len(completion)] - expected).abs().max() <= 1e-5


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
            logps = compute_group_per_token_logps(policy, prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
        else:
            logps = compute_per_token_logps(policy, input_ids, 4, attention_mask, flush_left=False)
        loss, _, _ = grpo_loss(logps, old, ref, advantages, completion_mask, loss_type, beta=0.1)
        loss.backward()
        results.append((logps.detach()[completion_mask.bool()], loss.item(),
                        {name: p.grad.clone() for name, p in policy.named_parameters()}))
    (padded_logps, padded_loss, padded_grads), (shared_logps, shared_loss, shared_grads) = results
    assert (padded_logps - shared_logps).abs().max() <= 1e-5
    assert shared_loss == pytest.approx(padded_loss, abs=1e-5)
    for name, grad in padded_grads.items():
        assert grad.abs().max() > 0, name  # every weight takes part, so the comparison below is not 0 == 0
        assert (shared_grads[name] - grad).abs().max() <= 1e-5, name


def test_shared_prompt_checks_the_group_size(policy):
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch()
    with pytest.raises(ValueError, match="6 completions for 2 prompts x 2 generations"):
        compute_group_per_token_logps(policy, prompt_ids, prompt_mask, completion_ids, completion_mask, 2)
    empty = compute_group_per_token_logps(policy, prompt_ids, prompt_mask, completion_ids[:, :0],
                                          completion_mask[:, :0], 3)
    assert empty.shape == (6, 0)



def test_flush_left_logps_of_a_moe_policy_equal_the_padded_batch():
    """MoE routes each token alone, so the layout does not change a real token's log-prob either."""
    torch.manual_seed(3)
    config = build_config(hidden_size=64, num_hidden_layers=2, use_moe=1)
    config.initializer_range = 0.1
    moe_policy = MiniMindForCausalLM(config)
    input_ids, attention_mask, completion_mask = ragged_batch()
    mask = completion_mask.bool()
    padded = compute_per_token_logps(moe_policy, input_ids, 4, attention_mask, flush_left=False)  # [3, 4]
    flushed = compute_per_token_logps(moe_policy, input_ids, 4, attention_mask, flush_left=True)  # [3, 4]
    assert (padded - flushed)[mask].abs().max() <= 1e-5


@pytest.mark.parametrize("num_completion_tokens", [1, 2])
def test_shared_prompt_with_one_token_prompts_and_one_token_answers(policy, num_completion_tokens):
    """R = 1 (every answer EOS first, or --max_gen_len 1) has no answer forward; P = 1 is a prompt of one token."""
    prompt_ids = torch.tensor([[PAD, 11], [21, 22]])  # [2, 2]: a one-token prompt, left-padded
    prompt_mask = torch.tensor([[0, 1], [1, 1]])
    completion_ids = torch.tensor([[EOS, PAD], [41, EOS], [EOS, PAD], [51, 52]])[:, :num_completion_tokens]  # [4, R]
    completion_mask = completion_mask_from_ids(completion_ids, EOS)
    shared = compute_group_per_token_logps(policy, prompt_ids, prompt_mask, completion_ids, completion_mask, 2)
    input_ids, attention_mask = padded_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, 2)
    padded = compute_per_token_logps(policy, input_ids, num_completion_tokens, attention_mask)
    assert shared.shape == padded.shape == (4, num_completion_tokens)
    mask = completion_mask.bool()
    assert (shared - padded)[mask].abs().max() <= 1e-5
