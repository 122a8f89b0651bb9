"""--rollout_correction (grpo_family.rollout_correction): the weights and the logged mismatch against TRL 1.16's own
code for ``vllm_importance_sampling_*`` run on the same tensors, the corrected losses against TRL's
``GRPOTrainer._compute_loss`` and a plain loop for PPO, the flags that cannot act; the runs against the stand-in
server are in tests/test_sglang.py, the real server's in tests/test_sglang_server.py."""

import collections
import inspect
import math
import textwrap
import types

import pytest
import torch

from conftest import require_trl
from test_grpo_family import FAMILY, config_of, ragged_batch, trl_loss
from trainer.grpo_family import LossConfig, family_loss
from trainer.grpo_family import rollout_correction_weights, rollout_mismatch_metrics
from trainer.train_agent import parse_args as agent_parse_args
from trainer.train_grpo import grpo_loss, parse_args as grpo_parse_args
from trainer.train_ppo import parse_args as ppo_parse_args, ppo_policy_loss

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_block(method, anchor, end_marker, lines_before=0):
    """The lines of TRL's ``method`` from ``lines_before`` lines above the one holding ``anchor`` up to the one
    holding ``end_marker``, dedented: TRL computes the weights and their metrics inline, so the test runs TRL's own
    lines."""
    lines = inspect.getsource(method).splitlines()
    start = next(i for i, line in enumerate(lines) if anchor in line) - lines_before
    end = next(i for i in range(start, len(lines)) if end_marker in lines[i])
    return textwrap.dedent("\n".join(lines[start:end]))


def trl_weights_and_metrics(old, sampling, completion_mask, mode, cap):
    """TRL 1.16's ``vllm_importance_sampling_ratio`` and its ``sampling/*`` metrics, by its own code on these tensors
    (``_generate_and_score_completions``, no tool mask, one process)."""
    trl = require_trl()
    from trl.trainer.utils import nanmax, nanmin

    method = trl.GRPOTrainer._generate_and_score_completions
    trainer = types.SimpleNamespace(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=cap,
        vllm_importance_sampling_clip_min=None,
        _metrics={"train": collections.defaultdict(list)},
        accelerator=types.SimpleNamespace(gather=lambda x: x),
    )
    scope = {
        "torch": torch,
        "math": math,
        "nanmin": nanmin,
        "nanmax": nanmax,
        "self": trainer,
        "mode": "train",
        "device": old.device,
        "completion_mask": completion_mask,
        "tool_mask": None,
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampling,
    }
    weights_block = trl_block(
        method,
        "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps)",
        "# Compute the per-token log probabilities for the reference model",
        lines_before=1,
    )
    assert weights_block.startswith("mask = completion_mask if tool_mask is None"), weights_block[:200]
    exec(weights_block, scope)  # the weights
    exec(
        trl_block(method, "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)", "output = {"), scope
    )  # their metrics
    metrics = {key: values[0] for key, values in trainer._metrics["train"].items()}
    return scope["vllm_importance_sampling_ratio"], metrics


