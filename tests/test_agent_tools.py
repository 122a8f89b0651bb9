"""The agent tools: the calculator against Python's arithmetic and against hostile text, upstream's six tools on
their canned data, execute_tool and parse_tool_calls on malformed calls, and what the module may touch."""

import ast
import json
import operator
import os
import random
import threading
import time

import pytest

from conftest import FIXTURES, MINIMIND_TOKENIZER, ROOT
from trainer.agent import tools as agent_tools
from trainer.agent.tools import (
    MAX_CALLS_PER_TURN,
    MAX_REPLY_CHARS,
    REGISTRY,
    ToolCall,
    ToolError,
    calculate,
    check_arguments,
    execute_call,
    execute_tool,
    parse_tool_calls,
    register_tool,
    tool_schemas,
)

HANG_GUARD_S = 1.0  # a loose bound: only catches a hang, says nothing about speed


def reply(name, arguments, **kwargs):
    """execute_tool's text, checked bounded, and the JSON object it holds."""
    text = execute_tool(name, arguments, **kwargs)
    assert isinstance(text, str) and len(text) <= MAX_REPLY_CHARS
    return json.loads(text)


def calc(expression):
    return reply("calculate_math", {"expression": expression})


# ----------------------------------------------------------------------------- the calculator against Python
OPERATORS = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
}


def random_tree(rng, depth):
    """A tree ("num", value) | ("neg", child) | (op, left, right): ints 0..999 and two-decimal floats as leaves,
    powers only of a small leaf to the exponent 0..3, so every value stays far inside the calculator's bounds."""
    if depth == 0 or rng.random() < 0.3:
        return ("num", rng.randint(0, 999) if rng.random() < 0.7 else round(rng.uniform(0, 100), 2))
    if rng.random() < 0.1:
        return ("neg", random_tree(rng, depth - 1))
    op = rng.choice(list(OPERATORS))
    if op == "**":
        base = rng.randint(0, 20) if rng.random() < 0.7 else round(rng.uniform(0, 5), 2)
        return ("**", ("num", base), ("num", rng.randint(0, 3)))
    return (op, random_tree(rng, depth - 1), random_tree(rng, depth - 1))


def render(tree, rng):
    if tree[0] == "num":
        return repr(tree[1])
    if tree[0] == "neg":
        return f"-({render(tree[1], rng)})"
    space = rng.choice(["", " "])
    return f"({render(tree[1], rng)}){space}{tree[0]}{space}({render(tree[2], rng)})"


def python_value(tree, seen):
    """The tree's value by Python's operators (ZeroDivisionError propagates); ``seen`` collects every value."""
    if tree[0] == "num":
        value = tree[1]
    elif tree[0] == "neg":
        value = -python_value(tree[1], seen)
    else:
        value = OPERATORS[tree[0]](python_value(tree[1], seen), python_value(tree[2], seen))
    seen.append(value)
    return value


def test_calculator_agrees_with_python_on_random_expressions():
    rng = random.Random(20260303)
    results, divisions_by_zero, operators_seen = 0, 0, set()
    while results + divisions_by_zero < 400:
        tree = random_tree(rng, 4)
        text = render(tree, rng)
        if len(text) > agent_tools.MAX_EXPRESSION_CHARS:
            continue
        seen = []
        try:
            expected = python_value(tree, seen)
        except ZeroDivisionError:
            assert calc(text) == {"error": "calculate_math: division by zero"}, text
            divisions_by_zero += 1
            continue
        assert all(abs(v) < 1e90 for v in seen) and not isinstance(expected, complex)
        assert calc(text) == {"result": str(expected)}, text
        operators_seen.update(op for op in OPERATORS if f"){op}(" in text.replace(" ", ""))
        results += 1
    assert divisions_by_zero > 0 and results > 300
    assert operators_seen == set(OPERATORS)


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("(45 + 27) * 3", "216"),  # the first example row of upstream's agent RL data: gt ["216"]
        ("1 + 2 * 3", "7"),
        ("2^10", "1024"),  # upstream's spellings
        ("3×4−5", "7"),
        ("（1+2）÷3", "1.0"),
        ("-2**2", "-4"),  # Python binds ** tighter than unary minus
        ("2**-1", "0.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % -3", "-2"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("1_000 * 3", "3000"),
        ("  12  ", "12"),
        ("--1", "1"),
        ("-" * 51 + "1", "-1"),  # 51 minus signs
        ("10**100", "1" + "0" * 100),  # the largest power inside the bound
        ("1" + "+1" * 99, "100"),  # 199 characters, a 100-term sum
        ("1 ** (10**100)", "1"),
        ("(-1) ** (10**100 - 1)", "-1"),  # an odd exponent
        ("0.5 ** 10**100", "0.0"),
        ("2 ** -(10**100)", "0.0"),
    ],
)
def test_calculator_hand_computed(expression, expected):
    assert calc(expression) == {"result": expected}


