"""The GRPO family (``grpo_family.family_loss`` with every ``--loss_type``, the sequence ratio, the two-sided clip,
LUSPO, VESPO) and the chapter's ``grpo_loss`` against TRL 1.16's own ``GRPOTrainer._compute_loss`` on the same
tensors, with accumulation and two processes; hand-computed values; the flags a member refuses."""

import collections
import math
import types

import pytest
import torch

from conftest import require_trl
from trainer.grpo_family import (
    LossConfig,
    aggregate_loss,
    clip_fractions,
    family_loss,
    frac_reward_zero_std,
    importance_ratio,
)
from trainer.infra.optimizer import scale_gradients
from trainer.train_grpo import grpo_loss, parse_args
from trainer.trainer_utils import grpo_advantages

MAX_COMPLETION_LENGTH = 6


def ragged_batch(seed=0, rows=4, length=MAX_COMPLETION_LENGTH, spread=0.4, lengths=(6, 4, 1, 3)):
    """Log-probs with ratios away from 1 (log-ratio std ``spread``), a reference, advantages of both signs and a
    ragged completion mask (rows of ``lengths`` tokens)."""
    generator = torch.Generator().manual_seed(seed)
    per_token_logps = -torch.rand(rows, length, generator=generator) * 3  # [N, R]
    old = per_token_logps + torch.randn(rows, length, generator=generator) * spread
    ref = per_token_logps + torch.randn(rows, length, generator=generator) * spread
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1, 0.9])[:rows]  # [N]
    mask = (torch.arange(length).unsqueeze(0) < torch.tensor(lengths[:rows]).unsqueeze(1)).long()  # [N, R]
    return per_token_logps, old, ref, advantages, mask


def trl_trainer(loss_type, epsilon, epsilon_high, beta, num_processes=1, accumulation_steps=1, reduce=None, **config):
    """A namespace holding exactly the attributes TRL's ``_compute_loss`` reads, for ``num_processes`` processes and
    ``accumulation_steps`` micro-batches per generation batch, no vLLM, no entropy masking and
    ``use_bias_correction_kl=False`` (TRL's default multiplies the KL by the ratio)."""
    trl = require_trl()
    vespo = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    vespo.update({key: value for key, value in config.items() if key.startswith("vespo_")})
    accelerator = types.SimpleNamespace(
        num_processes=num_processes,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=reduce or (lambda x, reduction="sum": x),
        sync_gradients=True,
    )
    return types.SimpleNamespace(
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=config.get("importance_sampling_level", "token"),
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation_steps,
        accelerator=accelerator,
        max_completion_length=MAX_COMPLETION_LENGTH,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        get_gamma_weights=trl.GRPOTrainer.get_gamma_weights,
        _metrics={"train": collections.defaultdict(list)},
        args=types.SimpleNamespace(
            delta=config.get("delta"),
            use_bias_correction_kl=False,
            steps_per_generation=accumulation_steps,
            sapo_temperature_pos=config.get("sapo_temperature_pos", 1.0),
            sapo_temperature_neg=config.get("sapo_temperature_neg", 1.05),
            **vespo,
        ),
    )


def trl_loss(
    per_token_logps,
    old,
    ref,
    advantages,
    mask,
    loss_type,
    epsilon,
    epsilon_high,
    beta,
    num_items_in_batch=None,
    importance_sampling_ratio=None,
    **config,
):
    """TRL's ``GRPOTrainer._compute_loss`` (its own code, unchanged) on these tensors -> (loss, gradient, metrics);
    with ``importance_sampling_ratio`` as vLLM's correction gives it (``use_vllm`` and the correction on)."""
    trl = require_trl()
    trainer = trl_trainer(loss_type, epsilon, epsilon_high, beta, **config)
    if importance_sampling_ratio is not None:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    logps = per_token_logps.detach().clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros_like(logps), None)
    rows, length = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(rows, 2, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 2),
        "completion_ids": torch.zeros(rows, length, dtype=torch.long),
        "completion_mask": mask.float(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum().float() if num_items_in_batch is None else num_items_in_batch,
        "importance_sampling_ratio": importance_sampling_ratio,
    }
    loss = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), logps.grad, trainer._metrics["train"]