def mismatched_logps(seed=0, rows=5, length=7, spread=0.8):
    """Trainer and server log-probs of the same tokens, apart by a log-ratio of std ``spread`` (some weights above
    the cap 3.0, some below 1 / 3), a ragged mask, and one token the server gave no log-prob for (NaN)."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=generator) * 3  # [N, R]
    sampling = old + torch.randn(rows, length, generator=generator) * spread  # [N, R]
    sampling[1, 2] = float("nan")
    lengths = torch.tensor([7, 5, 1, 3, 6])[:rows]
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [N, R]
    return old, sampling, mask


@pytest.mark.parametrize("cap", [3.0, 1.5])
@pytest.mark.parametrize("mode", MODES)
def test_weights_and_logged_mismatch_equal_trls(mode, cap):
    old, sampling, mask = mismatched_logps()
    expected_weights, expected_metrics = trl_weights_and_metrics(old, sampling, mask, mode, cap)
    weights = rollout_correction_weights(old, sampling, mask, mode, cap)
    assert weights.shape == expected_weights.shape == ((5, 1) if mode.startswith("sequence") else (5, 7))
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)
    metrics = rollout_mismatch_metrics(old, sampling, mask, mode, cap)
    for key, value in expected_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert set(expected_metrics) < set(metrics)
    assert 0 < metrics["sampling/corrected_share"] < 1  # this batch has weights on both sides of the cap


def test_weights_corrected_share_and_kl_by_hand():
    """Two answers of two tokens; log pi_old - log pi_server = (ln 4, 0) and (-ln 2, ln 2), cap 3."""
    old = torch.tensor([[math.log(0.8), math.log(0.5)], [math.log(0.25), math.log(0.5)]])  # [2, 2]
    sampling = torch.tensor([[math.log(0.2), math.log(0.5)], [math.log(0.5), math.log(0.25)]])
    mask = torch.ones(2, 2, dtype=torch.long)
    torch.testing.assert_close(
        rollout_correction_weights(old, sampling, mask, "token_truncate", 3.0), torch.tensor([[3.0, 1.0], [0.5, 2.0]])
    )
    torch.testing.assert_close(
        rollout_correction_weights(old, sampling, mask, "token_mask", 3.0), torch.tensor([[0.0, 1.0], [0.5, 2.0]])
    )
    torch.testing.assert_close(
        rollout_correction_weights(old, sampling, mask, "sequence_truncate", 3.0), torch.tensor([[3.0], [1.0]])
    )  # exp(ln 4) = 4 -> 3; exp(-ln 2 + ln 2) = 1
    torch.testing.assert_close(
        rollout_correction_weights(old, sampling, mask, "sequence_mask", 3.0), torch.tensor([[0.0], [1.0]])
    )
    assert rollout_correction_weights(old, sampling, mask, "none", 3.0) is None
    metrics = rollout_mismatch_metrics(old, sampling, mask, "token_mask", 3.0)
    assert metrics["sampling/corrected_share"] == pytest.approx(0.25)  # one token of four
    # k3 of KL(server || trainer) per token: r - 1 - ln r with r = pi_old / pi_server = 4, 1, 1/2, 2
    k3 = [4 - 1 - math.log(4), 0.0, 0.5 - 1 - math.log(0.5), 2 - 1 - math.log(2)]
    assert metrics["sampling/kl_server_trainer"] == pytest.approx(sum(k3) / 4)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(4))
    with pytest.raises(ValueError, match="unknown rollout correction 'tis'"):
        rollout_correction_weights(old, sampling, mask, "tis", 3.0)


CORRECTED = FAMILY + [("cispo", 0.2, 5.0, {"full_rows": True})]  # TRL sums cispo's tokens: equal only on full rows
MEMBER_MODES = [
    (*member, mode) for member in CORRECTED for mode in MODES if member[0] != "vespo" or mode.startswith("token")
]  # TRL's VESPO takes token-level weights only


@pytest.mark.parametrize("loss_type, epsilon, epsilon_high, extra, mode", MEMBER_MODES)
def test_each_member_with_the_correction_equals_trls_loss_and_gradient(loss_type, epsilon, epsilon_high, extra, mode):
    extra = dict(extra)
    lengths = (6, 6, 6, 6) if extra.pop("full_rows", False) else (6, 4, 1, 3)
    per_token_logps, old, ref, advantages, mask = ragged_batch(lengths=lengths)
    _, sampling, _ = mismatched_logps(seed=1, rows=4, length=6, spread=0.6)
    sampling = torch.nan_to_num(sampling, nan=-1.0)
    weights = rollout_correction_weights(old, sampling, mask, mode, 3.0)
    expected_loss, expected_grad, _ = trl_loss(
        per_token_logps,
        old,
        ref,
        advantages,
        mask,
        loss_type,
        epsilon,
        epsilon_high,
        0.1,
        importance_sampling_ratio=weights,
        **extra,
    )
    logps = per_token_logps.detach().clone().requires_grad_(True)
    loss, _, _ = family_loss(
        logps, old, ref, advantages, mask, config_of(loss_type, epsilon, epsilon_high, 0.1, **extra), None, weights
    )
    loss.backward()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logps.grad, expected_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["cispo", "grpo"])
def test_weights_of_one_leave_the_chapters_loss_as_it_is(loss_type):
    """With the correction on, the chapter's two losses go through ``family_loss``: at weight 1 it is ``grpo_loss``."""
    per_token_logps, old, ref, advantages, mask = ragged_batch()
    expected = grpo_loss(per_token_logps, old, ref, advantages, mask, loss_type=loss_type, beta=0.1)[0]
    config = LossConfig(loss_type=loss_type, beta=0.1, epsilon_high=5.0 if loss_type == "cispo" else 0.2)
    corrected = family_loss(per_token_logps, old, ref, advantages, mask, config, None, torch.ones(4, 6))[0]
    torch.testing.assert_close(corrected, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_ppo_surrogate_is_weighted_token_by_token_and_its_kl_is_not(mode):
    """``ppo_rollout`` folds the weights into the advantages (w >= 0 scales both terms of the clipped surrogate):
    ``ppo_policy_loss`` on the weighted advantages against a plain loop that weighs each token's surrogate."""
    per_token_logps, old, ref, _, mask = ragged_batch(rows=4)
    advantages = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))  # [b, R]
    _, sampling, _ = mismatched_logps(seed=2, rows=4, length=6)
    sampling = torch.nan_to_num(sampling, nan=-1.0)
    weights = rollout_correction_weights(old, sampling, mask, mode, 3.0)  # [4, 6] or [4, 1]
    loss, _ = ppo_policy_loss(per_token_logps, old, ref, advantages * weights, mask, 0.2, 0.02)
    surrogate, kl, count = 0.0, 0.0, 0
    for i in range(4):
        for t in range(6):
            if not mask[i, t]:
                continue
            ratio = math.exp(per_token_logps[i, t] - old[i, t])
            a = advantages[i, t].item()
            weight = weights[i, t if weights.size(1) > 1 else 0].item()
            surrogate += weight * max(-a * ratio, -a * min(max(ratio, 0.8), 1.2))
            log_ratio = (ref[i, t] - per_token_logps[i, t]).item()
            kl += math.exp(log_ratio) - log_ratio - 1
            count += 1
    assert loss.item() == pytest.approx(surrogate / count + 0.02 * kl / count, rel=1e-5)