HOSTILE = [
    ("(1).__class__", "Attribute"),
    ("().__class__.__bases__[0].__subclasses__()", "not allowed"),
    ("__import__('os')", "Call"),
    ("__import__('os').system('echo pwned')", "Call"),
    ("__builtins__", "Name"),
    ("__class__", "Name"),
    ("lambda: 1", "Lambda"),
    ("(lambda: 9**9**9)()", "Call"),
    ("abs(-1)", "Call"),
    ("float('inf')", "Call"),
    ("nan", "Name"),
    ("inf", "Name"),
    ("[1][0]", "not allowed"),
    ("{}", "Dict"),
    ("(x := 1)", "NamedExpr"),
    ("1 if 1 else 0", "IfExp"),
    ("1 < 2", "Compare"),
    ("1 and 2", "BoolOp"),
    ("'a' * 10**8", "str constant"),
    ("f'{1}'", "JoinedStr"),
    ("True + 1", "bool constant"),
    ("1j", "complex constant"),
    ("~1", "Invert"),
    ("1 << 100000", "LShift"),
    ("2 @ 3", "MatMult"),
    ("9**9**9", "the power is too large"),
    ("10**10**10", "the power is too large"),
    ("2**10**100", "the power is too large"),
    ("(10**50)**3", "the power is too large"),
    ("99999999999**99999999", "the power is too large"),
    ("1.0000001 ** (10**12)", "the power is too large"),
    ("0.1 ** -(10**5)", "the power is too large"),
    ("10**101", "exceeds 10**100"),
    ("9" * 150, "exceeds 10**100"),
    ("10**60 * 10**60", "exceeds 10**100"),
    ("1e308 * 10", "exceeds 10**100"),
    ("1e999", "not a finite number"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 / 0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("1 % 0", "division by zero"),
    ("1.5 / 0.0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(" * 21 + "1" + ")" * 21, "nests more than 20 parentheses"),
    ("(" * 100 + "1" + ")" * 100, "longer than 200 characters"),
    ("[" * 30 + "1" + "]" * 30, "nests more than 20 parentheses"),
    ("-" * 150 + "1", "nests more than 100 operators"),
    ("1+" * 50_000 + "1", "longer than 200 characters"),  # 100 kB
    ("(" * 100_000, "longer than 200 characters"),
    ("# comment", "not an arithmetic expression"),
    ("()", "Tuple"),
    ("1 +", "not an arithmetic expression"),
    ("1\x002", "not an arithmetic expression"),
    ("import os", "not an arithmetic expression"),
    ("1; 2", "not an arithmetic expression"),
]


@pytest.mark.parametrize("expression, message", HOSTILE, ids=[repr(e[:30]) for e, _ in HOSTILE])
def test_hostile_expression_is_a_tool_error(expression, message):
    start = time.perf_counter()
    answer = calc(expression)
    assert time.perf_counter() - start < HANG_GUARD_S
    assert set(answer) == {"error"} and message in answer["error"], answer


def test_calculate_takes_text_only():
    with pytest.raises(ToolError):
        calculate(12)
    assert calculate("6*7") == 42


# ----------------------------------------------------------------------------- upstream's six tools
UPSTREAM_TOOLS = [
    "calculate_math",
    "unit_converter",
    "get_current_weather",
    "get_current_time",
    "get_exchange_rate",
    "translate_text",
]


def test_six_tools_in_upstreams_order_with_function_calling_schemas():
    schemas = tool_schemas()
    assert [s["function"]["name"] for s in schemas] == UPSTREAM_TOOLS
    for schema in schemas:
        parameters = schema["function"]["parameters"]
        assert schema["type"] == "function" and parameters["type"] == "object"
        assert set(parameters["required"]) <= set(parameters["properties"])
    required = {s["function"]["name"]: s["function"]["parameters"]["required"] for s in schemas}
    assert required == {
        "calculate_math": ["expression"],
        "unit_converter": ["value", "from_unit", "to_unit"],
        "get_current_weather": ["location"],
        "get_current_time": [],
        "get_exchange_rate": ["from_currency", "to_currency"],
        "translate_text": ["text", "target_language"],
    }
    assert tool_schemas(["translate_text"])[0]["function"]["name"] == "translate_text"
    with pytest.raises(ValueError, match="search_web"):
        tool_schemas(["calculate_math", "search_web"])
    tool_schemas()[0]["function"]["name"] = "changed"  # copies: the registry keeps its own
    assert tool_schemas()[0]["function"]["name"] == "calculate_math"


EXAMPLE_ROWS = os.path.join(FIXTURES, "minimind-agent-format", "agent_rl_format_example.jsonl")


def test_schemas_equal_the_ones_in_upstreams_data_rows():
    found = {}
    with open(EXAMPLE_ROWS, encoding="utf-8") as f:
        for line in f:
            system = json.loads(line)["conversations"][0]
            for schema in json.loads(system["tools"]):
                found[schema["function"]["name"]] = schema
    assert found and set(found) <= set(UPSTREAM_TOOLS)
    assert tool_schemas(list(found)) == list(found.values())


@pytest.mark.parametrize(
    "name, arguments, expected",
    [
        ("calculate_math", {"expression": "(45 + 27) * 3"}, {"result": "216"}),
        ("unit_converter", {"value": 10, "from_unit": "km", "to_unit": "miles"}, {"result": 6.2137}),  # 6.21371
        ("unit_converter", {"value": 2, "from_unit": "KG", "to_unit": "Pounds"}, {"result": 4.4092}),  # 4.40924
        ("unit_converter", {"value": 100, "from_unit": "celsius", "to_unit": "fahrenheit"}, {"result": 180.0}),
        ("unit_converter", {"value": 3, "from_unit": "km", "to_unit": "parsec"}, {"result": 3.0}),  # unknown: x1
        (
            "get_current_weather",
            {"location": "北京"},
            {"city": "北京", "temperature": "28°C", "humidity": "65%", "condition": "晴"},
        ),
        (
            "get_current_weather",
            {"location": " tokyo "},
            {"city": "Tokyo", "temperature": "12°C", "humidity": "65%", "condition": "晴"},
        ),
        (
            "get_current_weather",
            {"location": "Atlantis"},
            {"city": "Atlantis", "temperature": "22°C", "humidity": "65%", "condition": "晴"},
        ),
        ("get_current_time", {"timezone": "Asia/Tokyo"}, {"datetime": "2025-03-07 15:30:00", "timezone": "Asia/Tokyo"}),
        ("get_current_time", {}, {"datetime": "2025-03-07 14:30:00", "timezone": "Asia/Shanghai"}),
        ("get_current_time", None, {"datetime": "2025-03-07 14:30:00", "timezone": "Asia/Shanghai"}),
        (
            "get_current_time",
            {"timezone": "Mars/Olympus"},
            {"datetime": "2025-03-07 14:30:00", "timezone": "Mars/Olympus"},
        ),
        (
            "get_exchange_rate",
            {"from_currency": "USD", "to_currency": "CNY"},
            {"from": "USD", "to": "CNY", "rate": 7.21},
        ),
        (
            "get_exchange_rate",
            {"from_currency": "jpy", "to_currency": "cny"},
            {"from": "JPY", "to": "CNY", "rate": 0.048},
        ),
        (
            "get_exchange_rate",
            {"from_currency": "CNY", "to_currency": "USD"},
            {"from": "CNY", "to": "USD", "rate": 1.0},
        ),
        ("translate_text", {"text": "Happy birthday", "target_language": "chinese"}, {"translated_text": "生日快乐"}),
        ("translate_text", {"text": "你好世界", "target_language": "English"}, {"translated_text": "Hello World"}),
        ("translate_text", {"text": "Bonjour", "target_language": "chinese"}, {"translated_text": "Bonjour"}),
    ],
)
def test_each_tool_on_its_canned_data(name, arguments, expected):
    assert reply(name, arguments) == expected
    if arguments is not None:
        assert reply(name, json.dumps(arguments, ensure_ascii=False)) == expected  # arguments as a JSON string


@pytest.mark.parametrize(
    "name, arguments, message",
    [
        ("calculate_math", {}, 'missing the argument "expression"'),
        ("calculate_math", {"expression": 12}, "must be a string"),
        ("calculate_math", {"expression": "  "}, "must not be empty"),
        ("calculate_math", {"expression": "1+1", "precision": 3}, 'no argument "precision"'),
        ("unit_converter", {"value": "ten", "from_unit": "km", "to_unit": "miles"}, "must be a number"),
        ("unit_converter", {"value": True, "from_unit": "km", "to_unit": "miles"}, "must be a number"),
        ("unit_converter", {"value": None, "from_unit": "km", "to_unit": "miles"}, "must be a number"),
        ("unit_converter", {"value": float("nan"), "from_unit": "km", "to_unit": "miles"}, "finite number"),
        ("unit_converter", {"value": 10**400, "from_unit": "km", "to_unit": "miles"}, "finite number"),
        ("unit_converter", {"value": 1, "from_unit": "km"}, 'missing the argument "to_unit"'),
        ("get_current_weather", {"location": ""}, "must not be empty"),
        ("get_current_weather", {"city": "北京"}, 'no argument "city"'),
        ("get_current_weather", {"location": ["北京"]}, "must be a string"),
        ("get_current_time", {"timezone": 8}, "must be a string"),
        ("get_exchange_rate", {"from_currency": "USD"}, 'missing the argument "to_currency"'),
        ("translate_text", {"text": "Happy birthday"}, 'missing the argument "target_language"'),
        ("translate_text", {"text": "hi", "target_language": {"name": "chinese"}}, "must be a string"),
    ],
)
def test_each_tool_refuses_wrong_arguments(name, arguments, message):
    answer = reply(name, arguments)
    assert set(answer) == {"error"} and message in answer["error"], answer
    assert check_arguments(name, arguments) is not None


def test_check_arguments_accepts_upstreams_valid_calls():
    assert check_arguments("get_current_time", {}) is None
    assert check_arguments("unit_converter", {"value": 0, "from_unit": "km", "to_unit": "miles"}) is None
    assert check_arguments("calculate_math", {"expression": "1"}) is None
    assert "unknown tool" in check_arguments("search_web", {})
    assert "must be a JSON object" in check_arguments("calculate_math", ["1+1"])


# ----------------------------------------------------------------------------- execute_tool never raises
@pytest.mark.parametrize(
    "name, arguments, message",
    [
        ("search_web", {"query": "x"}, 'unknown tool "search_web"; tools: calculate_math, unit_converter'),
        ("", {}, "unknown tool"),
        ("x" * 10_000, {}, "unknown tool"),
        (None, {}, "the tool name must be a string"),
        (["calculate_math"], {}, "the tool name must be a string"),
        ("calculate_math", ["1+1"], "must be a JSON object, got list"),
        ("calculate_math", 42, "must be a JSON object, got int"),
        ("calculate_math", "not json", "are not valid JSON"),
        ("calculate_math", '["1+1"]', "must be a JSON object, got list"),
        ("calculate_math", '{"expression": "1+1"', "are not valid JSON"),
        ("calculate_math", "[" * 2000 + "]" * 2000, "longer than 2048 characters"),
        ("get_current_weather", {"location": "x" * 100_000, "extra" * 1000: 1}, "has no argument"),
    ],
)
def test_malformed_call_is_a_tool_error_the_model_reads(name, arguments, message):
    answer = reply(name, arguments)
    assert set(answer) == {"error"} and message in answer["error"], answer


def test_allowed_restricts_the_tools_of_a_conversation():
    assert reply("calculate_math", {"expression": "1+1"}, allowed=["calculate_math"]) == {"result": "2"}
    answer = reply("get_current_time", {}, allowed=["calculate_math", "translate_text"])
    assert answer == {"error": 'tool "get_current_time" is not offered here; offered: calculate_math, translate_text'}
    assert reply("search_web", {}, allowed=["calculate_math"]) == {
        "error": 'tool "search_web" is unknown; offered: calculate_math'
    }


@pytest.fixture
def registry():
    """REGISTRY, given back as it was after the test."""
    saved = dict(REGISTRY)
    yield REGISTRY
    REGISTRY.clear()
    REGISTRY.update(saved)


def schema(name, properties=None, required=None):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "test tool",
            "parameters": {"type": "object", "properties": properties or {}, "required": required or []},
        },
    }


