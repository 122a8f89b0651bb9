"""GRPO formulas (chapter 8.5, 8.6) against hand-computed values and plain loops."""
import math

import pytest
import torch

from trainer.rollout_engine import selective_log_softmax
from trainer.train_grpo import grpo_advantages, grpo_loss, sequence_mean_loss
from trainer.trainer_utils import completion_mask_from_ids, k3_kl, masked_mean


@pytest.mark.parametrize("ids, expected", [
    ([7, 8, 2, 0, 0], [1, 1, 1, 0, 0]),
    ([7, 2, 9, 2, 0], [1, 1, 0, 0, 0]),
    ([7, 8, 9, 9, 9], [1, 1, 1, 1, 1]),
    ([2, 0, 0, 0, 0], [1, 0, 0, 0, 0]),
])
def test_completion_mask_through_first_eos(ids, expected):
    assert completion_mask_from_ids(torch.tensor([ids]), eos_token_id=2).tolist() == [expected]


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


def test_k3_values():
    assert k3_kl(torch.tensor(-2.0), torch.tensor(-1.0)).item() == pytest.approx(math.exp(-1), abs=1e-5)  # 0.36788
    assert k3_kl(torch.tensor(-1.3), torch.tensor(-1.3)).item() == 0.0
    torch.manual_seed(0)
    assert (k3_kl(torch.randn(100) * 3, torch.randn(100) * 3) >= 0).all()


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
    loss, _, _ = grpo_loss(per_token_logps, old, ref, torch.tensor([0.5]), torch.ones(1, 2), "cispo",
                           epsilon_high=5.0, beta=0.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.75)  # -0.5 * mean(-1, -2)
    assert per_token_logps.grad[0].tolist() == pytest.approx([-0.25, -0.25])


def test_cispo_clamp_weight_is_detached():
    """With ratio 10 > epsilon_high 5 the weight is 5, and the gradient is 5 * (-A) / R per token."""
    per_token_logps = torch.tensor([[math.log(10.0) - 1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]])
    loss, _, ratio = grpo_loss(per_token_logps, old, old, torch.tensor([1.0]), torch.ones(1, 2), "cispo",
                               epsilon_high=5.0, beta=0.0)
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
    expected = plain_loop_grpo_loss(logps.tolist(), old.tolist(), ref.tolist(), advantages.tolist(),
                                    mask.tolist(), 0.2, 0.1)
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="cispo, grpo"):
        grpo_loss(logps, old, ref, advantages, mask, "ppo")


def test_selective_log_softmax_equals_full_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 6400) * 4
    index = torch.randint(0, 6400, (3, 5))
    expected = torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert (selective_log_softmax(logits, index) - expected).abs().max() <= 1e-5
    expected_t = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert (selective_log_softmax(logits, index, temperature=0.7) - expected_t).abs().max() <= 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_gradient_equals_autograd_of_the_plain_formula(temperature):
    torch.manual_seed(1)
    logits = (torch.randn(2, 4, 50, dtype=torch.float64) * 3).requires_grad_()
    index = torch.randint(0, 50, (2, 4))
    weights = torch.randn(2, 4, dtype=torch.float64)
    (selective_log_softmax(logits, index, temperature) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    plain = torch.log_softmax(logits / temperature, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    (plain * weights).sum().backward()
    assert (ours - logits.grad).abs().max() <= 1e-6
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, index, temperature), (logits.detach()
                                                                                            .requires_grad_(),))


def test_selective_log_softmax_saves_no_copy_of_the_logits():
    """Issue 7: the log-prob step keeps at most one sequence's logits above what the model already holds."""
    logits = torch.randn(3, 16, 6400, requires_grad=True)  # [B, n, V]
    index = torch.randint(0, 6400, (3, 16))
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    for temperature in (1.0, 0.7):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            selective_log_softmax(logits, index, temperature)
        extra = [t for t in saved if t.data_ptr() != logits.data_ptr()]
        assert sum(t.numel() * t.element_size() for t in extra) <= 2 * 3 * 16 * 8  # index + logsumexp [B, n]
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):  # the plain formula, for scale
            torch.log_softmax(logits / temperature, dim=-1).gather(-1, index.unsqueeze(-1))
        saved_bytes = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() != logits.data_ptr())
        assert saved_bytes >= logits.numel() * 4


def test_masked_mean_ignores_masked_and_empty():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(1.5)
    assert masked_mean(values, mask, dim=1).tolist() == pytest.approx([1.5, 0.0])


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
    loss, per_token_kl, _ = grpo_loss(per_token_logps, old, ref, torch.tensor([1.0]), torch.tensor([[1, 0]]),
                                      loss_type)
    loss.backward()
    # real token: ratio 1, k3 0; cispo: -(1 * 1 * -1) = 1, d/dlogp = -1; grpo: -(1 * 1) = -1, d/dlogp = -ratio = -1
    assert loss.item() == pytest.approx(expected_loss)
    assert per_token_logps.grad.tolist() == [[-1.0, 0.0]]
    assert per_token_kl.tolist() == [[0.0, 0.0]]


def test_masked_k3_is_zero_with_zero_gradient_where_masked():
    per_token_logps = torch.tensor([[-1.0, -200.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0]])
    per_token_kl = k3_kl(ref, per_token_logps, torch.tensor([[1, 0]]))
    per_token_kl.sum().backward()
    # real token: k3 = e^-1 - (-1) - 1 = 0.36788, d/dlogp = 1 - exp(ref - logp) = 1 - e^-1 = 0.63212
    assert per_token_kl[0].tolist() == pytest.approx([math.exp(-1), 0.0], abs=1e-6)
    assert per_token_logps.grad[0].tolist() == pytest.approx([1 - math.exp(-1), 0.0], abs=1e-6)


def test_accumulation_windows_cover_every_step_once_with_their_own_size():
    from trainer.rl_harness import accumulation_window_size
    # --max_steps 5 --accumulation_steps 2: windows {1, 2}, {3, 4}, {5}; the last gradient was scaled by 1/2
    # instead of 1 before (gradients 1.0, 1.0, 0.5 for a constant loss)
    assert [accumulation_window_size(s, 5, 2) for s in range(1, 6)] == [2, 2, 2, 2, 1]
    # plain loop: the mean gradient of each window is 1 for a loss of 1 per step, for every total and window
    for total in range(1, 12):
        for k in range(1, 5):
            applied, window = [], 0.0
            for step in range(1, total + 1):
                window += 1.0 / accumulation_window_size(step, total, k)
                if step % k == 0 or step == total:
                    applied.append(window)
                    window = 0.0
            assert applied == pytest.approx([1.0] * len(applied)), (total, k)
