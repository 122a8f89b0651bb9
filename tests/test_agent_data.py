"""The agent task of scripts/make_demo_data.py: regenerating writes every bundled data file byte for byte; the RL
rows are upstream's agent format with the calculator's schema and answers Python's arithmetic agrees with; the
problems are hard (3-4 operands of 3-4 digits) and disjoint across files; the SFT calls are valid and their tool
turns are execute_tool's replies; tools in a data file are read, and bad ones named."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from dataset.lm_dataset import DataFormatError, conversation_tools, read_conversations_jsonl
from trainer.agent.rollout import conversation_tools as rollout_tools
from trainer.agent.tools import check_arguments, execute_tool, parse_tool_calls, tool_schemas

DATASET = os.path.join(ROOT, "dataset")
AGENT_FILES = {
    "agent_rl_train.jsonl": 2000,
    "agent_rl_val.jsonl": 500,
    "agent_rl_test.jsonl": 500,
    "agent_sft.jsonl": 2000,
}
EXPRESSION = re.compile(r"\d{3,4}( [-+*] \d{3,4}){2,3}")


def rows(name):
    with open(os.path.join(DATASET, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def expression_of(question):
    (match,) = [m.group(0) for m in EXPRESSION.finditer(question)]
    return match


def python_value(expression):
    """Python's own arithmetic on a generated expression (digits, spaces, + - * only: checked first)."""
    assert re.fullmatch(r"[\d +\-*]+", expression)
    return eval(expression, {"__builtins__": {}})  # noqa: S307 - the test's own data, whitelisted above


def test_regenerating_writes_every_bundled_file_byte_for_byte(tmp_path):
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "make_demo_data.py"), "--out_dir", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    written = sorted(os.listdir(tmp_path))
    assert set(AGENT_FILES) <= set(written) <= set(os.listdir(DATASET)) and len(written) == 11
    for name in written:
        with open(tmp_path / name, "rb") as new, open(os.path.join(DATASET, name), "rb") as bundled:
            assert new.read() == bundled.read(), name


@pytest.mark.parametrize("name", ["agent_rl_train.jsonl", "agent_rl_val.jsonl", "agent_rl_test.jsonl"])
def test_rl_rows_are_upstreams_agent_format_with_the_calculator(name):
    data = rows(name)
    assert len(data) == AGENT_FILES[name]
    for row in data:
        system, user, answer = row["conversations"]
        messages, tools = rollout_tools(row["conversations"][:2])
        assert system["role"] == "system" and json.loads(system["tools"]) == tool_schemas(["calculate_math"]) == tools
        assert [m["role"] for m in messages] == ["system", "user"] and answer["role"] == "assistant"
        expression = expression_of(user["content"])
        assert expression.count("*") <= 1 and row["gt"] == [str(python_value(expression))]
        assert int(row["gt"][0]) >= 0 and row["gt"][0] in answer["content"]


def test_problems_are_disjoint_across_the_agent_files():
    seen = {}
    for name in AGENT_FILES:
        questions = [next(t["content"] for t in row["conversations"] if t["role"] == "user") for row in rows(name)]
        expressions = {expression_of(question) for question in questions}
        assert len(expressions) == AGENT_FILES[name]
        for other, earlier in seen.items():
            assert not expressions & earlier, (name, other)
        seen[name] = expressions


def test_sft_calls_are_valid_and_the_tool_turns_are_execute_tools_replies():
    data = rows("agent_sft.jsonl")
    calling = 0
    for row in data:
        turns = row["conversations"]
        expression = expression_of(turns[1]["content"])
        answer = str(python_value(expression))
        assert turns[-1]["role"] == "assistant" and answer in turns[-1]["content"]
        if len(turns) == 3:
            continue
        calling += 1
        assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool", "assistant"]
        (call,) = parse_tool_calls(turns[2]["content"])
        assert call.error is None and call.name == "calculate_math" and call.arguments == {"expression": expression}
        assert check_arguments(call.name, call.arguments) is None
        assert turns[3]["content"] == execute_tool("calculate_math", {"expression": expression})
        assert json.loads(turns[3]["content"]) == {"result": answer}
    assert abs(calling / len(data) - 0.5) < 0.05


def test_tools_of_a_data_file_are_read_and_bad_ones_named(tmp_path):
    schemas = tool_schemas(["calculate_math"])
    good = {"conversations": [{"role": "system", "content": "s", "tools": schemas}, {"role": "user", "content": "q"}]}
    plain = {"conversations": [{"role": "user", "content": "q"}]}
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in (plain, good)) + "\n", encoding="utf-8")
    data = read_conversations_jsonl(str(path))
    assert (
        conversation_tools(data[1]["conversations"]) == schemas and conversation_tools(data[0]["conversations"]) is None
    )
    for turn, message in [
        ({"role": "system", "content": "s", "tools": "[{"}, "tools' are not JSON"),
        ({"role": "system", "content": "s", "tools": '{"a": 1}'}, "list of tool schemas"),
        ({"role": "user", "content": "q", "tools": "[]"}, "on a user turn"),
    ]:
        path.write_text(json.dumps({"conversations": [turn]}) + "\n", encoding="utf-8")
        with pytest.raises(DataFormatError, match=rf"rows.jsonl:1: .*{message}"):
            read_conversations_jsonl(str(path))