def config_of(loss_type, epsilon, epsilon_high, beta, **extra):
    """The ``LossConfig`` of a member, with TRL's keyword names for the extra settings."""
    return LossConfig(
        loss_type=loss_type,
        beta=beta,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        importance_sampling_level=extra.get("importance_sampling_level", "token"),
        delta=extra.get("delta"),
        sapo_temperatures=(extra.get("sapo_temperature_pos", 1.0), extra.get("sapo_temperature_neg", 1.05)),
        vespo_gamma=tuple(
            extra.get(f"vespo_{k}", d)
            for k, d in (("k_pos", 2.0), ("lambda_pos", 3.0), ("k_neg", 3.0), ("lambda_neg", 2.0))
        ),
        max_completion_length=MAX_COMPLETION_LENGTH,
    )


def ours(per_token_logps, old, ref, advantages, mask, loss_type, epsilon, epsilon_high, beta, **extra):
    logps = per_token_logps.detach().clone().requires_grad_(True)
    loss, _, ratio = family_loss(
        logps, old, ref, advantages, mask, config_of(loss_type, epsilon, epsilon_high, beta, **extra)
    )
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
    ("luspo", 3e-4, 4e-4, {"importance_sampling_level": "sequence"}),  # LUSPO: GSPO's ratio, a token sum per answer
    ("luspo", 0.2, 0.28, {}),
    ("vespo", 0.2, 0.2, {}),  # VESPO with TRL's default gamma
    ("vespo", 0.2, 0.2, {"vespo_k_pos": 1.5, "vespo_lambda_pos": 0.5, "vespo_k_neg": 4.0, "vespo_lambda_neg": 1.0}),
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
@pytest.mark.parametrize("loss_type, epsilon_high", [("cispo", 5.0), ("cispo", 1.2), ("grpo", 0.2), ("grpo", 0.28)])
def test_the_chapters_grpo_loss_equals_the_familys_and_trls(loss_type, epsilon_high, beta):
    """train_grpo.grpo_loss (the chapter's two, written out) gives the family's loss and gradient; grpo also TRL's."""
    batch = ragged_batch(seed=3, spread=0.6)
    logps = batch[0].detach().clone().requires_grad_(True)
    loss, per_token_kl, ratio = grpo_loss(
        logps, *batch[1:], loss_type=loss_type, epsilon=0.2, epsilon_high=epsilon_high, beta=beta
    )
    loss.backward()
    family, family_grad, family_ratio = ours(*batch, loss_type, 0.2, epsilon_high, beta)
    assert loss.item() == family.item() and torch.equal(logps.grad, family_grad) and torch.equal(ratio, family_ratio)
    if loss_type == "grpo":
        expected_loss, expected_grad, _ = trl_loss(*batch, loss_type, 0.2, epsilon_high, beta)
        assert loss.item() == pytest.approx(expected_loss.item(), abs=1e-6)
        assert torch.allclose(logps.grad, expected_grad, atol=1e-7)
    with pytest.raises(ValueError, match="family_loss"):
        grpo_loss(logps, *batch[1:], loss_type="dapo")


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


@pytest.mark.parametrize("loss_type, epsilon_high", [("dapo", 0.28), ("vespo", 0.2)])
def test_token_sum_members_over_an_accumulation_window_of_two_processes_equal_trl(loss_type, epsilon_high):
    """Two processes x two accumulation steps, 60 and 24 answer tokens: TRL weighs every token of the window 1/84
    (``num_items_in_batch`` spans the generation batch), not 1/60 and 1/24 by step. The loop's way: each step
    backpropagates its token sum / the window size, DDP averages the processes, and the update scales by
    window / (window tokens / processes)."""
    lengths = {(0, 0): (6, 6, 6, 6, 6), (0, 1): (6, 6, 6, 1, 0), (1, 0): (6, 6, 6, 6, 6), (1, 1): (2, 1, 0, 1, 1)}
    batches = {
        key: ragged_batch(seed=10 + 2 * key[0] + key[1], rows=5, lengths=value) for key, value in lengths.items()
    }
    window_tokens = sum(int(batch[4].sum()) for batch in batches.values())
    assert window_tokens == 84 and int(batches[0, 1][4].sum()) + int(batches[1, 1][4].sum()) == 24
    processes, window = 2, 2
    for key, batch in batches.items():
        trainer = trl_trainer(loss_type, 0.2, epsilon_high, 0.1, num_processes=processes, accumulation_steps=window)
        trl = require_trl()
        logps = batch[0].detach().clone().requires_grad_(True)
        trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros_like(logps), None)
        inputs = {
            "prompt_ids": torch.zeros(5, 2, dtype=torch.long),
            "prompt_mask": torch.ones(5, 2),
            "completion_ids": torch.zeros(5, 6, dtype=torch.long),
            "completion_mask": batch[4].float(),
            "advantages": batch[3],
            "old_per_token_logps": batch[1],
            "ref_per_token_logps": batch[2],
            "num_items_in_batch": torch.tensor(float(window_tokens)),
        }
        trl.GRPOTrainer._compute_loss(trainer, None, inputs).backward()
        expected = logps.grad / processes  # DDP's mean over the processes
        ours_logps = batch[0].detach().clone().requires_grad_(True)
        token_sum, _, _ = family_loss(ours_logps, *batch[1:], config_of(loss_type, 0.2, epsilon_high, 0.1), 1.0)
        (token_sum / window).backward()
        ours_logps.grad /= processes  # DDP's mean
        window_num_items = (
            sum(float(batches[p, key[1]][4].sum()) for p in range(processes)) / processes
            + sum(float(batches[p, 1 - key[1]][4].sum()) for p in range(processes)) / processes
        )
        scale_gradients([ours_logps], window / window_num_items)
        assert torch.allclose(ours_logps.grad, expected, atol=1e-8), key
        masked = ours_logps.grad[batch[4].bool()]
        assert masked.abs().max() > 0


