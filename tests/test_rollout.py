"""Rollout engine (chapter 8.2): log-probs, masks and the one temperature convention."""

import pytest
import torch

from trainer.rollout_engine import TorchRolloutEngine, compute_per_token_logps, create_rollout_engine, tokenize_prompts
from trainer.speed.selective_log_softmax import selective_log_softmax

PROMPTS = [
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "<|im_start|>user\n5 加 7 是多少？<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logps_equal_plain_per_row_forward(policy, tokenizer, temperature):
    engine = TorchRolloutEngine(policy, tokenizer, generator=torch.Generator().manual_seed(1))
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS, 256, "cpu")
    result = engine.rollout(prompt_ids, attention_mask, num_generations=3, max_new_tokens=12, temperature=temperature)
    n, r = result.completion_ids.shape
    assert n == 6 and result.per_token_logps.shape == (6, r)
    assert torch.equal(result.output_ids[0, : prompt_ids.size(1)], result.output_ids[2, : prompt_ids.size(1)])
    assert torch.equal(result.output_ids[3, : prompt_ids.size(1)], prompt_ids[1])  # P0,P0,P0,P1,P1,P1
    assert torch.equal(result.prompt_mask, attention_mask.repeat_interleave(3, dim=0))  # [6, P]
    for i in range(n):  # each row alone, unpadded, scored by a plain log_softmax
        prompt = prompt_ids[i // 3][attention_mask[i // 3].bool()]
        completion = result.completion_ids[i][result.completion_mask[i].bool()]
        sequence = torch.cat([prompt, completion]).unsqueeze(0)
        with torch.no_grad():
            logits = policy(sequence).logits[0, len(prompt) - 1 : -1] / temperature
        expected = torch.log_softmax(logits, dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        got = result.per_token_logps[i][: len(completion)]
        assert (got - expected).abs().max() <= 1e-5
        text = tokenizer.decode(completion[completion != tokenizer.eos_token_id].tolist())
        assert result.completions[i] == text


def test_sampler_logps_equal_recomputed_logps_with_eos_and_padding(policy, tokenizer):
    """Chapter 8.2's "recorded at sampling time" against the second forward, on rows that stop at EOS."""
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS, 256, "cpu")
    eos_bias = torch.zeros(policy.config.vocab_size)
    eos_bias[tokenizer.eos_token_id] = 6.0  # p(EOS) ~ 6% per token: most rows finish early and get padded
    policy.lm_head.register_forward_hook(lambda module, inputs, logits: logits + eos_bias)
    engine = TorchRolloutEngine(policy, tokenizer, generator=torch.Generator().manual_seed(5))
    sampler = engine.rollout(prompt_ids, attention_mask, 4, 24, temperature=0.9)
    with torch.no_grad():
        recomputed = compute_per_token_logps(
            policy, sampler.output_ids, sampler.completion_ids.size(1), sampler.attention_mask, temperature=0.9
        ).per_token_logps  # [N, R]
    mask = sampler.completion_mask.bool()
    assert 0 < (~mask).sum() and mask.all(dim=1).sum() < mask.size(0) - 2  # rows of several lengths
    assert (sampler.per_token_logps - recomputed)[mask].abs().max() <= 1e-5
    assert torch.all(sampler.per_token_logps[~mask] == 0)


def test_ratio_is_one_before_any_update(policy, tokenizer):
    engine = create_rollout_engine("torch", policy, tokenizer, generator=torch.Generator().manual_seed(2))
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS, 256, "cpu")
    result = engine.rollout(prompt_ids, attention_mask, 4, 16, temperature=0.8)
    assert not result.per_token_logps.requires_grad
    policy.train()
    forward = compute_per_token_logps(
        policy, result.output_ids, result.completion_ids.size(1), result.attention_mask, temperature=0.8
    )
    per_token_logps = forward.per_token_logps  # [N, R]
    assert per_token_logps.requires_grad and forward.entropies is None  # entropies only when asked for
    ratio = torch.exp(per_token_logps - result.per_token_logps)
    mask = result.completion_mask.bool()
    assert (ratio[mask] - 1).abs().max() <= 1e-5


def test_prompt_truncation_keeps_the_end(tokenizer):
    long_prompt = "<|im_start|>user\n" + "1 + 1 " * 100 + "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    prompt_ids, attention_mask, truncated = tokenize_prompts(tokenizer, [long_prompt, PROMPTS[0]], 32, "cpu")
    assert prompt_ids.shape == (2, 32) and truncated == 1
    assert tokenizer.decode(prompt_ids[0]).endswith("<|im_start|>assistant\n<think>\n")
    assert attention_mask[1].sum() < 32 and attention_mask[1, -1] == 1  # left padding


def test_unknown_engine():
    with pytest.raises(ValueError, match="valid: torch"):
        create_rollout_engine("vllm", None, None)


def test_bf16_autocast_logps_are_fp32_and_near_the_fp32_ones(policy, tokenizer):
    """--dtype bfloat16: matrix products in bf16, log-softmax in fp32; gradients land on the fp32 weights."""
    from trainer.infra.dtypes import autocast_context

    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS, 256, "cpu")
    result = TorchRolloutEngine(policy, tokenizer, generator=torch.Generator().manual_seed(3)).rollout(
        prompt_ids, attention_mask, 2, 8
    )
    args = (policy, result.output_ids, result.completion_ids.size(1), result.attention_mask)
    fp32_logps = compute_per_token_logps(*args).per_token_logps  # [N, R]
    with autocast_context("cpu", "bfloat16"):
        bf16_logps = compute_per_token_logps(*args).per_token_logps  # [N, R]
    assert bf16_logps.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: logits of this size (|logit| < 4) move by ~0.02, log-probs by ~0.05
    assert 0 < (bf16_logps - fp32_logps).abs().max() < 0.15
    bf16_logps.sum().backward()
    assert policy.lm_head.weight.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="--dtype 'float16'.*float32, bfloat16"):
        autocast_context("cpu", "float16")


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
    assert torch.autograd.gradcheck(
        lambda x: selective_log_softmax(x, index, temperature), (logits.detach().requires_grad_(),)
    )


def test_selective_log_softmax_saves_no_copy_of_the_logits():
    """The log-prob step keeps at most one sequence's logits above what the model already holds."""
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
