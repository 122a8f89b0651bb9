"""PPO formulas (chapter 8.4) against hand-computed values and plain loops."""

import math
import random

import pytest
import torch

from trainer.train_ppo import (
    compute_gae,
    masked_whiten,
    place_sequence_rewards,
    ppo_policy_loss,
    ppo_value_loss,
)
from trainer.infra.dtypes import autocast_context
from trainer.trainer_utils import completion_mask_from_ids


@pytest.mark.parametrize(
    "response, expected",
    [
        ([11, 12, 2, 0, 0], [0, 0, 1, 0, 0]),
        ([11, 12, 13, 14, 15], [0, 0, 0, 0, 1]),
        ([2, 0, 0, 0, 0], [1, 0, 0, 0, 0]),
    ],
)
def test_reward_on_last_real_token(response, expected):
    mask = completion_mask_from_ids(torch.tensor([response]), eos_token_id=2)
    assert place_sequence_rewards(torch.tensor([1.0]), mask).tolist() == [expected]


def test_gae_hand_computed():
    advantages, returns = compute_gae(
        torch.tensor([[0.0, 0, 1, 0, 0]]),
        torch.tensor([[0.5, 0.4, 0.3, 9, 9]]),
        torch.tensor([[1, 1, 1, 0, 0]]),
        gamma=1.0,
        lam=0.95,
    )
    assert advantages[0].tolist() == pytest.approx([0.43675, 0.565, 0.7, 0, 0], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([0.93675, 0.965, 1.0, 0, 0], abs=1e-6)


def test_gae_lambda_one_is_return_minus_value():
    # lambda 1 (the default): with gamma 1 every real token gets the sequence reward minus its own value.
    # By hand: delta = [0.4-0.5, 0.3-0.4, 1-0.3] = [-0.1, -0.1, 0.7]; A = [0.5, 0.6, 0.7] = 1 - [0.5, 0.4, 0.3].
    advantages, returns = compute_gae(
        torch.tensor([[0.0, 0, 1, 0, 0]]),
        torch.tensor([[0.5, 0.4, 0.3, 9, 9]]),
        torch.tensor([[1, 1, 1, 0, 0]]),
        gamma=1.0,
        lam=1.0,
    )
    assert advantages[0].tolist() == pytest.approx([0.5, 0.6, 0.7, 0, 0], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 0, 0], abs=1e-6)


def test_gae_chapter_lambda_leaves_the_first_token_8_percent_of_the_reward():
    # The chapter's lambda 0.95 with V = 0 and a 50-token answer: A_0 = 0.95^49 * r = 0.080995 * r (by hand).
    length = 50
    token_rewards = torch.zeros(1, length)
    token_rewards[0, -1] = 2.0
    advantages, _ = compute_gae(token_rewards, torch.zeros(1, length), torch.ones(1, length), gamma=1.0, lam=0.95)
    assert advantages[0, 0].item() == pytest.approx(2.0 * 0.080995, abs=1e-5)
    assert advantages[0, -1].item() == pytest.approx(2.0)


def plain_gae(rewards, values, length, gamma, lam):
    """Textbook GAE over the first ``length`` tokens of one sequence (V = 0 after the end)."""
    advantages = [0.0] * len(rewards)
    next_advantage = 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[t] = next_advantage
    return advantages


def test_gae_equals_plain_loop_with_discount():
    rng = random.Random(0)
    torch.manual_seed(0)
    lengths = [7, 3, 1, 5]
    rewards = torch.randn(4, 7)
    values = torch.randn(4, 7) * 5  # garbage after each length must not matter
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    gamma, lam = 0.9, rng.uniform(0.5, 1.0)
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    for i, n in enumerate(lengths):
        expected = plain_gae(rewards[i].tolist(), values[i].tolist(), n, gamma, lam)
        assert advantages[i].tolist() == pytest.approx(expected, abs=1e-5)
        assert returns[i, :n].tolist() == pytest.approx(
            [a + v for a, v in zip(expected[:n], values[i, :n].tolist())], abs=1e-5
        )
        assert (returns[i, n:] == 0).all()


