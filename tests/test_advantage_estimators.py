"""advantage_estimators.py against the peers' own code and plain loops.

The peers' values were computed by running their code on the tensors below and are written here by hand:
  verl: volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7, verl/trainer/ppo/core_algos.py
    (compute_rloo_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage), verl/utils/torch_functional.py (masked_whiten),
    verl/workers/reward_manager/dapo.py (the overlong buffer), verl/trainer/ppo/ray_trainer.py (apply_kl_penalty);
  TRL 1.16.0 (the PyPI wheel): trl/trainer/rloo_trainer.py, RLOOTrainer._generate_and_score_completions (the KL
    subtracted from the reward, the leave-one-out baseline, normalize_advantages with nanstd).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import ROOT
from trainer.advantage_estimators import (
    AdvantageConfig,
    compute_advantages,
    discounted_returns,
    global_masked_whiten,
    group_rows,
    informative_groups,
    join_rollouts,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from trainer.rollout_engine import RolloutResult, compute_per_token_logps
from trainer.trainer_utils import completion_mask_from_ids, place_sequence_rewards

# the peers' inputs: 2 prompts x G 3, rows of 4, 2, 3, 1, 4, 3 answer tokens
LENGTHS = [4, 2, 3, 1, 4, 3]
MASK = torch.tensor([[1] * n + [0] * (4 - n) for n in LENGTHS])  # [6, 4]
SCORES = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, -1.0])  # [6]
KL = torch.tensor(  # k1 = old - ref per token, 0 past each length
    [
        [0.2, -0.1, 0.05, 0.3],
        [0.1, 0.4, 0, 0],
        [-0.2, 0.1, 0.15, 0],
        [0.05, 0, 0, 0],
        [0.0, 0.1, 0.2, -0.3],
        [0.3, 0.3, -0.1, 0],
    ]
)
OLD = torch.tensor([[-1.0, -2.0, -0.5, -1.5]] * 6)  # any old log-probs; ref = old - k1
REF = OLD - KL


def config(**kwargs):
    return AdvantageConfig(**{"num_generations": 3, **kwargs})


def test_rloo_equals_trl_and_verl():
    # TRL 1.16 RLOO, beta 0: [0.75, -0.75, 0, 1.5, 1.5, -3]; verl's compute_rloo_outcome_advantage gives the same
    expected = [0.75, -0.75, 0.0, 1.5, 1.5, -3.0]
    assert rloo_advantages(SCORES, 3).tolist() == pytest.approx(expected, abs=1e-6)
    advantages, kl_rewards = compute_advantages(SCORES, MASK, config(estimator="rloo"))
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6) and kl_rewards.abs().sum() == 0
    # normalize_advantages: (A - batch mean) / (unbiased batch std + 1e-4), TRL's
    normalized, _ = compute_advantages(SCORES, MASK, config(estimator="rloo", normalize_advantages=True))
    assert normalized.tolist() == pytest.approx(
        [0.43850335, -0.43850335, 0.0, 0.87700671, 0.87700671, -1.7540134], abs=1e-6
    )


def test_rloo_with_the_kl_in_the_reward_equals_trl():
    # TRL: rewards - beta * sum_t (old - ref), beta 0.05, summed kl [0.5, -0.1, 0.2, 0.0, 0.3, 0.6]
    kl = torch.zeros(6, 4)
    kl[:, 0] = torch.tensor([0.5, -0.1, 0.2, 0.0, 0.3, 0.6])
    kl_config = config(estimator="rloo", kl_placement="reward", beta=0.05)
    advantages, kl_rewards = compute_advantages(SCORES, MASK, kl_config, OLD, OLD - kl)
    assert kl_rewards.tolist() == pytest.approx([-0.025, 0.005, -0.01, 0.0, -0.015, -0.03], abs=1e-7)
    assert advantages.tolist() == pytest.approx([0.7275, -0.7275, 0.0, 1.5225, 1.5, -3.0225], abs=1e-6)
    normalized, _ = compute_advantages(
        SCORES, MASK, config(**{**kl_config.__dict__, "normalize_advantages": True}), OLD, OLD - kl
    )
    assert normalized.tolist() == pytest.approx(
        [0.42336971, -0.42336971, 0.0, 0.88602108, 0.87292719, -1.7589483], abs=1e-6
    )


VERL_REINFORCE_PP = {  # (gamma, KL in the reward) -> verl's advantages
    (1.0, False): [
        [0.24578105] * 4,
        [-0.68272507] * 2 + [0, 0],
        [-0.21847202] * 3 + [0],
        [1.1742872, 0, 0, 0],
        [1.1742872] * 4,
        [-1.6112312] * 3 + [0],
    ],
    (1.0, True): [
        [0.21784809, 0.23622732, 0.22703771, 0.23163252],
        [-0.70570922, -0.69651955, 0, 0],
        [-0.20487463, -0.22325389, -0.21406427, 0],
        [1.173569, 0, 0, 0],
        [1.1781638, 1.1781638, 1.1873534, 1.2057326],
        [-1.6246716, -1.5971028, -1.5695338, 0],
    ],
    (0.9, False): [
        [0.086931832, 0.17058337, 0.26352951, 0.36680299],
        [-0.66593152, -0.66593152, 0, 0],
        [-0.24767409, -0.20120102, -0.14956428, 0],
        [1.3995374, 0, 0, 0],
        [0.83979523, 1.0070982, 1.1929905, 1.3995374],
        [-1.5024464, -1.5953926, -1.6986661, 0],
    ],
    (0.9, True): [
        [0.065003157, 0.16626689, 0.24472792, 0.34893391],
        [-0.68903959, -0.68290985, 0, 0],
        [-0.22946046, -0.2063206, -0.14655539, 0],
        [1.396102, 0, 0, 0],
        [0.84408587, 1.0092115, 1.204036, 1.4318589],
        [-1.5195205, -1.5829636, -1.6534559, 0],
    ],
}


@pytest.mark.parametrize("gamma, kl_in_reward", sorted(VERL_REINFORCE_PP))
def test_reinforce_pp_equals_verl(gamma, kl_in_reward):
    # verl's apply_kl_penalty with beta 0.1 (k1 per token), then compute_reinforce_plus_plus_outcome_advantage
    estimator = config(
        estimator="reinforce_pp", gamma=gamma, beta=0.1, kl_placement="reward" if kl_in_reward else "loss"
    )
    advantages, _ = compute_advantages(SCORES, MASK, estimator, OLD, REF)
    assert advantages.shape == (6, 4)
    for row, expected in zip(advantages.tolist(), VERL_REINFORCE_PP[(gamma, kl_in_reward)]):
        assert row == pytest.approx(expected, abs=2e-6)


def test_reinforce_pp_returns_equal_verl():
    token_rewards = place_sequence_rewards(SCORES, MASK)
    _, returns = reinforce_pp_advantages(token_rewards, MASK, gamma=0.9)
    assert returns[0].tolist() == pytest.approx([0.729, 0.81, 0.9, 1.0], abs=1e-6)  # verl: 0.72899991 ...
    assert returns[4].tolist() == pytest.approx([1.458, 1.62, 1.8, 2.0], abs=1e-6)
    assert returns[5].tolist() == pytest.approx([-0.81, -0.9, -1.0, 0.0], abs=1e-6)


def test_opo_equals_verls_formula_hand_computed():
    # verl's compute_opo_outcome_advantage: r_i - sum_j L_j r_j / sum_j L_j per group, no division
    # group a: L 4, 2, 3, r 1, 0, 0.5 -> baseline 5.5 / 9; group b: L 1, 4, 3, r 2, 2, -1 -> baseline 7 / 8
    advantages, _ = compute_advantages(SCORES, MASK, config(estimator="opo"))
    expected = [1 - 5.5 / 9, -5.5 / 9, 0.5 - 5.5 / 9, 2 - 7 / 8, 2 - 7 / 8, -1 - 7 / 8]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)


def test_reinforce_pp_baseline_equals_verl():
    advantages, _ = compute_advantages(SCORES, MASK, config(estimator="reinforce_pp_baseline"))
    assert advantages.tolist() == pytest.approx(
        [0.46499056, -0.46499056, 0.0, 0.92998111, 0.92998111, -1.8599622], abs=1e-6
    )


def test_reinforce_pp_baseline_shifts_the_token_weighted_mean_plain_loop():
    # lengths chosen so that the token-weighted mean of the centred rewards is not 0 (verl's inputs give exactly 0)
    lengths, rewards = [1, 4, 2, 3], torch.tensor([1.0, 0.0, 3.0, 1.0])  # 2 groups of 2
    mask = torch.tensor([[1] * n + [0] * (4 - n) for n in lengths])
    centered = [0.5, -0.5, 1.0, -1.0]  # each reward minus its group's mean
    tokens = [c for c, n in zip(centered, lengths) for _ in range(n)]  # every answer token
    mean = sum(tokens) / len(tokens)
    std = (sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1) + 1e-8) ** 0.5  # unbiased, verl's
    expected = [(c - mean) / std for c in centered]
    assert mean != 0
    assert reinforce_pp_baseline_advantages(rewards, 2, mask).tolist() == pytest.approx(expected, abs=1e-6)


def test_returns_carry_across_masked_spans_plain_loop():
    # the agent's mask: model tokens, a tool's reply (0), model tokens, padding; the reward on the last model token
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 0, 0]])
    token_rewards = place_sequence_rewards(torch.tensor([2.0, -1.0]), mask)
    assert token_rewards.tolist() == [[0, 0, 0, 0, 0, 2.0, 0], [0, 0, -1.0, 0, 0, 0, 0]]
    token_rewards[0, 0] = 0.5  # a KL reward on a model token
    token_rewards[0, 2] = 9.0  # a value on a masked token is ignored
    gamma = 0.5
    returns = discounted_returns(token_rewards, mask, gamma)
    for row in range(2):
        expected, running = [0.0] * 7, 0.0
        for t in reversed(range(7)):  # discount over the model's tokens only
            if mask[row, t]:
                running = float(token_rewards[row, t]) + gamma * running
                expected[t] = running
        assert returns[row].tolist() == pytest.approx(expected)
    assert returns[0, 1].item() == pytest.approx(0.5 * 0.5 * 2.0)  # across the tool's reply: two model tokens later


def test_overlong_penalty_equals_verl():
    lengths = torch.tensor([10, 12, 13, 15, 16])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == pytest.approx([0, 0, -0.25, -0.75, -1.0])
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == pytest.approx([0, 0, -0.125, -0.375, -0.5])
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(lengths, 16, 17, 1.0)


def test_grpo_estimator_is_the_chapters_advantage():
    from trainer.trainer_utils import grpo_advantages

    for scale in ("group", "batch", "none"):
        advantages, _ = compute_advantages(SCORES, MASK, config(scale_rewards=scale))
        assert torch.equal(advantages, grpo_advantages(SCORES, 3, scale_rewards=scale))
    with pytest.raises(ValueError, match="needs the reference"):
        compute_advantages(SCORES, MASK, config(kl_placement="reward"))


def test_informative_groups_and_their_rows():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.3, 0.3, 0.3])
    assert informative_groups(rewards, 3).tolist() == [False, True, False]
    assert group_rows([1, 2], 3, "cpu").tolist() == [3, 4, 5, 6, 7, 8]


def test_joined_rollouts_keep_every_rows_tokens_and_log_probs(policy):
    """Rows of two rollouts of other widths, joined: each row's log-probs under a real model are unchanged."""
    torch.manual_seed(0)
    pad, eos = 0, 2
    rollouts = []
    for prompt_width, completion_width in ((3, 5), (6, 2)):
        prompt_ids = torch.randint(3, 6400, (4, prompt_width))
        prompt_mask = torch.ones(4, prompt_width, dtype=torch.long)
        prompt_mask[0, 0] = 0  # a left-padded prompt
        prompt_ids[0, 0] = pad
        completion_ids = torch.randint(3, 6400, (4, completion_width))
        completion_ids[1, 1] = eos  # an answer that ends early
        completion_mask = completion_mask_from_ids(completion_ids, eos)
        output_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        logps = compute_per_token_logps(
            policy, output_ids, completion_width, torch.cat([prompt_mask, completion_mask], dim=1)
        ).per_token_logps
        rollouts.append(
            RolloutResult(
                output_ids,
                completion_ids,
                logps,
                ["x"] * 4,
                completion_mask,
                prompt_mask,
                {"logprob_gap": float(prompt_width)},
            )
        )
    rows = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    joined = join_rollouts([(rollouts[0], rows[0]), (rollouts[1], rows[1])], pad)
    assert joined.output_ids.shape == (4, 6 + 5) and joined.metrics == {"logprob_gap": 3.0}  # the first part's
    logps = compute_per_token_logps(policy, joined.output_ids, 5, joined.attention_mask).per_token_logps
    for joined_row, (part, row) in enumerate([(0, 0), (0, 1), (1, 2), (1, 3)]):
        width = rollouts[part].completion_ids.size(1)
        mask = rollouts[part].completion_mask[row].bool()
        assert torch.equal(joined.completion_mask[joined_row, :width], rollouts[part].completion_mask[row])
        assert joined.completion_mask[joined_row, width:].sum() == 0
        assert torch.allclose(logps[joined_row, :width][mask], rollouts[part].per_token_logps[row][mask], atol=1e-5)
        assert torch.equal(joined.per_token_logps[joined_row, :width], rollouts[part].per_token_logps[row])


