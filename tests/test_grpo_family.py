"""The GRPO family (``grpo_loss`` with every ``--loss_type``, the sequence ratio, the two-sided clip) against TRL 1.16's
own ``GRPOTrainer._compute_loss`` on the same tensors, and against hand-computed values; the advantage scales and the
signals TRL logs."""
import math
import types

import pytest
import torch

from conftest import require_trl
from trainer.train_grpo import (
    aggregate_loss, clip_fractions, frac_reward_zero_std, grpo_advantages, grpo_loss, importance_ratio,
)

MAX_COMPLETION_LENGTH = 6


def ragged_batch(seed=0, rows=4, length=MAX_COMPLETION_LENGTH, spread=0.4):
    """Log-probs with ratios away from 1 (log-ratio std ``spread``), a reference, advantages of both signs and a
    ragged completion mask (rows of 6, 4, 1 and 3 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    per_token_logps = -torch.rand(rows, length, generator=generator) * 3  # [N, R]
    old = per_token_logps + torch.randn(rows, length, generator=generator) * spread
    ref = per_token_logps + torch.randn(rows, length, generator=generator) * spread
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])[:rows]  # [N]
    lengths = torch.tensor([6, 4, 1, 3])[:rows]
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [N, R]
    return per_token_logps, old, ref, advantages, mask


def trl_loss(per_token_logps, old, ref, advantages, mask, loss_type, epsilon, epsilon_high, beta,
             importance_sampling_level="token", delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05):
    """TRL's ``GRPOTrainer._compute_loss`` (its own code, unchanged) on these tensors: the trainer object is a
    namespace holding exactly the attributes that method reads for one process, no accumulation, no vLLM, no
    entropy masking, and ``use_bias_correction_kl=False`` (TRL's default multiplies the KL by the ratio)."""
    trl = require_trl()
    logps = per_token_logps.detach().clone().requires_grad_(True)

    def get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return logps, torch.zeros_like(logps), None

    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                        reduce=lambda x, reduction="sum": x, sync_gradients=True)
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=get_per_token_logps_and_entropies, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level=importance_sampling_level, beta=beta,
        loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon_high, use_vllm=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=accelerator,
        max_completion_length=MAX_COMPLETION_LENGTH, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": __import__("collections").defaultdict(list)},
        args=types.SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=1,
                                   sapo_temperature_pos=sapo_temperature_pos,
                                   sapo_temperature_neg=sapo_temperature_neg),
    )
    rows, length = logps.shape
    inputs = {"prompt_ids": torch.zeros(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2),
              "completion_ids": torch.zeros(rows, length, dtype=torch.long), "completion_mask": mask.float(),
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum().float()}
    loss = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), logps.grad, trainer._metrics["train"]


def ours(per_token_logps, old, ref, advantages, mask, loss_type, epsilon, epsilon_high, beta, **kwargs):
    logps = per_token_logps.detach().clone().requires_grad_(True)
    loss, _, ratio = grpo_loss(logps, old, ref, advantages, mask, loss_type, epsilon, epsilon_high, beta,
                               max_completion_length=MAX_COMPLETION_LENGTH, **kwargs)
    loss.backward()
    return loss.detach(), logps.grad, ratio


FAMILY = [  # (loss_type, epsilon, epsilon_high, extra): each member as its paper or TRL's defaults set it
    ("grpo", 0.2, 0.2, {}),
    ("bnpo", 0.2, 0.2, {}),
    ("dr_grpo", 0.2, 0.2, {}),
    ("dapo", 0.2, 0.28, {}),  # clip-higher
    ("grpo", 0.2, 0.28, {"delta": 1.5}),  # two-sided clip
    ("sapo", 0.2, 0.2, {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}),
    ("grpo", 3e-4, 4e-4, {"importance_sampling_level": "sequence"}),  # GSPO's clip range
    ("dapo", 3e-4, 4e-4, {"importance_sampling_level": "sequence"}),
]


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type, epsilon, epsilon_high, extra", FAMILY)
def test_each_member_equals_trls_loss_and_gradient_on_ragged_rows(loss_type, epsilon, epsilon_high, extra, beta):
    batch = ragged_batch()
    expected_loss, expected_grad, _ = trl_loss(*batch, loss_type, epsilon, epsilon_high, beta, **extra)
    loss, grad, ratio = ours(*batch, loss_type, epsilon, epsilon_high, beta, **extra)
    assert (ratio[batch[4].bool()] - 1).abs().max() > 0.1  # ratios away from 1: the clip acts
    assert loss.item() == pytest.approx(expected_loss.item(), abs=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-7), (grad, expected_grad)
    assert grad.abs().max() > 0


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_cispo_equals_trl_on_rows_of_equal_length_and_departs_on_ragged_rows(beta):
    per_token_logps, old, ref, advantages, _ = ragged_batch(seed=1)
    full = torch.ones_like(per_token_logps, dtype=torch.long)
    expected_loss, expected_grad, _ = trl_loss(per_token_logps, old, ref, advantages, full, "cispo", 0.2, 5.0, beta)
    loss, grad, _ = ours(per_token_logps, old, ref, advantages, full, "cispo", 0.2, 5.0, beta)
    assert loss.item() == pytest.approx(expected_loss.item(), abs=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-7)
    # ragged rows: TRL sums CISPO's tokens over the batch, the chapter averages each sequence first
    batch = ragged_batch(seed=1)
    trl_ragged, _, _ = trl_loss(*batch, "cispo", 0.2, 5.0, beta)
    ours_ragged, _, _ = ours(*batch, "cispo", 0.2, 5.0, beta)
    assert abs(trl_ragged.item() - ours_ragged.item()) > 1e-3
    dapo_like = aggregate_loss(-torch.ones(4, 6), batch[4], "dapo")
    assert dapo_like.item() == pytest.approx(-1.0)


