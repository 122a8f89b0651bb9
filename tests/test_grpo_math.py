"""GRPO formulas (chapter 8.5, 8.6) against hand-computed values and plain loops."""

import math

import pytest
import torch

from trainer.train_grpo import grpo_loss, sequence_mean_loss
from trainer.trainer_utils import grpo_advantages


def test_group_advantages_hand_computed():
    advantages = grpo_advantages(torch.tensor([1.0, 0, 0, 5, 5, 6]), num_generations=3)
    # group [1,0,0]: mean 1/3, biased std sqrt(2)/3 = 0.471405; (1 - 1/3) / (0.471405 + 1e-4) = 1.41391
    expected = [1.41391, -0.70696, -0.70696, -0.70696, -0.70696, 1.41391]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-4)


def test_group_of_equal_rewards_gives_zero():
    advantages = grpo_advantages(torch.tensor([2.0, 2.0, 2.0, 1.0, 3.0, 2.0]), num_generations=3)
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(advantages).all()
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_advantages(torch.zeros(6), num_generations=4)


def test_sequence_mean_loss_aggregation():
    per_token_loss = torch.tensor([[1.0, 1, 1, 1], [4, 50, 50, 50]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert sequence_mean_loss(per_token_loss, mask).item() == pytest.approx(2.5)  # (4/4 + 4/1) / 2
    huge = torch.tensor([[1.0, 1, 1, 1], [4, 1e6, 1e6, 1e6]])
    assert sequence_mean_loss(huge, mask).item() == pytest.approx(2.5)
    with_inf = torch.tensor([[1.0, 1, 1, 1], [4, float("inf"), float("nan"), 1]])
    assert sequence_mean_loss(with_inf, mask).item() == pytest.approx(2.5)


def test_cispo_loss_and_gradient_hand_computed():
    per_token_logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = per_token_logps.detach().clone()
    ref = per_token_logps.detach().clone()
    loss, _, _ = grpo_loss(
        per_token_logps, old, ref, torch.tensor([0.5]), torch.ones(1, 2), "cispo", epsilon_high=5.0, beta=0.0
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.75)  # -0.5 * mean(-1, -2)
    assert per_token_logps.grad[0].tolist() == pytest.approx([-0.25, -0.25])


def test_cispo_clamp_weight_is_detached():
    """With ratio 10 > epsilon_high 5 the weight is 5, and the gradient is 5 * (-A) / R per token."""
    per_token_logps = torch.tensor([[math.log(10.0) - 1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]])
    loss, _, ratio = grpo_loss(
        per_token_logps, old, old, torch.tensor([1.0]), torch.ones(1, 2), "cispo", epsilon_high=5.0, beta=0.0
    )
    loss.backward()
    assert ratio[0].tolist() == pytest.approx([10.0, 1.0], rel=1e-5)
    assert per_token_logps.grad[0].tolist() == pytest.approx([-2.5, -0.5])  # [-5/2, -1/2]


def plain_loop_grpo_loss(logps, old, ref, advantages, mask, eps, beta):
    """The clipped GRPO loss written with Python floats, token by token."""
    seq_losses = []
    for i in range(len(logps)):
        total, count = 0.0, 0
        for t in range(len(logps[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logps[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - eps), 1 + eps)
            surrogate = min(ratio * advantages[i], clipped * advantages[i])
            d = ref[i][t] - logps[i][t]
            kl = math.exp(d) - d - 1
            total += -(surrogate - beta * kl)
            count += 1
        seq_losses.append(total / max(count, 1))
    return sum(seq_losses) / len(seq_losses)


def test_grpo_clipped_loss_equals_plain_loop():
    torch.manual_seed(3)
    logps = -torch.rand(4, 6) * 3
    old = logps + torch.randn(4, 6) * 0.3
    ref = logps + torch.randn(4, 6) * 0.3
    advantages = torch.randn(4)
    mask = (torch.rand(4, 6) > 0.3).long()
    loss, _, _ = grpo_loss(logps, old, ref, advantages, mask, "grpo", epsilon=0.2, beta=0.1)
    expected = plain_loop_grpo_loss(
        logps.tolist(), old.tolist(), ref.tolist(), advantages.tolist(), mask.tolist(), 0.2, 0.1
    )
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="cispo, grpo"):
        grpo_loss(logps, old, ref, advantages, mask, "ppo")


def test_equal_fp32_sums_give_exactly_zero_advantage():
    # a rule reward plus a reward-model score, added in fp32 as calculate_rewards does; the fp32 mean of
    # these six equal values misses them by one ulp, which gave -0.004746 for every answer before
    reward = torch.tensor(1.75) + torch.tensor(2.4831)  # fp32
    advantages = grpo_advantages(reward.repeat(6), num_generations=6)
    assert advantages.dtype == torch.float32
    assert advantages.tolist() == [0.0] * 6


def test_random_equal_groups_give_exactly_zero_advantage():
    generator = torch.Generator().manual_seed(0)
    for _ in range(2000):
        size = int(torch.randint(2, 17, (1,), generator=generator))
        value = (torch.rand((), generator=generator) * 12 - 6) + (torch.rand((), generator=generator) * 0.1)
        advantages = grpo_advantages(value.repeat(size * 2), num_generations=size)
        assert advantages.abs().max().item() == 0.0, (size, value.item())


@pytest.mark.parametrize("loss_type, expected_loss", [("cispo", 1.0), ("grpo", -1.0)])
def test_masked_position_with_huge_log_ratio_gives_finite_gradient(loss_type, expected_loss):
    # the masked second token has log-ratios whose exp overflows (ref - logp = 92): before the mask was applied
    # ahead of exp(), its gradient was 0 * inf = nan
    per_token_logps = torch.tensor([[-1.0, -95.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -95.0]])
    ref = torch.tensor([[-1.0, -3.0]])
    loss, per_token_kl, _ = grpo_loss(per_token_logps, old, ref, torch.tensor([1.0]), torch.tensor([[1, 0]]), loss_type)
    loss.backward()
    # real token: ratio 1, k3 0; cispo: -(1 * 1 * -1) = 1, d/dlogp = -1; grpo: -(1 * 1) = -1, d/dlogp = -ratio = -1
    assert loss.item() == pytest.approx(expected_loss)
    assert per_token_logps.grad.tolist() == [[-1.0, 0.0]]
    assert per_token_kl.tolist() == [[0.0, 0.0]]
