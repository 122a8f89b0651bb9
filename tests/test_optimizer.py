"""trainer/infra/optimizer.py: AdamW's fused kernel against torch's plain per-tensor loop and on resume, the final-norm
group, the scale-only projection, and the gradient-accumulation windows."""

import pytest
import torch

from model.model_minimind import MiniMindForCausalLM
from trainer.infra.checkpoints import load_optimizer_state
from trainer.infra.optimizer import adamw, build_policy_optimizer


def loss_of(model, step):
    """A loss that reaches every weight (tied embedding included): the summed log-probs of a fixed sequence."""
    input_ids = torch.tensor([[11, 12, 13, 41, 42, 43, 44], [21, 22, 23, 24, 25, 51, 52]])  # [2, 7]
    logits = model(input_ids).logits[:, :-1]  # [2, 6, V]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1))  # [2, 6, 1]
    return logps.sum() * (step + 1)


def test_fused_adamw_takes_the_steps_of_the_plain_loop(policy):
    """``build_policy_optimizer`` (fused kernel, two groups) against torch's per-tensor AdamW loop on the same
    groups: the same parameters after three steps with different gradients, to float rounding (the fused kernel
    orders a few operations differently: 1 ulp here and there)."""
    plain = MiniMindForCausalLM(policy.config)
    plain.load_state_dict(policy.state_dict())
    fused_optimizer = build_policy_optimizer(policy, 1e-3, 0.01, 1e-2)
    assert all(group["fused"] for group in fused_optimizer.param_groups)
    final_norm = plain.model.norm.weight
    plain_optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in plain.parameters() if p is not final_norm], "lr": 1e-3, "weight_decay": 0.01},
            {"params": [final_norm], "lr": 1e-2, "weight_decay": 0.0},
        ],
        foreach=False,
    )
    start = {name: p.detach().clone() for name, p in plain.named_parameters()}
    for step in range(3):
        for model, optimizer in ((policy, fused_optimizer), (plain, plain_optimizer)):
            optimizer.zero_grad()
            loss_of(model, step).backward()
            optimizer.step()
    for (name, fused_param), plain_param in zip(policy.named_parameters(), plain.parameters()):
        assert not torch.equal(plain_param, start[name]), name  # every weight moved, so equal means something
        torch.testing.assert_close(fused_param, plain_param, rtol=1e-5, atol=1e-6, msg=name)


def test_resuming_a_plain_optimizer_state_keeps_the_fused_kernel(policy):
    """A checkpoint written by a plain AdamW: its moments and step count load, and the kernel stays fused
    (``load_state_dict`` alone would bring back the saved ``fused=None``)."""
    old = torch.optim.AdamW(policy.parameters(), lr=1e-3)  # the default, unfused kernel
    loss_of(policy, 0).backward()
    old.step()
    saved = old.state_dict()
    assert saved["param_groups"][0]["fused"] is None
    resumed = adamw(policy.parameters(), lr=1e-3)
    load_optimizer_state(resumed, saved)
    assert resumed.param_groups[0]["fused"] is True
    first = next(iter(policy.parameters()))
    assert float(resumed.state[first]["step"]) == 1.0
    assert torch.equal(resumed.state[first]["exp_avg"], old.state[first]["exp_avg"])
    resumed.zero_grad()
    loss_of(policy, 1).backward()
    resumed.step()  # the fused kernel accepts the loaded state
    assert float(resumed.state[first]["step"]) == 2.0


def test_accumulation_windows_cover_every_step_once_with_their_own_size():
    from trainer.infra.optimizer import accumulation_window_size

    # --max_steps 5 --accumulation_steps 2: windows {1, 2}, {3, 4}, {5}; the last window's gradient is scaled by 1,
    # not 1/2 (a fixed 1/2 would apply gradients 1.0, 1.0, 0.5 for a constant loss)
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