def whiten_worker(rank, port, values, mask, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    half = values.size(0) // 2
    rows = slice(rank * half, (rank + 1) * half)
    whitened = global_masked_whiten(values[rows], mask[rows])
    groups = slice(rank * 3, (rank + 1) * 3)  # one group of G 3 each
    rloo = config(estimator="rloo", normalize_advantages=True)
    normalized = compute_advantages(SCORES[groups], MASK[groups], rloo)[0]
    torch.save({"whitened": whitened, "normalized": normalized}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_batch_statistics_span_every_process(tmp_path):
    """Two gloo processes with half the rows each give what one process gives on all of them."""
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [-1.0, 4.0, 2.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(whiten_worker, args=(port, values, mask, str(tmp_path)), nprocs=2)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert torch.allclose(torch.cat([p["whitened"] for p in parts]), global_masked_whiten(values, mask), atol=1e-12)
    single, _ = compute_advantages(SCORES, MASK, config(estimator="rloo", normalize_advantages=True))
    assert torch.allclose(torch.cat([p["normalized"] for p in parts]), single, atol=1e-6)


def test_module_sits_beside_the_chapter(tmp_path):
    source = open(os.path.join(ROOT, "trainer", "advantage_estimators.py"), encoding="utf-8").read()
    assert "import trainer.train_" not in source and "from trainer.train_" not in source


# ----------------------------------------------------------------------------- the scripts
@pytest.mark.parametrize("script", ["grpo", "agent"])
@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--advantage_estimator", "rloo", "--scale_rewards", "none"],
            "--scale_rewards is not read by --advantage_estimator rloo",
        ),
        (["--gamma", "0.9"], "--gamma is not read by --advantage_estimator grpo"),
        (
            ["--advantage_estimator", "reinforce_pp", "--normalize_advantages", "1"],
            "--normalize_advantages is not read",
        ),
        (["--advantage_estimator", "reinforce_pp", "--gamma", "1.5"], "--gamma must be in (0, 1]"),
        (["--kl_placement", "reward", "--beta", "0"], "needs a reference: set --beta > 0"),
        (["--advantage_estimator", "reinforce_pp", "--beta", "0"], "reinforce_pp default"),
        (["--advantage_estimator", "reinforce_pp", "--loss_type", "vespo"], "choose another --loss_type"),
    ],
)
def test_a_flag_the_estimator_ignores_is_refused_naming_it(script, flags, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"trainer.train_{script}").parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--overlong_buffer_len", "200"], "--overlong_buffer_len must be in [0, --max_gen_len 96]"),
        (["--overlong_penalty_factor", "-1"], "--overlong_penalty_factor must be >= 0"),
        (["--max_num_gen_batches", "-1"], "--max_num_gen_batches must be >= 0"),
    ],
)
def test_dapo_sampling_flags_out_of_range_are_refused(flags, message, capsys):
    from trainer.train_grpo import parse_args

    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