def test_a_tool_is_added_in_a_few_lines(registry):
    @register_tool(
        schema("word_count", {"text": {"type": "string"}, "unique": {"type": "boolean", "default": False}}, ["text"])
    )
    def word_count(text, unique):
        words = text.split()
        return {"count": len(set(words)) if unique else len(words)}

    assert "word_count" in REGISTRY and tool_schemas()[-1]["function"]["name"] == "word_count"
    assert reply("word_count", {"text": "a b a"}) == {"count": 3}
    assert reply("word_count", {"text": "a b a", "unique": True}) == {"count": 2}
    assert "must be a boolean" in reply("word_count", {"text": "a", "unique": 1})["error"]


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "function"},
        {"type": "tool", "function": {"name": "x", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "", "parameters": {"type": "object", "properties": {}}}},
        {
            "type": "function",
            "function": {"name": "x", "parameters": {"type": "object", "properties": {}, "required": ["y"]}},
        },
        {"type": "function", "function": {"name": "x", "parameters": {"type": "array", "properties": {}}}},
        {"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {"a": "str"}}}},
        {
            "type": "function",
            "function": {"name": "x", "parameters": {"type": "object", "properties": {"a": {}}, "required": "a"}},
        },
        "calculate_math",
    ],
)
def test_register_tool_refuses_a_malformed_schema(bad, registry):
    with pytest.raises(ValueError):
        register_tool(bad)