def test_clip_fractions_are_trls_per_token_and_per_sequence():
    batch = ragged_batch(seed=2, spread=0.6)
    for loss_type, epsilon, epsilon_high in (("dapo", 0.2, 0.28), ("cispo", 0.2, 1.2)):
        _, _, metrics = trl_loss(*batch, loss_type, epsilon, epsilon_high, 0.0)
        ratio = importance_ratio(batch[0], batch[1], batch[4])
        fractions = clip_fractions(ratio, batch[3], batch[4], config_of(loss_type, epsilon, epsilon_high, 0.0))
        assert fractions, loss_type
        for key, value in fractions.items():
            assert value == pytest.approx(metrics[key][0], abs=1e-7), key
        assert max(fractions.values()) > 0
    # sequence level: rows of 7, 1, 2, 7 and 0 tokens, only the 2-token row's ratio above the clip: TRL counts answers
    logps = torch.zeros(5, 7)
    old = torch.zeros(5, 7)
    old[2, :2] = -0.5  # ratio exp(0.5) on the 2-token row
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    mask = (torch.arange(7).unsqueeze(0) < torch.tensor([7, 1, 2, 7, 0]).unsqueeze(1)).long()
    _, _, metrics = trl_loss(
        logps, old, None, advantages, mask, "grpo", 0.2, 0.2, 0.0, importance_sampling_level="sequence"
    )
    ratio = importance_ratio(logps, old, mask, "sequence")
    fractions = clip_fractions(
        ratio, advantages, mask, config_of("grpo", 0.2, 0.2, 0.0, importance_sampling_level="sequence")
    )
    assert metrics["clip_ratio/high_mean"][0] == pytest.approx(1 / 5)
    assert fractions["clip_ratio/high_mean"] == pytest.approx(1 / 5)  # not 2 / 17 tokens


def test_hand_computed_members_on_one_token():
    """One answer, one token, log-ratio log 2 (ratio 2), A = 1, no KL: the objectives by hand."""
    logps = torch.tensor([[math.log(2.0) - 1.0]])
    old, mask, advantage = torch.tensor([[-1.0]]), torch.ones(1, 1), torch.tensor([1.0])
    cases = {
        ("grpo", 0.2, 0.2): -1.2,  # min(2, clip(2, 0.8, 1.2)) = 1.2
        ("dapo", 0.2, 0.28): -1.28,  # clip-higher: 1.28
        ("luspo", 0.2, 0.28): -1.28,  # one token: its sum
        ("cispo", 0.2, 5.0): -2.0 * (math.log(2.0) - 1.0),  # sg[min(2, 5)] * A * logp
        ("sapo", 0.2, 0.2): -(4.0 / (1.0 + math.exp(-1.0))),  # sigmoid(1 * (2 - 1)) * 4 / 1
        # vespo: phi(2) = e^3 * 2^2 * e^(-3 * 2) (k_pos 2, lambda_pos 3), times A * logp
        ("vespo", 0.2, 0.2): -math.exp(3.0) * 4.0 * math.exp(-6.0) * (math.log(2.0) - 1.0),
    }
    for (loss_type, epsilon, epsilon_high), expected in cases.items():
        loss, _, _ = family_loss(logps, old, None, advantage, mask, config_of(loss_type, epsilon, epsilon_high, 0.0))
        assert loss.item() == pytest.approx(expected, rel=1e-6), loss_type
    # dr_grpo: the same token loss over rows x max_completion_length = 1 x 6
    loss, _, _ = family_loss(logps, old, None, advantage, mask, config_of("dr_grpo", 0.2, 0.2, 0.0))
    assert loss.item() == pytest.approx(-1.2 / MAX_COMPLETION_LENGTH, rel=1e-6)
    # two-sided clip with A < 0: the unclipped ratio 2 is capped at delta 1.5, min(-1.5, -1.2) = -1.5
    loss, _, _ = family_loss(logps, old, None, -advantage, mask, config_of("grpo", 0.2, 0.2, 0.0, delta=1.5))
    assert loss.item() == pytest.approx(1.5, rel=1e-6)