def test_copy_mix_holds_every_agent_row_and_trace_rows_behind_other_turns():
    """scripts/agent_copy_study/make_copy_mix.py (docs/agent.md): the agent SFT rows unchanged, and each other
    row ends with one of sft_data's column-trace conversations, behind whole sft_data conversations and at most the
    agent rows' tools."""
    import random
    from scripts.agent_copy_study.make_copy_mix import copy_mix

    sft = [json.loads(line) for line in open(os.path.join(ROOT, "dataset", "sft_data.jsonl"), encoding="utf-8")]
    agent = [json.loads(line) for line in open(os.path.join(ROOT, "dataset", "agent_sft.jsonl"), encoding="utf-8")]
    rows = copy_mix(sft, agent, 300, random.Random(0))
    agent_dumped = sorted(json.dumps(row, sort_keys=True) for row in agent)
    agent_set = set(agent_dumped)
    in_agent = [json.dumps(row, sort_keys=True) in agent_set for row in rows]
    assert sorted(json.dumps(row, sort_keys=True) for row, kept in zip(rows, in_agent) if kept) == agent_dumped
    conversations = {json.dumps(row["conversations"], sort_keys=True) for row in sft}
    agent_tools = {turn["tools"] for row in agent for turn in row["conversations"] if turn.get("tools")}
    mixed = [row["conversations"] for row, kept in zip(rows, in_agent) if not kept]
    assert len(mixed) == 300 and any(turns[0]["role"] == "system" for turns in mixed)
    for turns in mixed:
        if turns[0]["role"] == "system":
            assert turns[0]["tools"] in agent_tools
            turns = turns[1:]
        assert ", ones first" in turns[-1]["content"] and json.dumps(turns[-2:], sort_keys=True) in conversations
        assert len(turns) % 2 == 0 and all(
            json.dumps(turns[i : i + 2], sort_keys=True) in conversations for i in range(0, len(turns), 2)
        )


def test_agent_copy_sft_rows_call_rightly_and_hold_no_rl_problem(tmp_path):
    """scripts/make_agent_sft.py (docs/agent.md): every call is a valid calculate_math call on the expression of the
    question it answers, its tool turn is execute_tool's reply and Python's value, the answer carries that value, no
    expression of the RL files appears, some rows carry the schema and some do not, and a seed writes one file."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from make_agent_sft import main as make_agent_sft

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    make_agent_sft(["--num_rows", "200", "--out", str(first)])
    make_agent_sft(["--num_rows", "200", "--out", str(second)])
    assert first.read_bytes() == second.read_bytes()
    held = {
        expression_of(next(t["content"] for t in row["conversations"] if t["role"] == "user"))
        for name in ("agent_rl_train.jsonl", "agent_rl_val.jsonl", "agent_rl_test.jsonl")
        for row in rows(name)
    }
    data = [json.loads(line) for line in first.read_text(encoding="utf-8").splitlines()]
    assert len(data) == 200
    with_schema = calls = answered_at_once = 0
    for row in data:
        turns = row["conversations"]
        if turns[0].get("tools"):
            with_schema += 1
            assert json.loads(turns[0]["tools"]) == tool_schemas(["calculate_math"])
        problem_starts = [i for i, t in enumerate(turns) if t["role"] == "user" and EXPRESSION.search(t["content"])]
        assert problem_starts
        for start in problem_starts:
            expression = expression_of(turns[start]["content"])
            assert expression not in held
            value = str(python_value(expression))
            if turns[start + 1]["content"].startswith("<tool_call>"):
                calls += 1
                (call,) = parse_tool_calls(turns[start + 1]["content"])
                assert call.error is None and call.name == "calculate_math"
                assert (
                    call.arguments == {"expression": expression} and check_arguments(call.name, call.arguments) is None
                )
                assert turns[start + 2]["role"] == "tool"
                assert turns[start + 2]["content"] == execute_tool("calculate_math", call.arguments)
                assert json.loads(turns[start + 2]["content"]) == {"result": value}
                final = turns[start + 3]
            else:
                answered_at_once += 1
                final = turns[start + 1]
            assert final["role"] == "assistant" and value in final["content"]
    assert 0 < with_schema < 200 and calls > answered_at_once > 0
