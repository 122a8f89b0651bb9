"""trainer_utils.py: the rewards of chapter 8.3 and the KL and masks of 8.6, against hand-computed values."""

import math

import pytest
import torch

from trainer.trainer_utils import (
    answer_reward,
    calculate_rewards,
    completion_mask_from_ids,
    extract_final_number,
    k3_kl,
    masked_mean,
    prompt_to_messages,
    rep_penalty,
    repetition_tokens,
    rule_reward,
)


def test_rep_penalty_hand_computed():
    assert rep_penalty("") == 0.0
    assert rep_penalty("one two") == 0.0  # fewer than 3 tokens: no trigram
    assert rep_penalty("a b c d e") == 0.0  # 3 trigrams, all distinct
    # tokens a b a b a b: trigrams (a,b,a) (b,a,b) (a,b,a) (b,a,b): 4 grams, 2 distinct -> min(0.5, 2*0.5*2/4)=0.5
    assert rep_penalty("a b a b a b") == pytest.approx(0.5)
    # "x y z x y z w": 5 trigrams, distinct 3 (xyz, yzx, zxy) + (y z w)=4 -> repeated 1 -> 1*0.5*2/5 = 0.2
    assert rep_penalty("x y z x y z w") == pytest.approx(0.2)
    # punctuation counts as a token, case is ignored: "A, a, a," -> a , a , a , : 6 tokens
    assert rep_penalty("A, a, a,") == pytest.approx(0.5)


def test_rep_penalty_sees_chinese_hand_counted():
    # "你好" x 6, no punctuation: 12 character tokens, 10 trigrams, distinct (你好你) (好你好) -> repeated 8,
    # min(0.5, 8 * 0.5 * 2 / 10 = 0.8) = 0.5 (one "word" under \\w+, so no trigram at all)
    assert repetition_tokens("你好你好") == ["你", "好", "你", "好"]
    assert rep_penalty("你好你好你好你好你好你好") == pytest.approx(0.5)
    # "你好世界" x 6: 24 tokens, 22 trigrams, 4 distinct -> 18 repeated -> capped at 0.5
    assert rep_penalty("你好世界" * 6) == pytest.approx(0.5)
    # 我爱北京天安门我爱北京: 11 tokens, 9 trigrams, (我爱北) and (爱北京) twice -> 2 repeated -> 2 * 0.5 * 2 / 9
    assert rep_penalty("我爱北京天安门我爱北京") == pytest.approx(2 / 9)
    # a normal answer of the default task: 答 案 是 940 。 -> 3 distinct trigrams -> 0
    assert rep_penalty("答案是 940。") == 0.0
    # kana are characters too; Hangul is written with spaces and stays words: 안녕 x 4 -> 2 equal trigrams -> 0.5
    assert repetition_tokens("すしすし") == ["す", "し", "す", "し"]
    assert rep_penalty("안녕 안녕 안녕 안녕") == pytest.approx(0.5)


def test_rep_penalty_english_and_mixed_hand_counted():
    # the cat sat on the mat the cat sat: 9 words, 7 trigrams, (the cat sat) twice -> 1 * 0.5 * 2 / 7
    assert rep_penalty("the cat sat on the mat the cat sat") == pytest.approx(1 / 7)
    # 答 案 是 940 。 答 案 是 940 。: 10 tokens, 8 trigrams, 5 distinct -> 3 * 0.5 * 2 / 8 = 0.375
    assert repetition_tokens("答案是 940。") == ["答", "案", "是", "940", "。"]
    assert rep_penalty("答案是 940。答案是 940。") == pytest.approx(0.375)
    # digits glued to Chinese split from it: 是940 -> 是, 940; English words keep their case-folded form
    assert repetition_tokens("是940 The答案") == ["是", "940", "the", "答", "案"]


def test_rule_reward_cases():
    thinking = "t" * 25
    # length ok (+0.5), thinking 25 chars (+1.0), one </think> (+0.25), answer "42" no trigram (-0)
    assert rule_reward(f"{thinking}</think>42") == pytest.approx(1.75)
    # too short overall (-0.5), thinking too short (-0.5), one </think> (+0.25)
    assert rule_reward("hi</think>ok") == pytest.approx(-0.75)
    # two </think>: -0.25 instead of +0.25; thinking = text before the first one
    assert rule_reward(f"{thinking}</think>x</think>y") == pytest.approx(0.5 + 1.0 - 0.25)
    # no </think>: only the length rule and the repetition of the whole response
    assert rule_reward("a b a b a b a b a b a b") == pytest.approx(0.5 - 0.5)
    assert rule_reward("x" * 801) == pytest.approx(-0.5)


def test_answer_reward_and_number_extraction():
    assert extract_final_number("The answer is 1,234.") == "1234"
    assert extract_final_number("答案是 -17。") == "-17"
    assert extract_final_number("no digits") is None
    assert answer_reward("5+8=13</think>\n\nThe answer is 13.", "13") == 1.0
    assert answer_reward("13</think>\n\nThe answer is 12.", "13") == 0.0  # thinking does not count
    assert answer_reward("The answer is 13.0", "13") == 1.0
    assert answer_reward("The answer is 13", "") == 0.0


def test_prompt_to_messages():
    prompt = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert prompt_to_messages(prompt) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_calculate_rewards_sums_parts():
    responses = ["t" * 25 + "</think>The answer is 7.", "short"]
    parts = calculate_rewards(["p", "p"], responses, ["7", "7"], None, answer_reward_weight=2.0)
    assert parts["rule_rewards"].tolist() == pytest.approx([1.75, -0.5])
    assert parts["answer_rewards"].tolist() == [1.0, 0.0]
    assert parts["rewards"].tolist() == pytest.approx([3.75, -0.5])
    assert parts["rewards"].dtype == torch.float32


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([7, 8, 2, 0, 0], [1, 1, 1, 0, 0]),
        ([7, 2, 9, 2, 0], [1, 1, 0, 0, 0]),
        ([7, 8, 9, 9, 9], [1, 1, 1, 1, 1]),
        ([2, 0, 0, 0, 0], [1, 0, 0, 0, 0]),
    ],
)
def test_completion_mask_through_first_eos(ids, expected):
    assert completion_mask_from_ids(torch.tensor([ids]), eos_token_id=2).tolist() == [expected]


def test_k3_values():
    assert k3_kl(torch.tensor(-2.0), torch.tensor(-1.0)).item() == pytest.approx(math.exp(-1), abs=1e-5)  # 0.36788
    assert k3_kl(torch.tensor(-1.3), torch.tensor(-1.3)).item() == 0.0
    torch.manual_seed(0)
    assert (k3_kl(torch.randn(100) * 3, torch.randn(100) * 3) >= 0).all()


def test_masked_mean_ignores_masked_and_empty():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(1.5)
    assert masked_mean(values, mask, dim=1).tolist() == pytest.approx([1.5, 0.0])


def test_masked_k3_is_zero_with_zero_gradient_where_masked():
    per_token_logps = torch.tensor([[-1.0, -200.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0]])
    per_token_kl = k3_kl(ref, per_token_logps, torch.tensor([[1, 0]]))
    per_token_kl.sum().backward()
    # real token: k3 = e^-1 - (-1) - 1 = 0.36788, d/dlogp = 1 - exp(ref - logp) = 1 - e^-1 = 0.63212
    assert per_token_kl[0].tolist() == pytest.approx([math.exp(-1), 0.0], abs=1e-6)
    assert per_token_logps.grad[0].tolist() == pytest.approx([1 - math.exp(-1), 0.0], abs=1e-6)