def tiny_grpo_argv(tiny_weights, small_data, run_dir, *extra):
    save_dir, name = tiny_weights
    return [
        "--hidden_size",
        "64",
        "--num_hidden_layers",
        "2",
        "--from_weight",
        name,
        "--save_dir",
        save_dir,
        "--data_path",
        small_data,
        "--run_dir",
        str(run_dir),
        "--max_gen_len",
        "8",
        "--eval_interval",
        "0",
        "--batch_size",
        "2",
        "--num_generations",
        "3",
        "--reward_model_path",
        "none",
        *extra,
    ]


def read_rows(run_dir):
    import json

    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_reinforce_pp_reaches_the_loss_whitened_over_the_batch(
    tiny_weights, small_data, tmp_path, monkeypatch, restore_signals
):
    from run_patched import text_rewards
    from trainer import train_grpo

    seen = []
    real_loss = train_grpo.grpo_loss
    monkeypatch.setattr(
        train_grpo, "grpo_loss", lambda *a, **k: seen.append((a[3], a[4], k["beta"])) or real_loss(*a, **k)
    )
    argv = tiny_grpo_argv(
        tiny_weights,
        small_data,
        tmp_path / "run",
        "--max_steps",
        "2",
        "--advantage_estimator",
        "reinforce_pp",
        "--gamma",
        "0.9",
    )
    train_grpo.main(argv, reward_fn=text_rewards)
    assert len(seen) == 2
    for advantages, mask, beta in seen:
        assert beta == 0.0  # the KL is in the rewards (reinforce_pp's placement), not in the loss
        real = advantages[mask.bool()].double()
        assert advantages.shape == mask.shape and (advantages[~mask.bool()] == 0).all()
        assert real.mean().item() == pytest.approx(0.0, abs=1e-6)
        assert real.var().item() == pytest.approx(1.0, abs=1e-4)  # the unbiased variance, verl's
    rows = read_rows(tmp_path / "run")
    assert all("kl_reward" in row for row in rows)


