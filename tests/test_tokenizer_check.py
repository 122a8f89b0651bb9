"""A MiniMind user's own checkpoint, data and tokenizer: the run uses the tokenizer the checkpoint was trained with.

An upstream-format checkpoint: a MiniMindForCausalLM state dict in fp16 with hidden 768 and a 6400-row embedding (2
layers keep it fast), named full_sft_768.pth, without a tokenizer record, as upstream's trainer writes it; data in
upstream's rlaif.jsonl format. Expected tokenizer sizes are counted from the tokenizers' own tokenizer.json files.
"""

import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from conftest import MINIMIND_TOKENIZER as UPSTREAM_TOKENIZER
from conftest import ROOT
from test_scripts import run_script
from trainer.infra.weights import check_tokenizer_fits_checkpoint, tokenizer_record_path

BUNDLED_TOKENIZER = os.path.join(ROOT, "model")
UPSTREAM_DIMS = ["--hidden_size", "768", "--num_hidden_layers", "2"]


def tokenizer_json_size(folder):
    """Distinct ids of tokenizer.json: its model vocabulary and its added tokens."""
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    return len(set(spec["model"]["vocab"].values()) | {token["id"] for token in spec["added_tokens"]})


@pytest.fixture
def upstream_run_dir(tmp_path):
    """{tmp}/full_sft_768.pth (fp16, 6400 x 768 embedding, no record) and {tmp}/rlaif.jsonl (upstream's format)."""
    from model.model_minimind import MiniMindForCausalLM
    from trainer.infra.weights import build_config

    torch.manual_seed(0)
    model = MiniMindForCausalLM(build_config(hidden_size=768, num_hidden_layers=2, use_moe=0))
    torch.save({k: v.half() for k, v in model.state_dict().items()}, tmp_path / "full_sft_768.pth")
    rows = [
        {
            "conversations": [
                {"content": "请用一句话介绍你自己。", "role": "user"},
                {"content": "我是一个小型语言模型。", "role": "assistant"},
            ]
        },
        {
            "conversations": [
                {"content": "你是谁？", "role": "system"},
                {"content": "Say hi.", "role": "user"},
                {"content": "Hi!", "role": "assistant"},
            ]
        },
    ] * 4
    (tmp_path / "rlaif.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    return tmp_path


def upstream_command(script, folder, extra):
    return (
        [
            script,
            "--from_weight",
            "full_sft",
            "--save_dir",
            str(folder),
            "--data_path",
            str(folder / "rlaif.jsonl"),
            "--reward_model_path",
            "none",
            "--max_steps",
            "2",
            "--eval_interval",
            "0",
            "--batch_size",
            "2",
            "--max_gen_len",
            "8",
            "--run_dir",
            str(folder / "run"),
        ]
        + UPSTREAM_DIMS
        + extra
    )


SCRIPTS = [("trainer/train_grpo.py", ["--num_generations", "2"]), ("trainer/train_ppo.py", ["--mini_batch_size", "1"])]


@pytest.mark.parametrize("script, extra", SCRIPTS)
def test_upstream_checkpoint_trains_with_upstream_tokenizer(upstream_run_dir, script, extra):
    result = run_script(upstream_command(script, upstream_run_dir, extra + ["--tokenizer_path", UPSTREAM_TOKENIZER]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2/2" in result.stdout
    saved = "grpo_768.pth" if "grpo" in script else "ppo_768.pth"
    with open(tokenizer_record_path(str(upstream_run_dir / saved)), encoding="utf-8") as f:
        assert json.load(f)["tokenizer_size"] == tokenizer_json_size(UPSTREAM_TOKENIZER) == 6400


@pytest.mark.parametrize("script, extra", SCRIPTS)
def test_upstream_checkpoint_with_bundled_tokenizer_stops_before_any_model(upstream_run_dir, script, extra):
    result = run_script(upstream_command(script, upstream_run_dir, extra), timeout=300)
    assert result.returncode != 0
    bundled = tokenizer_json_size(BUNDLED_TOKENIZER)
    assert bundled == 441
    assert (
        f"full_sft_768.pth has an embedding of 6400 rows (a 6400-token vocabulary) and no record of its "
        f"tokenizer (full_sft_768.tokenizer.json beside it), but --tokenizer_path {BUNDLED_TOKENIZER} has "
        f"{bundled} tokens. Copy the record beside the weights, or name the tokenizer they were trained with"
    ) in result.stderr
    assert "loaded weights" not in result.stdout and "parameters" not in result.stdout  # no model was built
    assert not (upstream_run_dir / "run").exists()


def test_bundled_checkpoint_goes_with_bundled_tokenizer_only():
    """out/full_sft_256.pth keeps upstream's 6400-row embedding but was trained with the 441-token tokenizer."""
    checkpoint = os.path.join(ROOT, "out", "full_sft_256.pth")
    assert torch.load(checkpoint, weights_only=True)["model.embed_tokens.weight"].shape[0] == 6400
    check_tokenizer_fits_checkpoint(AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER), BUNDLED_TOKENIZER, checkpoint)
    with pytest.raises(
        ValueError,
        match=r"full_sft_256\.pth was trained with a tokenizer of 441 tokens .* but "
        r"--tokenizer_path .*minimind-tokenizer has 6400: pass --tokenizer_path",
    ):
        check_tokenizer_fits_checkpoint(
            AutoTokenizer.from_pretrained(UPSTREAM_TOKENIZER), UPSTREAM_TOKENIZER, checkpoint
        )


def test_record_of_another_vocabulary_of_the_same_size(tmp_path):
    checkpoint = tmp_path / "full_sft_256.pth"
    checkpoint.write_bytes(b"")  # the record decides; the weights are not read
    (tmp_path / "full_sft_256.tokenizer.json").write_text(json.dumps({"tokenizer_size": 441, "vocab_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="another vocabulary of the same size"):
        check_tokenizer_fits_checkpoint(AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER), "model", str(checkpoint))


def test_tokenizer_without_the_chat_tokens_is_refused():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({"<unk>": 0, "<|im_end|>": 1, "hello": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")
    with pytest.raises(
        ValueError,
        match=r"--tokenizer_path words: the chat template needs \['<\|im_start\|>', "
        r"'<think>', '</think>'\] as single tokens",
    ):
        check_tokenizer_fits_checkpoint(tokenizer, "words", None)