@pytest.mark.parametrize("parse_args", [grpo_parse_args, ppo_parse_args, agent_parse_args])
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rollout_correction", "token_mask"], "the torch engine samples with the trainer's own"),
        (
            ["--rollout_correction", "sequence_truncate", "--rollout_engine", "sglang"],
            "needs the server's log-probs: with --sglang_logprobs recompute",
        ),
        (["--rollout_correction_cap", "0"], "--rollout_correction_cap must be a finite number > 0, got 0.0"),
        (["--rollout_correction_cap", "inf"], "--rollout_correction_cap must be a finite number > 0, got inf"),
        (["--rollout_correction", "tis"], "argument --rollout_correction: invalid choice: 'tis'"),
    ],
)
def test_a_correction_that_cannot_act_is_refused(parse_args, flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(flags)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_vespo_takes_the_token_modes_only(capsys):
    flags = ["--rollout_engine", "sglang", "--sglang_logprobs", "server", "--loss_type", "vespo"]
    assert grpo_parse_args(flags + ["--rollout_correction", "token_mask"]).rollout_correction == "token_mask"
    with pytest.raises(SystemExit):
        grpo_parse_args(flags + ["--rollout_correction", "sequence_mask"])
    assert "use --rollout_correction token_truncate or token_mask, not sequence_mask" in capsys.readouterr().err