def test_policy_optimizer_gives_the_final_norm_gain_its_own_rate(tiny_config):
    from model.model_minimind import MiniMindForCausalLM
    from trainer.infra.optimizer import build_policy_optimizer

    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config)
    optimizer = build_policy_optimizer(model, 1e-4, 0.0, 1e-2)
    assert [p for p in optimizer.param_groups[1]["params"]] == [model.model.norm.weight]
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters())) - 1
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    # Adam's first step moves every parameter by lr * g / (|g| + eps) = lr (bias-corrected moments, g = 1)
    moved = {n: (before[n] - p.detach()).abs().max().item() for n, p in model.named_parameters()}
    assert moved["model.norm.weight"] == pytest.approx(1e-2, rel=1e-4)
    assert moved["model.layers.0.self_attn.q_proj.weight"] == pytest.approx(1e-4, rel=1e-3)
    plain = build_policy_optimizer(model, 1e-4, 0.0, 0.0)
    assert len(plain.param_groups) == 1
    with pytest.raises(ValueError, match="must be >= 0"):
        build_policy_optimizer(model, 1e-4, 0.0, -1.0)


def test_scale_only_gradient_is_the_projection_on_the_gain():
    from trainer.infra.optimizer import project_scale_only_gradients

    gain = torch.nn.Parameter(torch.tensor([1.0, 2.0, 2.0]))
    other = torch.nn.Parameter(torch.tensor([5.0]))
    optimizer = torch.optim.AdamW([{"params": [other]}, {"params": [gain], "scale_only": True}], lr=0.1)
    gain.grad = torch.tensor([3.0, 0.0, -1.5])
    other.grad = torch.tensor([7.0])
    project_scale_only_gradients(optimizer)
    # g . w = 3 - 3 = 0: no component along w; the other group is untouched
    assert gain.grad.tolist() == [0.0, 0.0, 0.0] and other.grad.tolist() == [7.0]
    gain.grad = torch.tensor([9.0, 0.0, 0.0])
    project_scale_only_gradients(optimizer)
    # (g . w / w . w) w = (9 / 9) * [1, 2, 2]
    assert gain.grad.tolist() == pytest.approx([1.0, 2.0, 2.0])
    # the loss of w = c * w_now has dL/dc = g . w_now: a plain loop over the entries
    weights, grads = [1.0, 2.0, 2.0], [0.5, -0.25, 1.0]
    gain.grad = torch.tensor(grads)
    project_scale_only_gradients(optimizer)
    dl_dc = sum(w * g for w, g in zip(weights, grads))  # 0.5 - 0.5 + 2 = 2
    assert gain.grad.tolist() == pytest.approx([dl_dc / 9 * w for w in weights])


def test_the_update_steps_at_each_windows_end_and_divides_a_token_sum_by_its_tokens():
    """Accumulation 2 over 3 steps of 3, 5 and 4 tokens, every token's loss gradient 1 (a token sum): the windows
    are 2, 2, 1; the update at step 2 applies (3 + 5) / 2 x 2 / 8 = 1, the mean over the window's tokens, and at step
    3 4 / 1 x 1 / 4 = 1 (hand-computed); nothing moves inside a window."""
    from trainer.infra.optimizer import OptimizerStep

    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    update = OptimizerStep([model], [optimizer], 1e9, "cpu", accumulation_steps=2, total_steps=3, token_sum=True)
    windows, weights, results = [], [], []
    for step, tokens in zip((1, 2, 3), (3.0, 5.0, 4.0)):
        windows.append(update.begin_step(step, tokens))
        (model(torch.ones(1, 1)).sum() * tokens / windows[-1]).backward()  # d/dw = tokens / window
        results.append(update.clip_and_step(step))
        weights.append(model.weight.item())
    assert windows == [2, 2, 1]
    assert results[0] == {} and results[1]["skipped_update"] == 0.0 and results[2]["skipped_update"] == 0.0
    assert results[1]["grad_norm"] == pytest.approx(1.0) and weights == pytest.approx([1.0, 0.0, -1.0])
    assert update.state() == {"window_num_items": 4.0}
