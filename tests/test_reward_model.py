"""The external reward model (chapter 8.3) and trainer/train_reward.py, with tiny models built here."""

import gzip
import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

from conftest import FIXTURES, MINIMIND_TOKENIZER, ROOT
from in_process import run_main
from dataset.lm_dataset import DataFormatError, parse_hh_transcript, read_preference_pairs
from test_scripts import TINY, run_script
from trainer.infra.reward_models import read_reward_model_config
from trainer.trainer_utils import LMForRewardModel, calculate_rewards, prompt_to_messages, reward_model_messages
from trainer.train_reward import bradley_terry_loss, build_reward_model, pairwise_accuracy

# The first 100 pairs of HH-RLHF harmless-base test, as published (tests/fixtures/README.md).
HH_PATH = os.path.join(FIXTURES, "hh-rlhf", "harmless-base-test-first-100.jsonl")

# ----------------------------------------------------------------------------- tiny reward models written to tmp
TOY_CONFIG_CODE = """
from transformers import PretrainedConfig


class ToyRewardConfig(PretrainedConfig):
    model_type = "toy_reward"

    def __init__(self, offset=0.0, **kwargs):
        self.offset = offset
        super().__init__(**kwargs)
"""

TOY_MODEL_CODE = '''
import re

import torch
from transformers import PreTrainedModel

from .configuration_toy_reward import ToyRewardConfig


class ToyRewardModel(PreTrainedModel):
    """Scores a conversation with the last number of its last turn, times ``scale``, plus ``offset``."""

    config_class = ToyRewardConfig

    def __init__(self, config):
        super().__init__(config)
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.conversations = []
        self.post_init()

    def _init_weights(self, module):
        pass

    def get_score(self, tokenizer, messages):
        self.conversations.append(messages)
        tokenizer.apply_chat_template(messages, tokenize=False)
        number = float(re.findall(r"-?[0-9]+(?:[.][0-9]+)?", messages[-1]["content"])[-1])
        return float(self.scale[0]) * number + self.config.offset
'''


@pytest.fixture
def remote_code_reward_model(tmp_path):
    """A remote-code reward model with ``get_score(tokenizer, messages)`` (the internlm2 interface), in a folder."""
    folder = tmp_path / "toy_reward"
    folder.mkdir()
    (folder / "configuration_toy_reward.py").write_text(TOY_CONFIG_CODE)
    (folder / "modeling_toy_reward.py").write_text(TOY_MODEL_CODE)
    config = {
        "model_type": "toy_reward",
        "architectures": ["ToyRewardModel"],
        "offset": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_toy_reward.ToyRewardConfig",
            "AutoModel": "modeling_toy_reward.ToyRewardModel",
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"scale": torch.ones(1)}, str(folder / "model.safetensors"))
    AutoTokenizer.from_pretrained(os.path.join(ROOT, "model")).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture
def classifier_reward_model(tmp_path):
    """A random ``Qwen3ForSequenceClassification`` with one label and the project tokenizer, saved to a folder."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=6400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_labels=1,
        pad_token_id=0,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = Qwen3ForSequenceClassification(config).eval()
    model.score.weight.data *= 2  # some scores of the test conversations beyond [-3, 3], some inside
    folder = str(tmp_path / "classifier_reward")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(os.path.join(ROOT, "model")).save_pretrained(folder)
    return folder


MESSAGES = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello!"},
        {"role": "user", "content": "1 + 1.5?"},
    ],
    [{"role": "user", "content": "Subtract."}],
    [{"role": "user", "content": "A long question about apples and pears, " * 3}],
    [],
]
RESPONSES = ["add the ones\n</think>\n\nThe answer is 5.", "It is 2.5", "t</think>-12.5", "7 apples", "9"]
# what the reward model must see: history folded into one user turn, the final answer after </think>
EXPECTED_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "The answer is 5."}],
    [
        {
            "role": "user",
            "content": "system: Be brief.\nuser: Hi\nassistant: <think>\nhm\n</think>\n\nHello!\n"
            "以上是对话历史。我的新问题是：\n1 + 1.5?",
        },
        {"role": "assistant", "content": "It is 2.5"},
    ],
    [{"role": "user", "content": "Subtract."}, {"role": "assistant", "content": "-12.5"}],
    [
        {"role": "user", "content": "A long question about apples and pears, " * 3},
        {"role": "assistant", "content": "7 apples"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "9"}],
]


# ----------------------------------------------------------------------------- conversation rebuilding
def test_reward_model_text_is_upstream_minimind_for_two_turns():
    # upstream LMForRewardModel.get_score: "\n".join(f"{role}: {content}") of the history, then
    # f"{history_text}\n以上是对话历史。我的新问题是：\n{last_query}"
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 1+1?"},
    ]
    assert reward_model_messages(messages, "The answer is 2.") == [
        {"role": "user", "content": "user: Hi\nassistant: Hello!\n以上是对话历史。我的新问题是：\nWhat is 1+1?"},
        {"role": "assistant", "content": "The answer is 2."},
    ]


def test_reward_model_messages_hand_written():
    for messages, response, expected in zip(MESSAGES, RESPONSES, EXPECTED_CONVERSATIONS):
        assert reward_model_messages(messages, response) == expected


@pytest.mark.parametrize("tokenizer_path", [os.path.join(ROOT, "model"), MINIMIND_TOKENIZER])
def test_messages_rebuilt_from_minimind_multi_turn_prompt(tokenizer_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello!"},
        {"role": "user", "content": "What is 1+1?"},
    ]
    for open_thinking in (True, False):
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, open_thinking=open_thinking
        )
        rebuilt = prompt_to_messages(prompt)
        assert [m["role"] for m in rebuilt] == ["system", "user", "assistant", "user"]
        assert rebuilt[0]["content"] == "Be brief." and rebuilt[3]["content"] == "What is 1+1?"
        assert rebuilt[2]["content"].endswith("</think>\n\nHello!")  # the template may keep or empty the thinking
        assert reward_model_messages(rebuilt, "<think>\n1+1=2\n</think>\n\nThe answer is 2.") == [
            {
                "role": "user",
                "content": f"system: Be brief.\nuser: Hi\nassistant: {rebuilt[2]['content']}\n"
                "以上是对话历史。我的新问题是：\nWhat is 1+1?",
            },
            {"role": "assistant", "content": "The answer is 2."},
        ]


# ----------------------------------------------------------------------------- kind (b): remote code, get_score
def test_remote_code_refused_without_flag(remote_code_reward_model):
    with pytest.raises(ValueError, match="--trust_remote_code"):
        LMForRewardModel(remote_code_reward_model)
    with pytest.raises(ValueError, match="--trust_remote_code"):
        read_reward_model_config(remote_code_reward_model, trust_remote_code=False)


def test_remote_code_refused_at_start_of_the_scripts(remote_code_reward_model, capsys):
    from trainer.train_grpo import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--reward_model_path", remote_code_reward_model])
    assert exit_info.value.code == 2
    assert "pass --trust_remote_code" in capsys.readouterr().err
    args = parse_args(["--reward_model_path", remote_code_reward_model, "--trust_remote_code"])
    assert args.trust_remote_code


def test_missing_reward_model_fails_at_start(tmp_path):
    result = run_main("train_ppo", ["--reward_model_path", str(tmp_path / "nope")])
    assert result.returncode == 2
    assert f"--reward_model_path {tmp_path / 'nope'} does not exist" in result.stderr
    assert "parameters" not in result.stdout  # failed before any model was built


def test_folder_without_config_fails_at_start(tmp_path, capsys):
    from trainer.train_ppo import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--reward_model_path", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"--reward_model_path {tmp_path}: no config.json" in capsys.readouterr().err
    assert parse_args(["--reward_model_path", "none"]).reward_model_path == "none"


def test_remote_code_scores_final_answers_and_clips(remote_code_reward_model):
    reward_model = LMForRewardModel(remote_code_reward_model, batch_size=2, trust_remote_code=True)
    scores = reward_model.get_scores(MESSAGES, RESPONSES)
    # last numbers of the final answers: 5, 2.5, -12.5, 7, 9 -> clipped to [-3, 3]
    assert scores == [3.0, 2.5, -3.0, 3.0, 3.0]
    assert reward_model.model.conversations == EXPECTED_CONVERSATIONS
    assert reward_model.get_score(MESSAGES[0], "The answer is -0.75") == -0.75


def test_calculate_rewards_adds_reward_model_scores(remote_code_reward_model):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 1?"}], tokenize=False, add_generation_prompt=True, open_thinking=True
    )
    reward_model = LMForRewardModel(remote_code_reward_model, trust_remote_code=True)
    responses = ["t" * 25 + "</think>The answer is 2.", "short 1"]
    parts = calculate_rewards([prompt, prompt], responses, ["2", "2"], reward_model, answer_reward_weight=2.0)
    assert parts["reward_model_scores"].tolist() == [2.0, 1.0]
    assert parts["rule_rewards"].tolist() == pytest.approx([1.75, -0.5])  # as in test_trainer_utils.py
    assert parts["rewards"].tolist() == pytest.approx([1.75 + 2.0 + 2.0, -0.5 + 1.0])
    assert reward_model.model.conversations[0] == [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "The answer is 2."},
    ]


# ----------------------------------------------------------------------------- kind (a): sequence classification
def plain_transformers_scores(folder, conversations):
    """Each conversation alone (no padding) through transformers' own loading and chat template."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            scores.append(model(input_ids=ids).logits[0, 0].item())
    return scores