def test_dynamic_sampling_trains_informative_groups_and_records_its_draws(
    tiny_weights, small_data, tmp_path, monkeypatch, restore_signals
):
    """0/1 rewards: some groups of 3 agree; the trained batches hold none of them, the draws are logged, and the
    resume file's data position counts every batch drawn."""
    from run_patched import binary_text_rewards
    from trainer import train_grpo

    seen = []
    real_loss = train_grpo.grpo_loss
    monkeypatch.setattr(train_grpo, "grpo_loss", lambda *a, **k: seen.append(a[3]) or real_loss(*a, **k))
    argv = tiny_grpo_argv(
        tiny_weights,
        small_data,
        tmp_path / "run",
        "--max_steps",
        "5",
        "--dynamic_sampling",
        "1",
        "--save_interval",
        "5",
    )
    train_grpo.main(argv, reward_fn=binary_text_rewards)
    rows = read_rows(tmp_path / "run")
    draws = [row["dynamic_sampling/gen_batches"] for row in rows]
    assert sum(draws) > len(rows)  # some step drew more prompts
    for advantages, row in zip(seen, rows):
        assert advantages.shape == (6,)
        if row["dynamic_sampling/filled_groups"] == 0:
            assert (advantages.view(2, 3).abs().sum(dim=1) > 0).all()  # no group of equal rewards trained
    resume = torch.load(os.path.join(tiny_weights[0], "grpo_64_resume.pth"), weights_only=False)
    assert resume["progress"]["batch_in_epoch"] == sum(draws)


