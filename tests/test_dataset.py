"""Datasets, tokenizer and chat template."""

import json
import os
import re

import pytest

from conftest import MINIMIND_TOKENIZER, ROOT
from dataset.lm_dataset import DataFormatError, RLAIFDataset, SFTDataset, read_conversations_jsonl, sft_collate


def write_lines(path, lines):
    path.write_bytes(b"".join(line if isinstance(line, bytes) else line.encode() for line in lines))
    return str(path)


def conv(user, assistant):
    return (
        json.dumps(
            {"conversations": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]},
            ensure_ascii=False,
        )
        + "\n"
    )


def test_tokenizer_special_ids(tokenizer):
    assert tokenizer.pad_token_id == 0 and tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert len(tokenizer) <= 6400
    # digits are single tokens and </think> survives decoding
    ids = tokenizer("</think> 4096", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "</think> 4096"
    assert [tokenizer.decode([i]) for i in ids[-4:]] == ["4", "0", "9", "6"]


def test_chat_template_open_thinking(tokenizer):
    messages = [{"role": "user", "content": "1+1?"}]
    opened = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, open_thinking=True)
    closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert opened == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert closed == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_sft_labels_cover_assistant_tokens_only(tmp_path, tokenizer):
    path = write_lines(tmp_path / "sft.jsonl", [conv("What is 2+3?", "<think>\n2+3=5\n</think>\n\nThe answer is 5.")])
    input_ids, labels = SFTDataset(path, tokenizer)[0]
    trained = tokenizer.decode(input_ids[labels != -100])
    assert trained == "<think>\n2+3=5\n</think>\n\nThe answer is 5.<|im_end|>"
    untrained = tokenizer.decode(input_ids[labels == -100])
    assert "What is 2+3?" in untrained and "The answer" not in untrained
    ids, labs, mask = sft_collate([(input_ids, labels), (input_ids[:5], labels[:5])], pad_token_id=0)
    assert ids.shape == labs.shape == mask.shape == (2, len(input_ids))
    assert mask[1].sum() == 5 and (labs[1, 5:] == -100).all()


def test_rlaif_prompt_and_answer(tmp_path, tokenizer):
    path = write_lines(tmp_path / "rl.jsonl", [conv("What is 2+3?", "5")] * 50)
    always = RLAIFDataset(path, tokenizer, thinking_ratio=1.0)
    assert always[0] == {
        "prompt": "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n",
        "answer": "5",
        "index": 0,
    }
    never = RLAIFDataset(path, tokenizer, thinking_ratio=0.0)
    assert never[0]["prompt"].endswith("<think>\n\n</think>\n\n")
    half = RLAIFDataset(path, tokenizer, thinking_ratio=0.5, seed=7)
    opened = [half[i]["prompt"].endswith("assistant\n<think>\n") for i in range(50)]
    assert 10 < sum(opened) < 40
    assert opened == [
        RLAIFDataset(path, tokenizer, 0.5, seed=7)[i]["prompt"].endswith("assistant\n<think>\n") for i in range(50)
    ]  # the same draw on a second pass (resume)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        (b'{"conversations": [}\n', "invalid JSON"),
        (b'{"text": "no conversations"}\n', "conversations"),
        (b'{"conversations": [{"role": "user"}]}\n', "content"),
        (b'{"conversations": [{"role": "user", "content": "caf\xe9"}]}\n', "not valid UTF-8"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad_line, message):
    path = write_lines(tmp_path / "data.jsonl", [conv("a", "b"), conv("c", "d"), bad_line])
    with pytest.raises(DataFormatError, match=rf"data\.jsonl:3: .*{message}"):
        read_conversations_jsonl(path)


def test_bundled_data_is_consistent():
    train = read_conversations_jsonl(os.path.join(ROOT, "dataset", "rlaif_train.jsonl"))
    heldout = read_conversations_jsonl(os.path.join(ROOT, "dataset", "rlaif_heldout.jsonl"))
    train_questions = {row["conversations"][0]["content"] for row in train}
    heldout_questions = [row["conversations"][0]["content"] for row in heldout]
    assert not train_questions & set(heldout_questions)
    for row in heldout:  # the reference answer is the arithmetic result of the question
        question, answer = row["conversations"][0]["content"], row["conversations"][1]["content"]
        numbers = [int(tok) for tok in re.findall(r"\d+", question)]
        assert len(numbers) == 2, question
        assert int(answer) in (numbers[0] + numbers[1], numbers[0] - numbers[1])


def test_upstream_minimind_tokenizer_works_with_datasets(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MINIMIND_TOKENIZER)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer) <= 6400) == (0, 2, True)
    path = write_lines(tmp_path / "sft.jsonl", [conv("你好", "<think>\n想一想\n</think>\n\n你好！")])
    input_ids, labels = SFTDataset(path, tokenizer)[0]
    assert tokenizer.decode(input_ids[labels != -100]).endswith("你好！<|im_end|>")
    item = RLAIFDataset(path, tokenizer, thinking_ratio=1.0)[0]
    assert item["prompt"].endswith("<|im_start|>assistant\n<think>\n") and item["answer"].startswith("<think>")


@pytest.mark.parametrize(
    "tokenizer_path", [os.path.join(ROOT, "model"), MINIMIND_TOKENIZER], ids=["bundled", "upstream"]
)
def test_a_huge_prompt_keeps_the_tokens_of_its_end_without_being_tokenized_whole(tokenizer_path, tmp_path):
    """A one-line prompt of ~1 MB: the run tokenizes its end only, and gets the last --max_seq_len tokens that the
    whole text's tokenization ends with; the dataset counts it as cut."""
    import torch
    from transformers import AutoTokenizer

    from dataset.lm_dataset import prompt_tail
    from trainer.rollout_engine import tokenize_prompts

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    words = ["what", "is", "12", "plus", "30?", "计算", "一下", "(45 + 27) * 3", "\n", "  ", "<think>", "ok."]
    text = " ".join(words[(i * 7 + i // 5) % len(words)] for i in range(120_000))  # ~0.8 MB, no period
    path = tmp_path / "huge.jsonl"
    path.write_text(
        json.dumps({"conversations": [{"role": "user", "content": "2+2=?"}, {"role": "assistant", "content": "4"}]})
        + "\n"
        + json.dumps({"conversations": [{"role": "user", "content": text}, {"role": "assistant", "content": "42"}]})
        + "\n"
    )
    dataset = RLAIFDataset(str(path), tokenizer, thinking_ratio=0.0)
    prompt = dataset[1]["prompt"]
    whole = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # the reference: the whole text, once
    for max_seq_len in (64, 512):
        assert len(prompt_tail(prompt, max_seq_len, tokenizer)) < len(prompt) // 10
        prompt_ids, attention_mask, truncated = tokenize_prompts(
            tokenizer, [dataset[0]["prompt"], prompt], max_seq_len, "cpu"
        )
        assert truncated == 1 and prompt_ids.shape == (2, max_seq_len)
        assert prompt_ids[1].tolist() == whole[-max_seq_len:]
        assert attention_mask[0].sum() < max_seq_len and torch.equal(attention_mask[1], torch.ones(max_seq_len).long())
        assert dataset.count_longer_than(max_seq_len) == 1