def test_classifier_batched_equals_one_by_one_and_clips(classifier_reward_model):
    expected = plain_transformers_scores(classifier_reward_model, EXPECTED_CONVERSATIONS)
    assert any(abs(s) > 3 for s in expected) and any(abs(s) < 3 for s in expected), expected  # both cases occur
    clipped = [max(min(s, 3.0), -3.0) for s in expected]
    for batch_size in (1, 2, 5):
        reward_model = LMForRewardModel(classifier_reward_model, batch_size=batch_size)
        scores = reward_model.get_scores(MESSAGES, RESPONSES)
        assert max(abs(a - b) for a, b in zip(scores, clipped)) <= 1e-5


def test_classifier_dtype_and_device(classifier_reward_model):
    reward_model = LMForRewardModel(classifier_reward_model, device="cpu", dtype=torch.bfloat16)
    assert reward_model.model.dtype == torch.bfloat16
    assert next(reward_model.model.parameters()).device.type == "cpu"
    assert all(-3.0 <= s <= 3.0 for s in reward_model.get_scores(MESSAGES, RESPONSES))


def test_classifier_with_several_labels_is_refused(tmp_path):
    config = Qwen3Config(
        vocab_size=6400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_labels=2,
        pad_token_id=0,
    )
    folder = str(tmp_path / "two_labels")
    Qwen3ForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(os.path.join(ROOT, "model")).save_pretrained(folder)
    with pytest.raises(ValueError, match="one output label, this one has 2"):
        LMForRewardModel(folder)


# ----------------------------------------------------------------------------- train_reward.py
def test_bradley_terry_loss_hand_computed():
    chosen = torch.tensor([1.0, 0.0, 3.0])
    rejected = torch.tensor([0.0, 2.0, 3.0])
    # -log sigmoid(1) = log(1 + e^-1) = 0.313262, -log sigmoid(-2) = log(1 + e^2) = 2.126928, -log sigmoid(0) = log 2
    expected = (0.3132617 + 2.1269280 + 0.6931472) / 3
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected, abs=1e-6)
    assert pairwise_accuracy(chosen, rejected) == pytest.approx(1 / 3)  # the tie counts as wrong
    big = bradley_terry_loss(torch.tensor([0.0]), torch.tensor([200.0])).item()
    assert math.isfinite(big) and big == pytest.approx(200.0)


def test_reward_model_backbone_equals_minimind(tiny_weights):
    """The Qwen3 classifier built from MiniMind weights gives score . h_last of MiniMind's own backbone."""
    from model.model_minimind import MiniMindForCausalLM
    from trainer.infra.weights import build_config, load_weights

    save_dir, name = tiny_weights
    lm_config = build_config(64, 2, 0)
    minimind = MiniMindForCausalLM(lm_config).eval()
    load_weights(minimind, os.path.join(save_dir, f"{name}_64.pth"))
    reward_model = build_reward_model(lm_config, pad_token_id=0, weights_path=os.path.join(save_dir, f"{name}_64.pth"))
    assert reward_model.score.weight.abs().sum() == 0  # the head starts at zero
    torch.manual_seed(3)
    head = torch.randn(1, 64)
    reward_model.score.weight.data.copy_(head)
    reward_model.eval()
    input_ids = torch.randint(3, 6400, (2, 11))
    with torch.no_grad():
        hidden_states, _ = minimind.model(input_ids)  # [2, 11, 64]
        expected = hidden_states[:, -1] @ head[0]
        scores = reward_model(input_ids=input_ids).logits[:, 0]
    assert (scores - expected).abs().max() <= 1e-4
    assert expected.abs().max() > 0.1


def test_read_preference_pairs_both_formats_and_errors(tmp_path):
    assert parse_hh_transcript("\n\nHuman: Hi there\n\nAssistant: Hello.\n\nHuman: Bye\n\nAssistant: Bye!") == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!"},
    ]
    good_messages = {
        "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
    }
    good_hh = {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(good_messages) + "\n\n" + json.dumps(good_hh) + "\n")
    pairs = read_preference_pairs(str(path))
    assert pairs == [good_messages, good_messages]
    bad_rows = [
        ('{"chosen": [], "rejected": []}', "'chosen': expected a non-empty list"),
        ('{"chosen": "\\n\\nHuman: q\\n\\nAssistant: a"}', "expected an object with 'chosen' and 'rejected'"),
        (
            '{"chosen": "\\n\\nHuman: q\\n\\nAssistant: a", "rejected": "\\n\\nHuman: q"}',
            "'rejected': an HH-RLHF transcript ends with",
        ),
        ('{"chosen": [{"role": "user", "content": "q"}], "rejected": "x"}', "must be the assistant's, not 'user'"),
        ("{not json", "invalid JSON"),
    ]
    for row, message in bad_rows:
        path.write_text(json.dumps(good_hh) + "\n" + row + "\n")
        with pytest.raises(DataFormatError) as err:
            read_preference_pairs(str(path))
        assert f"{path}:2: " in str(err.value) and message in str(err.value)