def test_clip_fractions_are_trls():
    batch = ragged_batch(seed=2, spread=0.6)
    for loss_type, epsilon, epsilon_high in (("dapo", 0.2, 0.28), ("cispo", 0.2, 1.2)):
        _, _, metrics = trl_loss(*batch, loss_type, epsilon, epsilon_high, 0.0)
        _, ratio = importance_ratio(batch[0], batch[1], batch[4])
        fractions = clip_fractions(ratio, batch[3], batch[4], loss_type, epsilon, epsilon_high)
        assert fractions, loss_type
        for key, value in fractions.items():
            assert value == pytest.approx(metrics[key][0], abs=1e-7), key
        assert max(fractions.values()) > 0


def test_hand_computed_members_on_one_token():
    """One answer, one token, log-ratio log 2 (ratio 2), A = 1, no KL: the objectives by hand."""
    logps = torch.tensor([[math.log(2.0) - 1.0]])
    old, mask, advantage = torch.tensor([[-1.0]]), torch.ones(1, 1), torch.tensor([1.0])
    cases = {("grpo", 0.2, 0.2): -1.2,  # min(2, clip(2, 0.8, 1.2)) = 1.2
             ("dapo", 0.2, 0.28): -1.28,  # clip-higher: 1.28
             ("cispo", 0.2, 5.0): -2.0 * (math.log(2.0) - 1.0),  # sg[min(2, 5)] * A * logp
             ("sapo", 0.2, 0.2): -(4.0 / (1.0 + math.exp(-1.0)))}  # sigmoid(1 * (2 - 1)) * 4 / 1
    for (loss_type, epsilon, epsilon_high), expected in cases.items():
        loss, _, _ = grpo_loss(logps, old, None, advantage, mask, loss_type, epsilon, epsilon_high, beta=0.0)
        assert loss.item() == pytest.approx(expected, rel=1e-6), loss_type
    # dr_grpo: the same token loss over rows x max_completion_length = 1 x 4
    loss, _, _ = grpo_loss(logps, old, None, advantage, mask, "dr_grpo", 0.2, 0.2, beta=0.0, max_completion_length=4)
    assert loss.item() == pytest.approx(-1.2 / 4, rel=1e-6)
    # two-sided clip with A < 0: the unclipped ratio 2 is capped at delta 1.5, min(-1.5, -1.2) = -1.5
    loss, _, _ = grpo_loss(logps, old, None, -advantage, mask, "grpo", 0.2, 0.2, beta=0.0, delta=1.5)
    assert loss.item() == pytest.approx(1.5, rel=1e-6)


def test_sequence_ratio_is_the_exp_of_the_mean_log_ratio():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    old = torch.tensor([[-1.5, -2.5, -3.0], [-2.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    _, ratio = importance_ratio(logps, old, mask, "sequence")
    assert ratio.squeeze(1).tolist() == pytest.approx([math.exp(1.0 / 3), math.exp(0.5)])  # masked token left out


def test_advantage_scales_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 5.0, 6.0])
    # none: r - group mean (Dr. GRPO)
    assert grpo_advantages(rewards, 3, scale_rewards="none").tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, -1 / 3, -1 / 3, 2 / 3])
    # batch: (r - group mean) / (population std of all six + 1e-4); mean 17/6, E[r^2] = 87/6
    batch_std = math.sqrt(87 / 6 - (17 / 6) ** 2)
    assert grpo_advantages(rewards, 3, scale_rewards="batch").tolist() == pytest.approx(
        [x / (batch_std + 1e-4) for x in (2 / 3, -1 / 3, -1 / 3, -1 / 3, -1 / 3, 2 / 3)], rel=1e-6)
    with pytest.raises(ValueError, match="group, batch, none"):
        grpo_advantages(rewards, 3, scale_rewards="global")
    assert frac_reward_zero_std(torch.tensor([2.0, 2.0, 1.0, 3.0, 0.5, 0.5]), 2) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- the loop: mu updates, no reference
TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--from_weight", "tiny", "--max_gen_len", "8",
        "--eval_interval", "0", "--reward_model_path", "none", "--batch_size", "2", "--num_generations", "3",
        "--save_interval", "100"]


def run_in_process(argv, monkeypatch, update_metrics=None):
    """train_grpo.main(argv) with hash rewards (unequal on a random tiny model); returns (metrics rows, the number of
    rollout forwards: reference and policy). ``update_metrics``, a list, receives each update's own metrics."""
    import json

    from run_patched import text_rewards
    from trainer import train_grpo
    calls = {"n": 0}
    real = train_grpo.rollout_per_token_logps
    real_policy_loss = train_grpo.grpo_policy_loss

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    def recorded_policy_loss(*args, **kwargs):
        loss, metrics = real_policy_loss(*args, **kwargs)
        update_metrics.append(dict(metrics))
        return loss, metrics

    monkeypatch.setattr(train_grpo, "rollout_per_token_logps", counted)
    if update_metrics is not None:
        monkeypatch.setattr(train_grpo, "grpo_policy_loss", recorded_policy_loss)
    train_grpo.main(argv, reward_fn=text_rewards)
    run_dir = argv[argv.index("--run_dir") + 1]
    with open(f"{run_dir}/metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f], calls["n"]


def test_a_second_update_on_the_rollout_moves_the_ratio_and_the_clip_acts(tiny_weights, small_data, tmp_path,
                                                                          monkeypatch, restore_signals, capsys):
    flags = TINY + ["--save_dir", tiny_weights[0], "--data_path", small_data, "--max_steps", "2",
                    "--loss_type", "grpo", "--learning_rate", "1e-3", "--final_norm_learning_rate", "0"]
    once, forwards_once = run_in_process(flags + ["--run_dir", str(tmp_path / "mu1")], monkeypatch)
    assert "approx_kl" not in capsys.readouterr().out  # the chapter's log line at one update
    updates = []
    twice, forwards_twice = run_in_process(flags + ["--run_dir", str(tmp_path / "mu2"), "--num_iterations", "2",
                                                    "--save_weight", "mu2"], monkeypatch, updates)
    log = capsys.readouterr().out
    assert forwards_once == 2 * 2 and forwards_twice == 2 * 3  # reference + mu policy forwards per step
    for row in once:  # one update per rollout: the policy is the sampler, ratio 1, nothing clipped
        assert row["clip_ratio/region_mean"] == 0.0 and row["approx_kl"] < 1e-8
        assert abs(row["ratio_max"] - 1) < 1e-4 and abs(row["ratio_min"] - 1) < 1e-4
    assert max(row["clip_ratio/region_mean"] for row in twice) > 0
    assert min(row["approx_kl"] for row in twice) > 1e-6
    for row, (first, second) in zip(twice, zip(updates[0::2], updates[1::2])):  # the step's range over its updates
        assert row["ratio_min"] == min(first["ratio_min"], second["ratio_min"]) < 1 - 1e-4
        assert row["ratio_max"] == max(first["ratio_max"], second["ratio_max"]) > 1 + 1e-4
        assert row["approx_kl"] == pytest.approx((first["approx_kl"] + second["approx_kl"]) / 2)
        assert (f"clipped low {row['clip_ratio/low_mean']:.4f} high {row['clip_ratio/high_mean']:.4f} | ratio "
                f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f} | approx_kl {row['approx_kl']:.1e}") in log


def test_beta_0_builds_no_reference_and_runs_no_reference_forward(tiny_weights, small_data, tmp_path, monkeypatch,
                                                                   restore_signals):
    import copy
    deep_copies = {"n": 0}
    real_deepcopy = copy.deepcopy

    def counted_deepcopy(obj, *args, **kwargs):
        deep_copies["n"] += isinstance(obj, torch.nn.Module)
        return real_deepcopy(obj, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", counted_deepcopy)
    rows, forwards = run_in_process(TINY + ["--save_dir", tiny_weights[0], "--data_path", small_data, "--max_steps",
                                            "2", "--beta", "0", "--run_dir", str(tmp_path / "run")], monkeypatch)
    assert deep_copies["n"] == 0 and forwards == 2  # the policy's forward of each step, nothing else
    assert all("kl_ref" not in row for row in rows) and len(rows) == 2