def test_dynamic_sampling_at_its_bound_fills_with_equal_groups(tiny_weights, small_data, tmp_path, restore_signals):
    """Rewards that never differ: every step rolls out --max_num_gen_batches batches, then trains on groups of equal
    rewards (advantage 0), and says so in its metrics."""
    from trainer import train_grpo

    def equal_rewards(prompts, responses, answers, reward_model, weight):
        ones = torch.ones(len(responses))
        return {"rewards": ones, "rule_rewards": ones, "reward_model_scores": 0 * ones, "answer_rewards": 0 * ones}

    argv = tiny_grpo_argv(
        tiny_weights,
        small_data,
        tmp_path / "run",
        "--max_steps",
        "2",
        "--dynamic_sampling",
        "1",
        "--max_num_gen_batches",
        "3",
    )
    train_grpo.main(argv, reward_fn=equal_rewards)
    rows = read_rows(tmp_path / "run")
    assert [row["dynamic_sampling/gen_batches"] for row in rows] == [3.0, 3.0]
    assert [row["dynamic_sampling/filled_groups"] for row in rows] == [2.0, 2.0]
    assert all(row["frac_reward_zero_std"] == 1.0 for row in rows)


def test_dynamic_sampling_keeps_the_first_informative_groups_and_every_batchs_engine_metrics():
    """Two batches of 2 prompts x 2 answers: the first has one informative group (its second), the second two; the
    step trains the first's second group and the second's first, in the order drawn. The engine's metric that only
    the first batch reports (an SGLang server's logprob_gap) is kept; prompts cut count over both batches."""
    from argparse import Namespace

    from trainer.advantage_estimators import dynamic_sampling
    from trainer.train_grpo import ScoredRollout

    def scored(rewards, first_token, metrics, truncated):
        completion_ids = torch.arange(first_token, first_token + 4).view(4, 1) + torch.zeros(4, 3, dtype=torch.long)
        rollout = RolloutResult(
            output_ids=torch.cat([torch.ones(4, 2, dtype=torch.long), completion_ids], dim=1),
            completion_ids=completion_ids,
            per_token_logps=torch.zeros(4, 3),
            completions=[f"answer {first_token + i}" for i in range(4)],
            completion_mask=torch.ones(4, 3, dtype=torch.long),
            prompt_mask=torch.ones(4, 2, dtype=torch.long),
            metrics=metrics,
        )
        parts = {"rewards": torch.tensor(rewards)}
        return ScoredRollout(rollout, rollout.completion_mask, parts, ["p"] * 4, truncated)

    first = scored([1.0, 1.0, 0.0, 1.0], 10, {"logprob_gap": 0.2}, 1)
    second = scored([0.0, 1.0, 1.0, 0.0], 20, {}, 1)
    args = Namespace(num_generations=2, batch_size=2, max_num_gen_batches=0)
    batches = iter([({"epoch": 0, "batch_in_epoch": 7}, "the next batch")])
    joined, metrics, position = dynamic_sampling(first, batches, lambda batch: second, args, "cpu", 0)
    assert joined.rollout.completions == ["answer 12", "answer 13", "answer 20", "answer 21"]
    assert joined.reward_parts["rewards"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert joined.rollout.metrics == {"logprob_gap": 0.2} and joined.truncated == 2
    assert position == {"epoch": 0, "batch_in_epoch": 7}
    assert metrics == {
        "frac_reward_zero_std": 0.25,
        "dynamic_sampling/gen_batches": 2.0,
        "dynamic_sampling/filled_groups": 0.0,
    }


def test_sequence_level_clip_fractions_read_each_answers_mean_token_advantage():
    """GSPO's one ratio per answer with REINFORCE++'s token advantages: an answer counts as clipped high when its ratio
    is above 1 + eps_high and the mean of its advantages is > 0, whatever its first token's sign (hand-built)."""
    from trainer.grpo_family import LossConfig, clip_fractions

    ratio = torch.full((2, 3), 1.5)  # both answers' ratio above 1 + 0.2
    advantages = torch.tensor([[-0.1, 1.0, 1.0], [0.5, -2.0, 0.0]])  # row means: +0.63, -0.5 (over 3 and 2 tokens)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    config = LossConfig(loss_type="grpo", epsilon=0.2, epsilon_high=0.2, importance_sampling_level="sequence")
    fractions = clip_fractions(ratio, advantages, mask, config)
    assert fractions["clip_ratio/high_mean"] == 0.5 and fractions["clip_ratio/low_mean"] == 0.0
