"""The held-out evaluation (trainer/evaluation.py) against checkpoints whose accuracy is known by construction."""

import json
import os

import pytest
import torch

from conftest import ROOT

from dataset.lm_dataset import RLAIFDataset
from model.model_minimind import Generation
from trainer.evaluation import Decoding, HeldOutEvaluator, evaluate

VAL_PATH = os.path.join(ROOT, "dataset", "rlaif_val.jsonl")


class ScriptedAnswerer(torch.nn.Module):
    """A stand-in policy that answers each prompt with a fixed text: the reference answer, or a wrong one.

    ``answer_for(prompt_text) -> str`` decides the final number; the completion is the SFT format
    '<think>\\n...\\n</think>\\n\\nThe answer is N.' followed by EOS and padding.
    """

    def __init__(self, tokenizer, answer_for):
        super().__init__()
        self.tokenizer = tokenizer
        self.answer_for = answer_for
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # so that .parameters() is not empty

    def generate(self, input_ids, attention_mask=None, max_new_tokens=96, eos_token_id=2, pad_token_id=0, **unused):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
            text = f"<think>\ncolumns\n</think>\n\nThe answer is {self.answer_for(prompt)}."
            rows.append((self.tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_token_id])[:max_new_tokens])
        width = max(len(r) for r in rows)
        completion = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # [B, R]
        for i, row in enumerate(rows):
            completion[i, : len(row)] = torch.tensor(row)
        output_ids = torch.cat([input_ids, completion], dim=1)  # [B, P + R]
        return Generation(output_ids, torch.zeros(completion.shape))


def reference_of(prompt, references):
    """The reference answer of a rendered prompt: the one whose question text it contains."""
    matches = [answer for question, answer in references.items() if question in prompt]
    assert len(matches) == 1
    return matches[0]


@pytest.fixture
def val_references():
    """{question: reference answer} of the first 40 validation prompts, read with a plain loop."""
    references = {}
    with open(VAL_PATH, encoding="utf-8") as f:
        for line, _ in zip(f, range(40)):
            turns = json.loads(line)["conversations"]
            references[turns[0]["content"]] = turns[1]["content"]
    return references


@pytest.mark.parametrize("offset, expected", [(0, 1.0), (1, 0.0)])
def test_always_right_and_always_wrong_answerers(tokenizer, val_references, offset, expected):
    model = ScriptedAnswerer(tokenizer, lambda p: int(reference_of(p, val_references)) + offset)
    dataset = RLAIFDataset(VAL_PATH, tokenizer, thinking_ratio=1.0)
    for greedy in (False, True):
        result = evaluate(model, tokenizer, dataset, Decoding(40, 16, 32, 1.0, greedy, seed=0))
        assert result["accuracy"] == expected
        assert len(result["samples"]) == 40


def test_half_right_answerer_and_evaluator_summary(tokenizer, val_references):
    # right exactly when the reference is even: the expected accuracy is the share of even references
    even_share = sum(int(a) % 2 == 0 for a in val_references.values()) / len(val_references)
    assert 0 < even_share < 1

    def answer_for(prompt):
        reference = int(reference_of(prompt, val_references))
        return reference if reference % 2 == 0 else reference + 1

    dataset = RLAIFDataset(VAL_PATH, tokenizer, thinking_ratio=1.0)
    evaluator = HeldOutEvaluator(dataset, tokenizer, Decoding(40, 16, 32, 1.0), "cpu")
    start = evaluator(ScriptedAnswerer(tokenizer, lambda p: int(reference_of(p, val_references)) + 1), 0)
    end = evaluator(ScriptedAnswerer(tokenizer, answer_for), 10)
    assert start["eval/accuracy_sampled"] == 0.0 and start["eval/accuracy_greedy"] == 0.0
    assert end["eval/accuracy_sampled"] == pytest.approx(even_share)
    assert end["eval/accuracy_greedy"] == pytest.approx(even_share)
    lines = evaluator.summary_lines()
    assert "step 0" in lines[1] and "step 10" in lines[1]
    assert lines[2].split()[-3:] == ["0.000", f"{even_share:.3f}", f"{even_share:+.3f}"]


def test_evaluation_leaves_the_global_random_state_and_training_mode(tiny_config, tokenizer):
    from model.model_minimind import MiniMindForCausalLM

    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config).train()
    dataset = RLAIFDataset(VAL_PATH, tokenizer, thinking_ratio=1.0)
    state = torch.get_rng_state()
    first = evaluate(model, tokenizer, dataset, Decoding(6, 3, 8, 1.0, False, seed=5))
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training
    second = evaluate(model, tokenizer, dataset, Decoding(6, 3, 8, 1.0, False, seed=5))  # same seed, same answers
    assert [s["completion"] for s in first["samples"]] == [s["completion"] for s in second["samples"]]


def test_a_stop_request_ends_the_evaluation_between_batches_with_an_empty_result(tiny_config, tokenizer):
    from model.model_minimind import MiniMindForCausalLM

    torch.manual_seed(0)
    model = MiniMindForCausalLM(tiny_config).train()
    dataset = RLAIFDataset(VAL_PATH, tokenizer, thinking_ratio=1.0)
    checks = []

    def stop_after_two_batches():
        checks.append(1)
        return len(checks) > 2

    decoding = Decoding(9, 3, 8, 1.0, False, seed=5)
    assert evaluate(model, tokenizer, dataset, decoding, should_stop=stop_after_two_batches) == {}
    assert len(checks) == 3 and model.training  # asked before each batch; training mode given back
    assert len(evaluate(model, tokenizer, dataset, Decoding(9, 3, 8, 1.0, False, seed=5))["samples"]) == 9


def test_validation_and_test_prompts_are_disjoint_from_every_other_file():
    def problems(path):
        keys = set()
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                turns = row["conversations"] if "conversations" in row else row["chosen"]
                keys.add(turns[0]["content"])
        return keys

    data = os.path.join(ROOT, "dataset")
    val, test = problems(VAL_PATH), problems(os.path.join(data, "rlaif_test.jsonl"))
    assert len(val) == 500 and len(test) == 1000
    assert not val & test
    for name in (
        "sft_data.jsonl",
        "rlaif_train.jsonl",
        "rlaif_heldout.jsonl",
        "reward_train.jsonl",
        "reward_heldout.jsonl",
    ):
        other = problems(os.path.join(data, name))
        assert not (val | test) & other, name