def test_a_tool_that_raises_or_returns_no_json_is_a_tool_error(registry):
    register_tool(schema("crash"))(lambda: 1 / 0)
    register_tool(schema("refuse"))(lambda: (_ for _ in ()).throw(ToolError("no such record")))
    register_tool(schema("leave"))(lambda: exit(3))
    register_tool(schema("object"))(lambda: {"value": object()})
    register_tool(schema("not_finite"))(lambda: {"value": float("nan")})
    assert reply("crash", {}) == {"error": 'crash failed: ZeroDivisionError: "division by zero"'}
    assert reply("refuse", {}) == {"error": "refuse: no such record"}
    assert reply("leave", {})["error"].startswith("leave failed: SystemExit")
    assert reply("object", {}) == {"error": "object returned a value that is not JSON"}
    assert reply("not_finite", {}) == {"error": "not_finite returned a value that is not JSON"}


def test_a_tool_past_its_time_is_a_tool_error(registry):
    release = threading.Event()
    register_tool(schema("slow"))(lambda: release.wait(30) and {"late": True})
    start = time.perf_counter()
    try:
        answer = reply("slow", {}, timeout_s=0.2)
    finally:
        release.set()  # lets the abandoned thread finish
    assert answer == {"error": "slow did not answer within 0.2 s"}
    assert time.perf_counter() - start < 0.2 + HANG_GUARD_S