def test_sequence_ratio_is_the_exp_of_the_mean_log_ratio():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    old = torch.tensor([[-1.5, -2.5, -3.0], [-2.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ratio = importance_ratio(logps, old, mask, "sequence")  # [2, 3], one value per row
    assert ratio[:, 0].tolist() == pytest.approx([math.exp(1.0 / 3), math.exp(0.5)])  # masked token left out
    assert torch.equal(ratio[:, 0:1].expand_as(ratio), ratio)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--loss_type", "cispo", "--epsilon", "0.3"], "--epsilon is not read by --loss_type cispo"),
        (["--loss_type", "cispo", "--delta", "3"], "--delta is not read by --loss_type cispo"),
        (["--loss_type", "sapo", "--epsilon_high", "0.28"], "--epsilon_high is not read by --loss_type sapo"),
        (
            ["--loss_type", "grpo", "--sapo_temperature_pos", "2"],
            "--sapo_temperature_pos is not read by --loss_type grpo",
        ),
        (
            ["--loss_type", "vespo", "--importance_sampling_level", "sequence"],
            "--importance_sampling_level is not read by --loss_type vespo",
        ),
        (["--loss_type", "dapo", "--vespo_k_pos", "1"], "--vespo_k_pos is not read by --loss_type dapo"),
        (["--loss_type", "ppo"], "--loss_type 'ppo' is unknown"),
        (["--loss_type", "dapo", "--use_moe", "1", "--shared_prefix", "0"], "would scale the MoE router loss too"),
    ],
)
def test_a_flag_the_member_ignores_is_refused_naming_the_member(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_chapters_defaults_and_each_members_flags_parse():
    from trainer.grpo_family import build_loss_config

    assert build_loss_config(parse_args([])) == LossConfig(max_completion_length=parse_args([]).max_gen_len)
    assert build_loss_config(parse_args(["--loss_type", "grpo"])).epsilon_high == 0.2  # the symmetric clip
    vespo = build_loss_config(parse_args(["--loss_type", "vespo", "--vespo_k_neg", "4"]))
    assert vespo.vespo_gamma == (2.0, 3.0, 4.0, 2.0)
    luspo = build_loss_config(
        parse_args(
            [
                "--loss_type",
                "luspo",
                "--importance_sampling_level",
                "sequence",
                "--epsilon",
                "3e-4",
                "--epsilon_high",
                "4e-4",
            ]
        )
    )
    assert (luspo.epsilon, luspo.epsilon_high, luspo.is_chapter_loss) == (3e-4, 4e-4, False)


def test_advantage_scales_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 5.0, 6.0])
    # none: r - group mean (Dr. GRPO)
    assert grpo_advantages(rewards, 3, scale_rewards="none").tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, -1 / 3, -1 / 3, 2 / 3]
    )
    # batch: (r - group mean) / (population std of all six + 1e-4); mean 17/6, E[r^2] = 87/6
    batch_std = math.sqrt(87 / 6 - (17 / 6) ** 2)
    assert grpo_advantages(rewards, 3, scale_rewards="batch").tolist() == pytest.approx(
        [x / (batch_std + 1e-4) for x in (2 / 3, -1 / 3, -1 / 3, -1 / 3, -1 / 3, 2 / 3)], rel=1e-6
    )
    with pytest.raises(ValueError, match="group, batch, none"):
        grpo_advantages(rewards, 3, scale_rewards="global")
    assert frac_reward_zero_std(torch.tensor([2.0, 2.0, 1.0, 3.0, 0.5, 0.5]), 2) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- the loop: mu updates, no reference
TINY = [
    "--hidden_size",
    "64",
    "--num_hidden_layers",
    "2",
    "--from_weight",
    "tiny",
    "--max_gen_len",
    "8",
    "--eval_interval",
    "0",
    "--reward_model_path",
    "none",
    "--batch_size",
    "2",
    "--num_generations",
    "3",
    "--save_interval",
    "100",
]