def test_train_reward_smoke_saves_a_plain_transformers_folder(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    eval_path = tmp_path / "heldout.jsonl"
    with open(os.path.join(ROOT, "dataset", "reward_heldout.jsonl"), encoding="utf-8") as f:
        eval_path.write_text("".join(f.readlines()[:24]))
    out = tmp_path / "rm"
    run_dir = tmp_path / "run"
    result = run_script(
        [
            "trainer/train_reward.py",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--max_steps",
            "3",
            "--batch_size",
            "4",
            "--learning_rate",
            "1e-3",
            "--eval_interval",
            "2",
            "--eval_path",
            str(eval_path),
            "--save_path",
            str(out),
            "--run_dir",
            str(run_dir),
            "--save_dtype",
            "float32",
        ]
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 3/3" in result.stdout and "eval_acc" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)  # the zero head: every reward 0
    rows = rows[1:]
    assert "eval_accuracy" in rows[1] and "eval_accuracy" in rows[2] and "eval_accuracy" not in rows[0]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p or ".old" in p]
    model = AutoModelForSequenceClassification.from_pretrained(str(out))  # no custom code
    assert type(model).__name__ == "Qwen3ForSequenceClassification" and model.config.num_labels == 1
    # the saved model scores the held-out pairs as the run reported (through the RL scripts' scoring path)
    reward_model = LMForRewardModel(str(out), batch_size=5)
    pairs = read_preference_pairs(str(eval_path))
    chosen = reward_model.get_scores([p["chosen"][:-1] for p in pairs], [p["chosen"][-1]["content"] for p in pairs])
    rejected = reward_model.get_scores(
        [p["rejected"][:-1] for p in pairs], [p["rejected"][-1]["content"] for p in pairs]
    )
    assert all(abs(s) < 3 for s in chosen + rejected)  # nothing clipped, so the comparison is exact
    margins = [c - r for c, r in zip(chosen, rejected)]
    assert sum(margins) / len(margins) == pytest.approx(rows[2]["eval_margin"], abs=1e-4)
    assert sum(m > 0 for m in margins) / len(margins) == pytest.approx(rows[2]["eval_accuracy"])


def test_train_reward_bad_pair_names_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"chosen": "\\n\\nHuman: q\\n\\nAssistant: a", "rejected": "oops"}\n')
    result = run_script(
        [
            "trainer/train_reward.py",
            "--data_path",
            str(path),
            "--eval_path",
            "",
            "--from_weight",
            "none",
            "--save_path",
            str(tmp_path / "rm"),
        ]
        + TINY,
        timeout=120,
    )
    assert result.returncode != 0
    assert f"{path}:1: 'rejected': an HH-RLHF transcript starts with" in result.stderr


def test_train_reward_on_hh_rlhf(tmp_path):
    """A tiny reward model on real HH-RLHF transcripts (100 pairs, read from .jsonl.gz): every pair parses, the
    held-out loss is chance (log 2) before training and is evaluated on schedule, and the training loss falls as the
    model fits its 50 training pairs. Held-out figures on the whole split: docs/reward_model.md."""
    data_path = tmp_path / "hh.jsonl.gz"
    with open(HH_PATH, "rb") as f:
        data_path.write_bytes(gzip.compress(f.read()))
    run_dir = tmp_path / "run"
    result = run_script(
        [
            "trainer/train_reward.py",
            "--data_path",
            str(data_path),
            "--eval_path",
            "",
            "--eval_ratio",
            "0.5",
            "--from_weight",
            "none",
            "--max_steps",
            "100",
            "--epochs",
            "20",
            "--batch_size",
            "8",
            "--max_seq_len",
            "64",
            "--learning_rate",
            "1e-3",
            "--eval_interval",
            "50",
            "--save_path",
            str(tmp_path / "rm"),
            "--run_dir",
            str(run_dir),
        ]
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "50 training / 50 held-out pairs" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 50, 100]
    assert evaluated[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)  # chance, before training
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 and math.isfinite(r["eval_loss"]) for r in evaluated)
    assert "eval_acc" in result.stdout
    losses = [r["loss"] for r in rows if r["step"] > 0]
    assert len(losses) == 100 and losses[0] == pytest.approx(math.log(2), abs=1e-6)  # a zero head scores 0
    first, last = sum(losses[:25]) / 25, sum(losses[-25:]) / 25
    assert last < first - 0.1, (first, last)
