"""The optimizers of both scripts: AdamW's fused kernel against torch's plain per-tensor loop, and resuming it."""
import torch

from model.model_minimind import MiniMindForCausalLM
from trainer.trainer_utils import adamw, build_policy_optimizer, load_optimizer_state


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
        [{"params": [p for p in plain.parameters() if p is not final_norm], "lr": 1e-3, "weight_decay": 0.01},
         {"params": [final_norm], "lr": 1e-2, "weight_decay": 0.0}], foreach=False)
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
    """A checkpoint from before the fused kernel: its moments and step count load, and the kernel stays fused
    (``load_state_dict`` alone would bring back the saved ``fused=None``)."""
    old = torch.optim.AdamW(policy.parameters(), lr=1e-3)  # how checkpoints were written before
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