def test_every_reply_is_bounded(registry):
    register_tool(schema("long_text"))(lambda: "y" * 10_000)
    register_tool(schema("long_error"))(lambda: (_ for _ in ()).throw(ToolError('"\\' * 5_000)))
    text = execute_tool("long_text", {})
    assert len(text) == MAX_REPLY_CHARS and text.startswith("yyy") and text.endswith("(truncated)")
    answer = reply("long_error", {})  # the error stays whole JSON though every character is escaped
    assert answer["error"].startswith('long_error: "\\') and answer["error"].endswith("...")
    echo = execute_tool("translate_text", {"text": "z" * 5_000, "target_language": "chinese"})  # echoes the text
    assert len(echo) == MAX_REPLY_CHARS and echo.startswith('{"translated_text": "zzz')


# ----------------------------------------------------------------------------- parse_tool_calls
def test_parse_reads_upstreams_format_and_the_chat_templates_rendering():
    text = (
        '<think>\n\n</think>\n\nLet me compute.\n<tool_call>\n{"name": "calculate_math", '
        '"arguments": {"expression": "(45 + 27) * 3"}}\n</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert calls == [ToolCall("calculate_math", {"expression": "(45 + 27) * 3"}, None)]
    assert json.loads(execute_call(calls[0])) == {"result": "216"}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MINIMIND_TOKENIZER)
    sent = [
        {"name": "get_current_time", "arguments": {"timezone": "Asia/Tokyo"}},
        {"name": "translate_text", "arguments": {"text": "Happy birthday", "target_language": "chinese"}},
    ]
    answer = execute_tool(sent[0]["name"], sent[0]["arguments"])
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok", "tool_calls": sent},
            {"role": "tool", "content": answer},
        ],
        tokenize=False,
        tools=tool_schemas(),
    )
    assistant_turn = rendered.split("<|im_start|>assistant")[1]  # the system turn shows the format as a block too
    assert [(c.name, c.arguments, c.error) for c in parse_tool_calls(assistant_turn)] == [
        (s["name"], s["arguments"], None) for s in sent
    ]
    for schema_ in tool_schemas():  # the system turn lists the six schemas, one JSON line each
        assert "\n" + json.dumps(schema_, ensure_ascii=False) + "\n" in rendered
    assert "<tool_response>\n" + answer + "\n</tool_response>" in rendered


