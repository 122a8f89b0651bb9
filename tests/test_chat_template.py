"""The bundled chat template (model/tokenizer_config.json): conversations without tools render exactly as the
think-only template the bundled checkpoints and the chapter's numbers were made with (copied below); conversations
with tools, tool calls and tool replies render as upstream MiniMind's template (tests/fixtures) renders them; the
tool markers are spelled by the bundled vocabulary; SFT and agent_rollout train the model's turns of an agent row and
nothing else."""

import json
import os

import pytest
from transformers import AutoTokenizer

from conftest import MINIMIND_TOKENIZER, ROOT
from test_agent_rollout import ScriptedPolicy, observations, turn_ids
from dataset.lm_dataset import SFTDataset, conversation_tools, prompt_turns, read_conversations_jsonl
from trainer.agent.rollout import agent_rollout
from trainer.agent.tools import execute_tool, tool_schemas
from trainer.train_tokenizer import CHAT_TEMPLATE

# model/tokenizer_config.json's chat_template at commit 4567281 (git show 4567281:model/tokenizer_config.json)
THINK_ONLY_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- set reasoning = '' %}{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0]"
    ".split('<think>')[-1].strip('\\n') %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if open_thinking is defined and open_thinking is true %}{{- '<think>\\n' }}{%- else %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
TOOL_MARKERS = ["<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DATASET = os.path.join(ROOT, "dataset")


@pytest.fixture(scope="module")
def bundled():
    return AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))


@pytest.fixture(scope="module")
def with_template(bundled):
    """The bundled tokenizer with another chat template: the think-only one or upstream's."""

    def make(template):
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
        tokenizer.chat_template = template
        return tokenizer

    return make


def conversations(name, limit=None):
    rows = read_conversations_jsonl(os.path.join(DATASET, name))
    return [row["conversations"] for row in rows.select(range(min(limit or len(rows), len(rows))))]


def without_tools_key(turns):
    return [{key: value for key, value in turn.items() if key != "tools"} for turn in turns]


def test_the_tokenizer_trainer_writes_the_bundled_template(bundled):
    with open(os.path.join(ROOT, "model", "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["chat_template"] == CHAT_TEMPLATE == bundled.chat_template


def test_conversations_without_tools_render_as_the_think_only_template(bundled, with_template):
    old = with_template(THINK_ONLY_TEMPLATE)
    prompts = [prompt_turns(turns) for turns in conversations("rlaif_val.jsonl")]
    assert len(prompts) == 500
    for turns in prompts:
        for thinking in (True, False):
            options = dict(tokenize=False, add_generation_prompt=True, open_thinking=thinking)
            assert bundled.apply_chat_template(turns, **options) == old.apply_chat_template(turns, **options)
    system = {"role": "system", "content": "You are a careful calculator."}
    full = conversations("sft_data.jsonl", 300) + conversations("rlaif_train.jsonl", 50)
    with open(os.path.join(DATASET, "reward_heldout.jsonl"), encoding="utf-8") as f:
        pairs = [json.loads(line) for line in f][:50]
    full += [pair[side] for pair in pairs for side in ("chosen", "rejected")]
    full += [[system] + turns + [system, turns[0]] for turns in full[:20]]
    for turns in full:
        assert bundled.apply_chat_template(turns, tokenize=False) == old.apply_chat_template(turns, tokenize=False)
        assert bundled.apply_chat_template(turns, tokenize=False, tools=None) == old.apply_chat_template(
            turns, tokenize=False
        )


def test_sft_tokens_of_rows_without_tools_are_the_think_only_templates(bundled, with_template):
    old = with_template(THINK_ONLY_TEMPLATE)
    dataset = SFTDataset(os.path.join(DATASET, "sft_data.jsonl"), bundled, max_length=256)
    for index in range(0, 12000, 600):
        text = old.apply_chat_template(dataset.data[index]["conversations"], tokenize=False)
        assert dataset[index][0].tolist() == old(text, add_special_tokens=False)["input_ids"][:256]


def tool_conversation():
    """Two tools offered; a call in the text, a call in ``tool_calls`` (dict and string arguments), two replies."""
    call = '<tool_call>\n{"name": "calculate_math", "arguments": {"expression": "4212 * 3306 - 1910"}}\n</tool_call>'
    return [
        {"role": "system", "content": "你是一个有用的助手。"},
        {"role": "user", "content": "4212 * 3306 - 1910 是多少？现在几点？"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": execute_tool("calculate_math", {"expression": "4212 * 3306 - 1910"})},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_current_time", "arguments": {"timezone": "Asia/Tokyo"}}},
                {"name": "calculate_math", "arguments": '{"expression": "1 + 2"}'},
            ],
        },
        {"role": "tool", "content": execute_tool("get_current_time", {"timezone": "Asia/Tokyo"})},
        {"role": "tool", "content": execute_tool("calculate_math", {"expression": "1 + 2"})},
        {"role": "assistant", "content": "<think>\n看结果\n</think>\n\n答案是 13923382。"},
    ]