def run_in_process(argv, monkeypatch, update_metrics=None):
    """train_grpo.main(argv) with hash rewards (unequal on a random tiny model); returns (metrics rows, the number of
    rollout forwards: reference and policy). ``update_metrics``, a list, receives each update's own metrics."""
    import json

    from run_patched import text_rewards
    from trainer import train_grpo

    calls = {"n": 0}
    real = train_grpo.group_policy_forward
    real_update_metrics = train_grpo.grpo_update_metrics

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    def recorded_update_metrics(*args, **kwargs):
        metrics = real_update_metrics(*args, **kwargs)
        update_metrics.append(dict(metrics))
        return metrics

    monkeypatch.setattr(train_grpo, "group_policy_forward", counted)
    if update_metrics is not None:
        monkeypatch.setattr(train_grpo, "grpo_update_metrics", recorded_update_metrics)
    train_grpo.main(argv, reward_fn=text_rewards)
    run_dir = argv[argv.index("--run_dir") + 1]
    with open(f"{run_dir}/metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f], calls["n"]


def test_a_second_update_on_the_rollout_moves_the_ratio_and_the_clip_acts(
    tiny_weights, small_data, tmp_path, monkeypatch, restore_signals, capsys
):
    flags = TINY + [
        "--save_dir",
        tiny_weights[0],
        "--data_path",
        small_data,
        "--max_steps",
        "2",
        "--loss_type",
        "grpo",
        "--learning_rate",
        "1e-3",
        "--final_norm_learning_rate",
        "0",
    ]
    once, forwards_once = run_in_process(flags + ["--run_dir", str(tmp_path / "mu1")], monkeypatch)
    assert "approx_kl" not in capsys.readouterr().out  # the chapter's log line at one update
    updates = []
    twice, forwards_twice = run_in_process(
        flags + ["--run_dir", str(tmp_path / "mu2"), "--num_iterations", "2", "--save_weight", "mu2"],
        monkeypatch,
        updates,
    )
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
        assert (
            f"clipped low {row['clip_ratio/low_mean']:.4f} high {row['clip_ratio/high_mean']:.4f} | ratio "
            f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f} | approx_kl {row['approx_kl']:.1e}"
        ) in log


def test_beta_0_builds_no_reference_and_runs_no_reference_forward(
    tiny_weights, small_data, tmp_path, monkeypatch, restore_signals
):
    import copy

    deep_copies = {"n": 0}
    real_deepcopy = copy.deepcopy

    def counted_deepcopy(obj, *args, **kwargs):
        deep_copies["n"] += isinstance(obj, torch.nn.Module)
        return real_deepcopy(obj, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", counted_deepcopy)
    rows, forwards = run_in_process(
        TINY
        + [
            "--save_dir",
            tiny_weights[0],
            "--data_path",
            small_data,
            "--max_steps",
            "2",
            "--beta",
            "0",
            "--run_dir",
            str(tmp_path / "run"),
        ],
        monkeypatch,
    )
    assert deep_copies["n"] == 0 and forwards == 2  # the policy's forward of each step, nothing else
    assert all("kl_ref" not in row for row in rows) and len(rows) == 2


def test_two_real_processes_log_global_means_and_take_the_window_token_mean(tmp_path):
    """torchrun, 2 gloo processes: the logged means count every process's tokens (answers at the sequence level),
    the extremes are global, and a dapo window of two steps through DDP gives the gradient of the token mean over
    all four batches (Yu et al. 2025, eq. 8), here computed in one process on the concatenated rows."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from dist_family_worker import DAPO, TokenLogps, rank_data

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "tests/support/dist_family_worker.py",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    values = torch.cat([rank_data(r, 0)[0] for r in range(2)])  # [6, 5]
    mask = torch.cat([rank_data(r, 0)[3] for r in range(2)]).bool()  # 15 + 4 tokens
    assert ranks[0]["mean"] == pytest.approx(values[mask].mean().item(), abs=1e-6)
    assert ranks[0]["per_sequence"] == pytest.approx(values[:, 0].mean().item(), abs=1e-6)  # 6 answers
    assert ranks[0]["extremes"] == pytest.approx([values[mask].min().item(), values[mask].max().item()])
    model = TokenLogps()  # the global token mean of the window, in one process
    batches = [rank_data(r, s) for r in range(2) for s in range(2)]
    total_tokens = sum(int(batch[3].sum()) for batch in batches)
    loss = (
        sum(
            family_loss(model(offsets), old, None, advantages, mask, DAPO, 1.0)[0]
            for offsets, old, advantages, mask in batches
        )
        / total_tokens
    )
    loss.backward()
    assert ranks[0]["grad"] == pytest.approx(model.theta.grad.tolist(), abs=1e-7)
    assert model.theta.grad.abs().max() > 0