def test_masked_whitening():
    values = torch.tensor([[1.0, 2, 3, 7, 7], [4, 0, 0, -5, -5]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    expected = [[-1.3416, -0.4472, 0.4472, 0, 0], [1.3416, 0, 0, 0, 0]]
    assert masked_whiten(values, mask).tolist()[0] == pytest.approx(expected[0], abs=1e-4)
    assert masked_whiten(values, mask).tolist()[1] == pytest.approx(expected[1], abs=1e-4)
    single = masked_whiten(torch.tensor([[3.0, 9.0]]), torch.tensor([[1, 0]]))
    assert single.tolist() == [[0.0, 0.0]]


def test_value_loss_hand_computed():
    values = torch.tensor([[0.5]], requires_grad=True)
    loss, clipfrac = ppo_value_loss(values, torch.tensor([[2.0]]), torch.tensor([[3.0]]), torch.ones(1, 1), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(3.125)  # 0.5 * max((0.5-3)^2, (1.8-3)^2)
    assert values.grad.item() == pytest.approx(-2.5)
    assert clipfrac.item() == 1.0
    # inside the clip range the fraction is 0 and the plain squared error is used
    loss, clipfrac = ppo_value_loss(
        torch.tensor([[2.1]]), torch.tensor([[2.0]]), torch.tensor([[3.0]]), torch.ones(1, 1), 0.2
    )
    assert loss.item() == pytest.approx(0.5 * 0.81) and clipfrac.item() == 0.0


def test_policy_loss_equals_plain_loop():
    torch.manual_seed(1)
    logps = -torch.rand(3, 4) * 2
    old = logps + torch.randn(3, 4) * 0.3
    ref = logps + torch.randn(3, 4) * 0.3
    advantages = torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    loss, stats = ppo_policy_loss(logps, old, ref, advantages, mask, clip_epsilon=0.2, kl_coef=0.02)
    surrogate, kl, log_ratio_sq, clipped, count = 0.0, 0.0, 0.0, 0, 0
    for i in range(3):
        for t in range(4):
            if not mask[i, t]:
                continue
            ratio = math.exp(logps[i, t] - old[i, t])
            a = advantages[i, t].item()
            surrogate += max(-a * ratio, -a * min(max(ratio, 0.8), 1.2))
            d = (ref[i, t] - logps[i, t]).item()
            kl += math.exp(d) - d - 1
            log_ratio_sq += (logps[i, t] - old[i, t]).item() ** 2
            clipped += abs(ratio - 1) > 0.2
            count += 1
    assert loss.item() == pytest.approx(surrogate / count + 0.02 * kl / count, abs=1e-5)
    assert stats["approx_kl"].item() == pytest.approx(0.5 * log_ratio_sq / count, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(clipped / count)


def make_update_inputs(tokenizer):
    from argparse import Namespace

    from trainer.train_ppo import PPORolloutBatch

    from model.model_minimind import CriticModel, MiniMindForCausalLM
    from trainer.rollout_engine import TorchRolloutEngine, compute_per_token_logps
    from trainer.rollout_engine import tokenize_prompts
    from trainer.infra.weights import build_config

    torch.manual_seed(0)
    config = build_config(64, 2, 0)
    actor = MiniMindForCausalLM(config)
    critic = CriticModel(config)
    critic.load_actor_state_dict(actor.state_dict())
    prompts = ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n"] * 4
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts, 64, "cpu")
    rollout = TorchRolloutEngine(actor, tokenizer, generator=torch.Generator().manual_seed(0)).rollout(
        prompt_ids, attention_mask, 1, 6
    )
    gen_len = rollout.completion_ids.size(1)
    with torch.no_grad():
        values = critic(rollout.output_ids, rollout.attention_mask).values[:, -gen_len - 1 : -1]
        ref = compute_per_token_logps(actor, rollout.output_ids, gen_len, rollout.attention_mask).per_token_logps
    data = PPORolloutBatch(
        output_ids=rollout.output_ids,
        full_mask=rollout.attention_mask,
        completion_mask=rollout.completion_mask,
        old_per_token_logps=rollout.per_token_logps,
        ref_per_token_logps=ref,
        old_resp_values=values,
        advantages=torch.randn(4, gen_len),
        returns=torch.randn(4, gen_len),
    )
    args = Namespace(
        ppo_update_iters=2,
        mini_batch_size=1,
        temperature=1.0,
        clip_epsilon=0.2,
        kl_coef=0.02,
        cliprange_value=0.2,
        vf_coef=0.5,
        minibatch_accumulation_steps=1,
        kl_placement="loss",
        grad_clip=1.0,
        early_stop_kl=0.25,
        dtype="float32",
        logprob_chunk_size=0,
    )
    return actor, critic, data, args


class CountingAdamW(torch.optim.AdamW):
    steps = 0

    def step(self, closure=None):
        CountingAdamW.steps += 1
        return super().step(closure)


@pytest.mark.parametrize("early_stop_kl, expected_steps", [(1e9, 8), (1e-12, 1)])
def test_early_stop_means_no_further_optimizer_step(tokenizer, early_stop_kl, expected_steps):
    """The first minibatch has ratio 1 (approx KL 0) and is applied; with a tiny threshold the next one stops."""
    from trainer.train_ppo import PPOLearners, ppo_update
    from trainer.infra.optimizer import build_cosine_scheduler

    actor, critic, data, args = make_update_inputs(tokenizer)
    args.early_stop_kl = early_stop_kl
    CountingAdamW.steps = 0
    actor_opt, critic_opt = CountingAdamW(actor.parameters(), lr=1e-2), CountingAdamW(critic.parameters(), lr=1e-2)
    result = ppo_update(
        data,
        PPOLearners(
            actor,
            critic,
            (actor_opt, critic_opt),
            (build_cosine_scheduler(actor_opt, 10), build_cosine_scheduler(critic_opt, 10)),
        ),
        args,
        "cpu",
        torch.Generator().manual_seed(0),
        autocast_context("cpu", args.dtype),
    )
    assert result["optimizer_steps"] == expected_steps  # 2 epochs x 4 minibatches without a stop
    assert CountingAdamW.steps == 2 * expected_steps  # actor + critic
    assert result["early_stop"] == float(expected_steps == 1)


def test_normalize_rewards_hand_computed():
    from trainer.train_ppo import normalize_rewards

    # rewards 1, 2, 3, 6: mean 3, biased std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5) = 1.870829
    assert normalize_rewards(torch.tensor([1.0, 2.0, 3.0, 6.0])).tolist() == pytest.approx(
        [-1.069045, -0.534522, 0.0, 1.603567], abs=1e-5
    )
    assert normalize_rewards(torch.tensor([2.0, 2.0])).tolist() == [0.0, 0.0]


def test_ppo_policy_loss_masked_position_with_huge_log_ratio_stays_finite():
    # the masked second token's k3 input ref - logp = 92 overflows exp(); before the mask was applied ahead of
    # exp(), masked_mean multiplied inf by 0 and the loss itself was nan
    per_token_logps = torch.tensor([[-1.0, -95.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -95.0]])
    ref = torch.tensor([[-1.0, -3.0]])
    loss, stats = ppo_policy_loss(per_token_logps, old, ref, torch.tensor([[1.0, 1.0]]), torch.tensor([[1, 0]]))
    loss.backward()
    # real token: ratio 1 inside the clip range, k3 0 -> loss -A * ratio = -1, d/dlogp = -A * ratio = -1
    assert loss.item() == pytest.approx(-1.0)
    assert per_token_logps.grad.tolist() == [[-1.0, 0.0]]
    assert stats["kl_ref"].item() == 0.0


class GradNormRecorder(torch.optim.SGD):
    """SGD with lr 0 that records the actor's gradient norm at every optimizer step."""

    def __init__(self, params):
        self.params_list = list(params)
        super().__init__(self.params_list, lr=0.0)
        self.norms = []

    def step(self, closure=None):
        grads = [p.grad.flatten() for p in self.params_list if p.grad is not None]
        self.norms.append(float(torch.cat(grads).norm()))
        return super().step(closure)


def test_ppo_last_partial_accumulation_window_gets_its_own_size():
    # 4 identical rows, minibatches of 1, 2 epochs = 8 minibatches, --minibatch_accumulation_steps 3: windows 3, 3, 2.
    # Each optimizer step must apply the mean gradient of its window, so the three norms are equal; a last window
    # divided by 3 instead of 2 would give norms in the ratio 3 : 3 : 2.
    import types

    from model.model_minimind import CriticModel, MiniMindForCausalLM
    from trainer.train_ppo import PPOLearners, PPORolloutBatch, ppo_update
    from trainer.infra.weights import build_config
    from trainer.infra.optimizer import build_cosine_scheduler

    torch.manual_seed(0)
    config = build_config(64, 2, 0)
    actor, critic = MiniMindForCausalLM(config), CriticModel(config)
    ids = torch.randint(3, 100, (1, 8)).repeat(4, 1)  # [4, 8]
    data = PPORolloutBatch(
        output_ids=ids,
        full_mask=torch.ones_like(ids),
        completion_mask=torch.ones(4, 5, dtype=torch.long),
        old_per_token_logps=torch.full((4, 5), -4.0),
        ref_per_token_logps=torch.full((4, 5), -4.0),
        advantages=torch.ones(4, 5),
        old_resp_values=torch.zeros(4, 5),
        returns=torch.ones(4, 5),
    )
    actor_optimizer, critic_optimizer = GradNormRecorder(actor.parameters()), GradNormRecorder(critic.parameters())
    args = types.SimpleNamespace(
        ppo_update_iters=2,
        mini_batch_size=1,
        minibatch_accumulation_steps=3,
        kl_placement="loss",
        dtype="float32",
        temperature=1.0,
        clip_epsilon=0.2,
        kl_coef=0.0,
        early_stop_kl=100.0,
        logprob_chunk_size=0,
        cliprange_value=0.2,
        vf_coef=0.5,
        grad_clip=1e9,
    )
    result = ppo_update(
        data,
        PPOLearners(
            actor,
            critic,
            (actor_optimizer, critic_optimizer),
            (build_cosine_scheduler(actor_optimizer, 10), build_cosine_scheduler(critic_optimizer, 10)),
        ),
        args,
        "cpu",
        torch.Generator().manual_seed(0),
        autocast_context("cpu", args.dtype),
    )
    assert result["optimizer_steps"] == 3.0
    assert len(actor_optimizer.norms) == 3
    assert actor_optimizer.norms[2] == pytest.approx(actor_optimizer.norms[0], rel=1e-4)
    assert actor_optimizer.norms[1] == pytest.approx(actor_optimizer.norms[0], rel=1e-4)


def test_kl_penalty_rewards_hand_computed():
    # logp - ref = [0.5, -1.0, 0.0 | masked 9]; -0.1 * that = [-0.05, 0.1, 0, 0]
    from trainer.train_ppo import kl_penalty_rewards

    old = torch.tensor([[-1.0, -2.0, -0.5, -10.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -19.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert kl_penalty_rewards(old, ref, mask, 0.1)[0].tolist() == pytest.approx([-0.05, 0.1, 0.0, 0.0], abs=1e-7)


def test_kl_in_the_reward_flows_through_gae_as_a_plain_return():
    # --kl_placement reward: token rewards [-0.05, 0.1, 0 + 1.0 (sequence reward on the last real token)];
    # with gamma = lambda = 1 and V = 0, A_t is the sum of the rewards from t on: [1.05, 1.1, 1.0]
    from trainer.train_ppo import kl_penalty_rewards

    old = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.ones(1, 3, dtype=torch.long)
    token_rewards = place_sequence_rewards(torch.tensor([1.0]), mask) + kl_penalty_rewards(old, ref, mask, 0.1)
    advantages, returns = compute_gae(token_rewards, torch.zeros(1, 3), mask, gamma=1.0, lam=1.0)
    assert advantages[0].tolist() == pytest.approx([1.05, 1.1, 1.0], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([1.05, 1.1, 1.0], abs=1e-6)


def test_kl_placement_reward_takes_the_kl_out_of_the_loss(tokenizer):
    # the same update with kl_coef 0.02 in the rewards and a loss without KL equals kl_coef 0 in the loss
    from trainer.train_ppo import PPOLearners, ppo_update
    from trainer.infra.optimizer import build_cosine_scheduler

    results = []
    for kl_coef, placement in ((0.0, "loss"), (0.02, "reward")):
        actor, critic, data, args = make_update_inputs(tokenizer)
        data.ref_per_token_logps = data.ref_per_token_logps - 1.0  # a KL the loss would see
        args.kl_coef, args.kl_placement, args.ppo_update_iters = kl_coef, placement, 1
        actor_opt = torch.optim.SGD(actor.parameters(), lr=0.0)
        critic_opt = torch.optim.SGD(critic.parameters(), lr=0.0)
        schedules = build_cosine_scheduler(actor_opt, 10), build_cosine_scheduler(critic_opt, 10)
        results.append(
            ppo_update(
                data,
                PPOLearners(actor, critic, (actor_opt, critic_opt), schedules),
                args,
                "cpu",
                torch.Generator().manual_seed(0),
                autocast_context("cpu", args.dtype),
            )
        )
    assert results[1]["policy_loss"] == pytest.approx(results[0]["policy_loss"], abs=1e-7)
    assert results[1]["kl_ref"] > 0.1  # still logged


class GateGradRecorder(torch.optim.SGD):
    """SGD with lr 0 that records, at every step, the gradient norm of the parameters whose name has 'gate'."""

    def __init__(self, named_params):
        named_params = list(named_params)
        self.gates = [p for name, p in named_params if ".gate." in name]
        super().__init__([p for _, p in named_params], lr=0.0)
        self.gate_norms = []

    def step(self, closure=None):
        grads = [p.grad.flatten() for p in self.gates if p.grad is not None]
        self.gate_norms.append(float(torch.cat(grads).norm()) if grads else 0.0)
        return super().step(closure)


def test_moe_critic_routers_get_the_load_balancing_gradient():
    # The critic's value head starts at 0, so the value loss sends no gradient into its backbone at the first
    # update: its MoE routers learn only from their own aux loss, which must therefore reach the loss.
    import types

    from model.model_minimind import CriticModel, MiniMindForCausalLM
    from trainer.train_ppo import PPOLearners, PPORolloutBatch, ppo_update
    from trainer.infra.weights import build_config
    from trainer.infra.optimizer import build_cosine_scheduler

    torch.manual_seed(0)
    config = build_config(64, 2, 1)
    actor, critic = MiniMindForCausalLM(config), CriticModel(config)
    ids = torch.randint(3, 400, (2, 8))  # [2, 8]
    data = PPORolloutBatch(
        output_ids=ids,
        full_mask=torch.ones_like(ids),
        completion_mask=torch.ones(2, 4, dtype=torch.long),
        old_per_token_logps=torch.full((2, 4), -6.0),
        ref_per_token_logps=torch.full((2, 4), -6.0),
        advantages=torch.ones(2, 4),
        old_resp_values=torch.zeros(2, 4),
        returns=torch.ones(2, 4),
    )
    args = types.SimpleNamespace(
        ppo_update_iters=1,
        mini_batch_size=2,
        minibatch_accumulation_steps=1,
        kl_placement="loss",
        dtype="float32",
        temperature=1.0,
        clip_epsilon=0.2,
        kl_coef=0.0,
        early_stop_kl=100.0,
        logprob_chunk_size=0,
        cliprange_value=0.2,
        vf_coef=0.5,
        grad_clip=1e9,
    )
    actor_optimizer = torch.optim.SGD(actor.parameters(), lr=0.0)
    critic_optimizer = GateGradRecorder(critic.named_parameters())
    assert len(critic_optimizer.gates) == 2  # one router per layer
    ppo_update(
        data,
        PPOLearners(
            actor,
            critic,
            (actor_optimizer, critic_optimizer),
            (build_cosine_scheduler(actor_optimizer, 10), build_cosine_scheduler(critic_optimizer, 10)),
        ),
        args,
        "cpu",
        torch.Generator().manual_seed(0),
        autocast_context("cpu", args.dtype),
    )
    assert critic_optimizer.gate_norms[0] > 0.0
    router_inputs = []  # what each layer's MoE block received, [2*8, hidden]
    hooks = [
        layer.mlp.register_forward_hook(lambda module, args, out: router_inputs.append(args[0].reshape(-1, 64)))
        for layer in critic.model.layers
    ]
    out = critic(ids)
    values, aux_loss = out.values, out.aux_loss
    for hook in hooks:
        hook.remove()
    expected = sum(
        switch_aux_loss_loop(layer.mlp.gate.weight, x, config.num_experts_per_tok, config.router_aux_loss_coef)
        for layer, x in zip(critic.model.layers, router_inputs)
    )
    assert aux_loss.item() == pytest.approx(expected, rel=1e-5) and aux_loss.item() > 0
    assert torch.equal(values, critic(ids).values)


def switch_aux_loss_loop(gate_weight, tokens, top_k, coef):
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4) in plain Python, token by token:
    coef * E * sum_e f_e * P_e, f_e = share of the N * top_k routing slots that chose expert e, P_e = mean router
    probability of e."""
    num_experts = gate_weight.size(0)
    counts, prob_sums = [0] * num_experts, [0.0] * num_experts
    for token in tokens.tolist():
        logits = [sum(w * t for w, t in zip(row, token)) for row in gate_weight.tolist()]
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        probs = [v / sum(exps) for v in exps]
        for expert in sorted(range(num_experts), key=lambda e: -probs[e])[:top_k]:
            counts[expert] += 1
        for expert in range(num_experts):
            prob_sums[expert] += probs[expert]
    slots, num_tokens = len(tokens) * top_k, len(tokens)
    return coef * num_experts * sum(counts[e] / slots * prob_sums[e] / num_tokens for e in range(num_experts))