def test_tool_conversations_render_as_upstreams_template(bundled, with_template):
    with open(os.path.join(MINIMIND_TOKENIZER, "tokenizer_config.json"), encoding="utf-8") as f:
        upstream = with_template(json.load(f)["chat_template"])
    cases = [(tool_conversation(), tool_schemas(["calculate_math", "get_current_time"]))]
    cases += [(turns, conversation_tools(turns)) for turns in conversations("agent_sft.jsonl", 40)]
    cases += [(prompt_turns(turns), conversation_tools(turns)) for turns in conversations("agent_rl_val.jsonl", 20)]
    for turns, tools in cases:
        turns = without_tools_key(turns)
        for generation_prompt in (True, False):
            options = dict(tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
            assert bundled.apply_chat_template(turns, **options) == upstream.apply_chat_template(turns, **options)
    rendered = bundled.apply_chat_template(cases[0][0], tools=cases[0][1], tokenize=False)
    assert rendered.count("<tool_response>") == 3 and rendered.count("<|im_start|>user\n<tool_response>") == 2
    assert '"name": "calculate_math"' in rendered.split("\n</tools>")[0]


def test_tool_markers_are_spelled_by_the_bundled_vocabulary(bundled):
    vocabulary = set(bundled.get_vocab())
    for marker in TOOL_MARKERS:
        tokens = bundled.tokenize(marker)
        assert all(token in vocabulary for token in tokens) and bundled.unk_token not in tokens
        assert bundled.decode(bundled.convert_tokens_to_ids(tokens)) == marker
    text = bundled.apply_chat_template(tool_conversation(), tools=tool_schemas(["calculate_math"]), tokenize=False)
    ids = bundled(text, add_special_tokens=False)["input_ids"]
    assert bundled.decode(ids) == text and max(ids) < len(bundled)
    assert ids.count(bundled.convert_tokens_to_ids("<|im_end|>")) == text.count("<|im_end|>")


def test_sft_trains_the_model_turns_of_an_agent_row_only(bundled):
    path = os.path.join(DATASET, "agent_sft.jsonl")
    dataset = SFTDataset(path, bundled, max_length=2048)
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line)["conversations"] for line in f]
    index = next(i for i, turns in enumerate(rows) if any(turn["role"] == "tool" for turn in turns))
    input_ids, labels = dataset[index]
    model_turns = [turn["content"] for turn in rows[index] if turn["role"] == "assistant"]
    assert bundled.decode(input_ids[labels != -100]) == "".join(
        f"<think>\n\n</think>\n\n{content}<|im_end|>" for content in model_turns
    )
    untrained = bundled.decode(input_ids[labels == -100])
    tool_reply = next(turn["content"] for turn in rows[index] if turn["role"] == "tool")
    assert f"<tool_response>\n{tool_reply}\n</tool_response>" in untrained and "# Tools" in untrained


def test_a_two_turn_rollout_on_the_bundled_tokenizer_trains_the_model_turns_only(policy, bundled):
    turns = conversations("agent_sft.jsonl", 10)
    row = next(t for t in turns if len(t) == 5)  # system, user, call, tool reply, answer
    call, reply, answer = row[2]["content"], row[3]["content"], row[4]["content"]
    script = [[turn_ids(bundled, call)], [turn_ids(bundled, answer)]]
    result = agent_rollout(
        ScriptedPolicy(policy, script), bundled, [row[:2]], 1, max_new_tokens=128, max_total_len=1024
    )
    assert result.metrics == {"prefix_mismatches": 0, "prompts_cut": 0, "length_stops": 0}
    assert result.num_valid_calls.tolist() == [1] and result.turn_texts == [[call, answer]]
    trained = result.completion_ids[0][result.completion_mask[0].bool()]
    assert bundled.decode(trained) == f"{call}<|im_end|>{answer}<|im_end|>"
    assert observations(bundled, result, 0) == [
        f"\n<|im_start|>user\n<tool_response>\n{reply}\n</tool_response>"
        f"<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ]