def test_parse_accepts_arguments_as_a_json_string_absent_or_null():
    text = (
        '<tool_call>{"name": "calculate_math", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
        '<tool_call>{"name": "get_current_time"}</tool_call>'
        '<tool_call>{"name": "get_current_time", "arguments": null}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculate_math", {"expression": "2*3"}, None),
        ToolCall("get_current_time", {}, None),
        ToolCall("get_current_time", {}, None),
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("<tool_call>{bad json}</tool_call>", "not valid JSON"),
        ("<tool_call></tool_call>", "not valid JSON"),
        ('<tool_call>["calculate_math"]</tool_call>', "must be a JSON object, got list"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name" string'),
        ('<tool_call>{"name": 3}</tool_call>', 'needs a "name" string'),
        ('<tool_call>{"name": ""}</tool_call>', 'needs a "name" string'),
        ('<tool_call>{"name": "calculate_math", "arguments": [1]}</tool_call>', "must be a JSON object, got list"),
        ('<tool_call>{"name": "calculate_math", "arguments": "{oops"}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "calculate_math", "arguments": 7}</tool_call>', "must be a JSON object, got int"),
        ('text <tool_call>{"name": "calculate_math"', "<tool_call> without </tool_call>"),
        (
            "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>",
            "",
        ),  # too deep or not an object: an error either way
        ('<tool_call>{"name": "x", "arguments": {"a": "' + "b" * 3000 + '"}}</tool_call>', "longer than 2048"),
    ],
)
def test_parse_turns_a_malformed_block_into_an_error_entry(text, message):
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and calls[0].name is None and calls[0].arguments is None
    assert message in calls[0].error
    answer = json.loads(execute_call(calls[0]))
    assert set(answer) == {"error"} and message in answer["error"]


def test_parse_without_calls_and_with_stray_tags():
    assert parse_tool_calls("") == []
    assert parse_tool_calls("The answer is 216.") == []
    assert parse_tool_calls("</tool_call> stray closing tag") == []
    good = '<tool_call>{"name": "get_current_time", "arguments": {}}</tool_call>'
    assert parse_tool_calls("</tool_call>" + good + "</tool_call>") == [ToolCall("get_current_time", {}, None)]
    with pytest.raises(TypeError):
        parse_tool_calls(None)


def test_parse_bounds_the_number_of_calls_and_the_text_read():
    good = '<tool_call>{"name": "get_current_time", "arguments": {}}</tool_call>'
    calls = parse_tool_calls(good * 50)
    assert calls[:MAX_CALLS_PER_TURN] == [ToolCall("get_current_time", {}, None)] * MAX_CALLS_PER_TURN
    assert len(calls) == MAX_CALLS_PER_TURN + 1 and "more than 8 tool calls" in calls[-1].error
    assert parse_tool_calls(" " * agent_tools.MAX_TEXT_CHARS + good) == []  # past the characters read
    start = time.perf_counter()
    for text in ("<tool_call>" * 100_000, "<tool_call></tool_call>" * 100_000, "<" * 1_000_000):
        assert len(parse_tool_calls(text)) <= MAX_CALLS_PER_TURN + 1
    assert time.perf_counter() - start < HANG_GUARD_S


# ----------------------------------------------------------------------------- what the module may touch
def test_the_module_evaluates_imports_and_opens_nothing():
    """Its imports are pure computation and it calls no builtin that runs code, imports, reflects or does I/O."""
    path = os.path.join(ROOT, "trainer", "agent", "tools.py")
    tree = ast.parse(open(path, encoding="utf-8").read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"ast", "copy", "json", "math", "operator", "threading", "typing"}
    forbidden = {
        "eval",
        "exec",
        "compile",
        "open",
        "__import__",
        "getattr",
        "setattr",
        "delattr",
        "globals",
        "locals",
        "vars",
        "input",
        "breakpoint",
        "exit",
        "quit",
    }
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert called & forbidden == set()
    parse_modes = [
        call for call in ast.walk(tree) if isinstance(call, ast.Call) and ast.unparse(call.func) == "ast.parse"
    ]
    assert [[k.value.value for k in call.keywords if k.arg == "mode"] for call in parse_modes] == [["eval"]]
