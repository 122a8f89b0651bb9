"""Tools for agent RL that no model output can escape.

Upstream MiniMind's six tools (``trainer/train_agent.py`` of jingyaogong/minimind: names, OpenAI function-calling
schemas, argument checks, canned data), a calculator that parses arithmetic itself, ``parse_tool_calls`` for the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks a model writes, and ``execute_tool``, which
turns any call, well formed or not, into the text of a tool message (a JSON object, at most MAX_REPLY_CHARS).
Model text only ever meets dictionary lookups, ``json.loads`` and the calculator's whitelist over ``ast`` nodes:
nothing here evaluates, imports, opens a file, a socket or a process.

Adding a tool: write a plain function whose keyword arguments are the schema's properties, returning a
JSON-serialisable value (or raising ToolError with a message for the model), and decorate it with
``@register_tool(schema)``. docs/agent_tools.md lists the tools and the bounds.
"""

import ast
import copy
import json
import math
import operator
import threading
from typing import Callable, NamedTuple

MAX_REPLY_CHARS = 512  # every tool message, replies and errors alike
TOOL_TIMEOUT_S = 1.0  # upstream's SIGALRM budget per call
MAX_TEXT_CHARS = 32768  # parse_tool_calls reads this many characters of a turn
MAX_CALLS_PER_TURN = 8
MAX_CALL_CHARS = 2048  # the JSON inside one <tool_call> block
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

# calculator bounds: they hold for any input, 9**9**9 included
MAX_EXPRESSION_CHARS = 200
MAX_PAREN_DEPTH = 20
MAX_NODE_DEPTH = 100  # operators nested in the parsed tree (a 100-term sum is 99 deep)
MAX_DIGITS = 100
MAX_ABS = 10**MAX_DIGITS  # every operand, intermediate value and result: |x| <= 10**100


class ToolError(Exception):
    """A refusal whose message the model reads in the tool message (``{"error": message}``)."""


class ToolCall(NamedTuple):
    """One ``<tool_call>`` block: ``name`` and ``arguments`` when it parsed, else ``error`` (the others None)."""

    name: str | None
    arguments: dict | None
    error: str | None


class Tool(NamedTuple):
    """A registered tool: the plain function and its OpenAI function-calling schema."""

    function: Callable
    schema: dict


REGISTRY: dict[str, Tool] = {}  # tool name -> Tool, in registration order


def register_tool(schema: dict) -> Callable:
    """Decorator that registers ``function`` under ``schema["function"]["name"]``.

    ``schema`` is in OpenAI function-calling form: ``{"type": "function", "function": {"name", "description",
    "parameters": {"type": "object", "properties": {...}, "required": [...]}}}``; a property may carry a
    ``type`` (string, number, integer, boolean, object, array) and a ``default``. The function is called with the
    checked arguments as keywords, defaults filled in. Raises ValueError on a malformed schema.
    """
    spec = schema.get("function") if isinstance(schema, dict) and schema.get("type") == "function" else None
    parameters = spec.get("parameters") if isinstance(spec, dict) else None
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    required = parameters.get("required", []) if isinstance(parameters, dict) else None
    if (
        not isinstance(properties, dict)
        or parameters.get("type") != "object"
        or not isinstance(spec.get("name"), str)
        or not spec["name"]
        or not all(isinstance(p, dict) for p in properties.values())
        or not isinstance(required, list)
        or not set(required) <= set(properties)
    ):
        raise ValueError(f"not an OpenAI function-calling schema with parameters of type object: {schema!r}")

    def register(function: Callable) -> Callable:
        REGISTRY[spec["name"]] = Tool(function, copy.deepcopy(schema))
        return function

    return register


def tool_schemas(names=None) -> list:
    """Copies of the registered schemas (all of them, or those of ``names`` in that order), the list a chat
    template takes as ``tools=``. Raises ValueError naming any name that is not registered."""
    names = list(REGISTRY) if names is None else list(names)
    unknown = [name for name in names if name not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; registered: {sorted(REGISTRY)}")
    return [copy.deepcopy(REGISTRY[name].schema) for name in names]


# ----------------------------------------------------------------------------- replies
def _show(value, limit: int = 40) -> str:
    """A short printable form of model text, for error messages."""
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _bounded(text: str, marker: str = " ...(truncated)") -> str:
    return text if len(text) <= MAX_REPLY_CHARS else text[: MAX_REPLY_CHARS - len(marker)] + marker


def tool_error(message: str) -> str:
    """The tool message of a failed call: ``{"error": message}`` as JSON, the message cut so that the JSON text
    stays whole and at most MAX_REPLY_CHARS characters long."""
    text, keep = json.dumps({"error": message}, ensure_ascii=False), MAX_REPLY_CHARS - 20
    while len(text) > MAX_REPLY_CHARS:  # escaped characters take more room: halve until it fits
        message, keep = message[:keep] + "...", keep // 2
        text = json.dumps({"error": message}, ensure_ascii=False)
    return text


# ----------------------------------------------------------------------------- argument checks
_JSON_TYPES = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def check_arguments(name, arguments) -> str | None:
    """None when ``arguments`` suit the registered tool ``name``, else the reason as text.

    The checks follow the schema: a dict; no argument outside ``properties``; every ``required`` one present;
    strings non-empty after stripping (upstream's truthiness checks); numbers int or float, never bool, finite,
    |x| <= MAX_ABS.
    """
    tool = REGISTRY.get(name) if isinstance(name, str) else None
    if tool is None:
        return f"unknown tool {_show(name)}; tools: {', '.join(REGISTRY)}"
    if not isinstance(arguments, dict):
        return f"arguments of {name} must be a JSON object, got {type(arguments).__name__}"
    parameters = tool.schema["function"]["parameters"]
    properties = parameters["properties"]
    for key in arguments:
        if key not in properties:
            return f"{name} has no argument {_show(key)}; arguments: {', '.join(properties) or 'none'}"
    for key in parameters.get("required", []):
        if key not in arguments:
            return f"{name} is missing the argument {_show(key)}"
    for key, value in arguments.items():
        kind = properties[key].get("type")
        allowed = _JSON_TYPES.get(kind)
        is_bool = isinstance(value, bool)
        if allowed and (not isinstance(value, allowed) or (is_bool and kind != "boolean")):
            return f"argument {key} of {name} must be a {kind}, got {_show(value)}"
        if kind == "string" and not value.strip():
            return f"argument {key} of {name} must not be empty"
        if kind in ("number", "integer") and (
            not (isinstance(value, int) or math.isfinite(value)) or abs(value) > MAX_ABS
        ):
            return f"argument {key} of {name} must be a finite number of magnitude at most 10**{MAX_DIGITS}"
    return None


# ----------------------------------------------------------------------------- running a call
def _run_with_time_limit(function: Callable, arguments: dict, timeout_s: float):
    """``function(**arguments)`` in a daemon thread; ("value", v), ("raised", exception) or ("timeout", None).
    A thread that overruns is left to finish on its own (Python cannot stop one); the call returns at the limit."""
    outcome = {}

    def target():
        try:
            outcome["value"] = function(**arguments)
        except BaseException as error:  # every failure, SystemExit included, becomes a tool error
            outcome["raised"] = error

    worker = threading.Thread(target=target, daemon=True, name="agent-tool")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return "timeout", None
    return ("raised", outcome["raised"]) if "raised" in outcome else ("value", outcome.get("value"))


def execute_tool(name, arguments, allowed=None, timeout_s: float = TOOL_TIMEOUT_S) -> str:
    """The text of the tool message answering the call ``name(arguments)``; never raises on model input.

    name: the tool's name. arguments: a dict, a JSON string of one, or None (no arguments). allowed: the names
    offered in the conversation (None: every registered tool). A call that is malformed, unknown, not offered,
    fails check_arguments, raises, returns something not JSON-serialisable or runs past ``timeout_s`` seconds
    gives ``{"error": reason}``; a good call gives the tool's result (a str as is, anything else as JSON with
    ``ensure_ascii=False``, upstream's form). Either is cut to MAX_REPLY_CHARS.
    """
    if not isinstance(name, str):
        return tool_error(f"the tool name must be a string, got {_show(name)}")
    if allowed is not None and name not in allowed:
        known = "is not offered here" if name in REGISTRY else "is unknown"
        return tool_error(f"tool {_show(name)} {known}; offered: {', '.join(map(str, allowed)) or 'none'}")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        arguments, error = _json_object(arguments, f"the arguments of {_show(name)}")
        if error:
            return tool_error(error)
    problem = check_arguments(name, arguments)
    if problem:
        return tool_error(problem)
    tool = REGISTRY[name]
    properties = tool.schema["function"]["parameters"]["properties"]
    keywords = {key: spec["default"] for key, spec in properties.items() if "default" in spec}
    keywords.update(arguments)
    status, value = _run_with_time_limit(tool.function, keywords, timeout_s)
    if status == "timeout":
        return tool_error(f"{name} did not answer within {timeout_s:g} s")
    if status == "raised":
        if isinstance(value, ToolError):
            return tool_error(f"{name}: {value}")
        return tool_error(f"{name} failed: {type(value).__name__}: {_show(str(value), 120)}")
    if isinstance(value, str):
        return _bounded(value)
    try:
        return _bounded(json.dumps(value, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return tool_error(f"{name} returned a value that is not JSON")


def execute_call(call: ToolCall, allowed=None, timeout_s: float = TOOL_TIMEOUT_S) -> str:
    """The tool message for one entry of parse_tool_calls: its parse error, or execute_tool's reply."""
    if call.error is not None:
        return tool_error(call.error)
    return execute_tool(call.name, call.arguments, allowed=allowed, timeout_s=timeout_s)


# ----------------------------------------------------------------------------- parsing a model's turn
def _json_object(text: str, what: str):
    """(dict, None) when ``text`` is a JSON object of at most MAX_CALL_CHARS characters, else (None, reason)."""
    if len(text) > MAX_CALL_CHARS:
        return None, f"{what} are longer than {MAX_CALL_CHARS} characters"
    try:
        value = json.loads(text)
    except ValueError as error:
        return None, f"{what} are not valid JSON ({_show(str(error), 80)})"
    except RecursionError:
        return None, f"{what} are nested too deeply"
    if not isinstance(value, dict):
        return None, f"{what} must be a JSON object, got {type(value).__name__}"
    return value, None


def parse_tool_calls(text: str) -> list:
    """The ``<tool_call>...</tool_call>`` blocks of a model's turn, as ToolCall entries in order.

    text: the turn as decoded text (a str, else TypeError); only its first MAX_TEXT_CHARS characters are read.
    Each block holds ``{"name": str, "arguments": object | JSON string | absent}`` (upstream's format); a block
    that is not that, an opening tag without its closing tag, or a block past MAX_CALLS_PER_TURN gives one entry
    with ``error`` set. A turn without ``<tool_call>`` gives []. Parsing is json.loads only.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls takes the decoded text of a turn, got {type(text).__name__}")
    text = text[:MAX_TEXT_CHARS]
    calls, position = [], 0
    while True:
        start = text.find(TOOL_CALL_OPEN, position)
        if start < 0:
            return calls
        if len(calls) == MAX_CALLS_PER_TURN:
            calls.append(
                ToolCall(
                    None,
                    None,
                    f"more than {MAX_CALLS_PER_TURN} tool calls in one turn; "
                    f"the calls past the {MAX_CALLS_PER_TURN}th are ignored",
                )
            )
            return calls
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:
            calls.append(ToolCall(None, None, f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}"))
            return calls
        calls.append(_parse_block(text[start + len(TOOL_CALL_OPEN) : end].strip()))
        position = end + len(TOOL_CALL_CLOSE)


def conversation_tools(messages):
    """(messages without the ``tools`` key, tool schemas or None) of one upstream-format conversation.

    messages: role/content dicts; a system turn may carry ``tools``, a JSON string (upstream's rows) or a list of
    OpenAI function schemas, rendered as given. Raises ValueError when ``tools`` is not JSON, not a list of
    function schemas, or names a tool that is not registered in ``REGISTRY``.
    """
    tools = None
    cleaned = [{key: value for key, value in message.items() if key != "tools"} for message in messages]
    system = [m for m in messages if m.get("role") == "system" and m.get("tools")]
    if system:
        tools = system[0]["tools"]
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except ValueError as error:
                raise ValueError(f"the system turn's tools are not JSON ({error}): {tools[:80]!r}") from error
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools
        ):
            raise ValueError(f"the system turn's tools must be a list of function schemas, got {str(tools)[:80]!r}")
        unknown = [t["function"]["name"] for t in tools if t["function"]["name"] not in REGISTRY]
        if unknown:
            raise ValueError(f"unknown tools {unknown} in the data; registered: {sorted(REGISTRY)}")
    return cleaned, tools


def count_valid_calls(calls, allowed) -> int:
    """How many of ``calls`` (``parse_tool_calls``' entries of one turn) parsed, name a tool of ``allowed`` and have
    arguments that pass ``check_arguments``: the valid calls of agent RL's reward and metrics."""
    return sum(
        call.error is None and call.name in allowed and check_arguments(call.name, call.arguments) is None
        for call in calls
    )


def _parse_block(body: str) -> ToolCall:
    call, error = _json_object(body, "the tool call's contents")
    if error:
        return ToolCall(None, None, f'{error}; write {{"name": ..., "arguments": {{...}}}}')
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, f'a tool call needs a "name" string, got {_show(name)}')
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        arguments, error = _json_object(arguments, f"the arguments of {_show(name)}")
        if error:
            return ToolCall(None, None, error)
    if not isinstance(arguments, dict):
        return ToolCall(
            None, None, f"the arguments of {_show(name)} must be a JSON object, got {type(arguments).__name__}"
        )
    return ToolCall(name, arguments, None)


# ----------------------------------------------------------------------------- the calculator
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# spellings upstream's calculator accepts, mapped to Python's operators
_SPELLINGS = {"^": "**", "×": "*", "÷": "/", "−": "-", "（": "(", "）": ")"}
_ALLOWED = "numbers, + - * / // % ** (also ^ × ÷) and parentheses"


def _checked(value):
    """``value`` if it is a real, finite number with |value| <= MAX_ABS, else ToolError."""
    if type(value) not in (int, float):
        raise ToolError("a value is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("a value is not a finite number")
    if abs(value) > MAX_ABS:
        raise ToolError(f"a value exceeds 10**{MAX_DIGITS} in magnitude")
    return value


def _check_power(base, exponent) -> None:
    """Refuse ``base ** exponent`` when its magnitude, estimated as exponent * log10|base|, is past the bound;
    what passes has at most MAX_DIGITS + 1 digits, so computing it is cheap and _checked decides exactly."""
    if base == 0:
        return
    digits = exponent * math.log10(abs(base))
    if digits > MAX_DIGITS + 1:
        raise ToolError(f"the power is too large (about 10**{digits:.3g}; the bound is 10**{MAX_DIGITS})")


def _evaluate(node, depth: int):
    if depth > MAX_NODE_DEPTH:
        raise ToolError(f"the expression nests more than {MAX_NODE_DEPTH} operators")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"a value exceeds 10**{MAX_DIGITS} in magnitude") from None
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"the operator {type(node.op).__name__}"
    else:
        what = f"a {type(node.value).__name__} constant" if isinstance(node, ast.Constant) else type(node).__name__
    raise ToolError(f"{what} is not allowed; the calculator takes {_ALLOWED}")


def calculate(expression) -> int | float:
    """The value of an arithmetic expression, with Python's semantics for int and float.

    Accepts int and float literals, unary + -, binary + - * / // % ** and parentheses (upstream's ^ × ÷ − （ ）
    are read as ** * / - ( )). Raises ToolError for anything else (names, attributes, calls, strings, ...), for
    text over MAX_EXPRESSION_CHARS, parentheses over MAX_PAREN_DEPTH, operators nested over MAX_NODE_DEPTH, any
    value past 10**MAX_DIGITS (powers are refused from an estimate, never computed), division by zero, complex
    or non-finite results. The text is parsed by ast.parse and walked over a whitelist; it is never evaluated.
    """
    if not isinstance(expression, str):
        raise ToolError(f"the expression must be a string, got {_show(expression)}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    for spelling, python in _SPELLINGS.items():
        expression = expression.replace(spelling, python)
    depth = deepest = 0
    for character in expression:  # bounds ast.parse's own recursion
        depth += character in "([{"
        depth -= character in ")]}"
        deepest = max(deepest, depth)
    if deepest > MAX_PAREN_DEPTH:
        raise ToolError(f"the expression nests more than {MAX_PAREN_DEPTH} parentheses")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        reason = error.msg if isinstance(error, SyntaxError) else str(error)
        raise ToolError(f"not an arithmetic expression ({_show(reason, 60)})") from None
    return _evaluate(tree.body, 0)


# ----------------------------------------------------------------------------- upstream's six tools
# Canned data, as upstream's train_agent.py holds it (its answers are the values its agent RL data expects).
WEATHER = {
    "北京": ("28°C", "晴"),
    "上海": ("15°C", "多云"),
    "广州": ("32°C", "闷热"),
    "深圳": ("30°C", "晴"),
    "杭州": ("22°C", "阴"),
    "成都": ("18°C", "小雨"),
    "武汉": ("25°C", "多云"),
    "南京": ("20°C", "晴"),
    "西安": ("16°C", "大风"),
    "重庆": ("26°C", "阴"),
    "Tokyo": ("12°C", "晴"),
    "New York": ("8°C", "多云"),
    "London": ("5°C", "小雨"),
    "Paris": ("10°C", "阴"),
    "Sydney": ("25°C", "晴朗"),
}
WEATHER_DEFAULT, HUMIDITY = ("22°C", "晴"), "65%"
TIMES = {
    "Asia/Shanghai": "2025-03-07 14:30:00",
    "America/New_York": "2025-03-07 01:30:00",
    "Europe/London": "2025-03-07 06:30:00",
    "Asia/Tokyo": "2025-03-07 15:30:00",
    "Europe/Paris": "2025-03-07 07:30:00",
    "Australia/Sydney": "2025-03-07 17:30:00",
}
TIME_DEFAULT = "2025-03-07 14:30:00"
EXCHANGE_RATES = {
    ("USD", "CNY"): 7.21,
    ("EUR", "CNY"): 7.85,
    ("GBP", "CNY"): 9.12,
    ("JPY", "CNY"): 0.048,
    ("USD", "EUR"): 0.92,
    ("USD", "GBP"): 0.79,
    ("CNY", "JPY"): 20.83,
    ("AUD", "CNY"): 4.72,
}
RATE_DEFAULT = 1.0
TRANSLATIONS = {
    ("你好世界", "english"): "Hello World",
    ("Good morning", "chinese"): "早上好",
    ("今天天气真好", "english"): "The weather is nice today",
    ("I love programming", "chinese"): "我喜欢编程",
    ("机器学习很有趣", "english"): "Machine learning is interesting",
    ("Happy birthday", "chinese"): "生日快乐",
}
# a multiplying factor per "from_to" pair (upstream's table: temperatures too are a factor, not an affine map)
UNIT_FACTORS = {
    "km_miles": 0.621371,
    "miles_km": 1.60934,
    "kg_pounds": 2.20462,
    "pounds_kg": 0.453592,
    "meters_feet": 3.28084,
    "feet_meters": 0.3048,
    "celsius_fahrenheit": 1.8,
    "fahrenheit_celsius": 0.5556,
}
UNIT_DEFAULT = 1


def _schema(name: str, description: str, properties: dict, required: list) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _lookup(table: dict, key, default):
    """``table[key]``, else the entry whose key matches case-insensitively, else ``default``."""
    if key in table:
        return key, table[key]
    folded = tuple(part.casefold() for part in key) if isinstance(key, tuple) else key.casefold()
    for candidate, value in table.items():
        candidate_folded = (
            tuple(p.casefold() for p in candidate) if isinstance(candidate, tuple) else candidate.casefold()
        )
        if candidate_folded == folded:
            return candidate, value
    return key, default


# The descriptions are upstream's (Chinese), so the rendered prompt equals the one of upstream's data.
@register_tool(_schema("calculate_math", "计算数学表达式", {"expression": {"type": "string"}}, ["expression"]))
def calculate_math(expression: str) -> dict:
    """{"result": str(value)} of calculate(expression); ToolError as calculate raises it."""
    return {"result": str(calculate(expression))}


@register_tool(
    _schema(
        "unit_converter",
        "单位换算",
        {"value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
        ["value", "from_unit", "to_unit"],
    )
)
def unit_converter(value, from_unit: str, to_unit: str) -> dict:
    """{"result": round(value * factor, 4)}, factor from UNIT_FACTORS["from_to"] (lower case; 1 if unknown)."""
    factor = UNIT_FACTORS.get(f"{from_unit.strip().lower()}_{to_unit.strip().lower()}", UNIT_DEFAULT)
    return {"result": round(float(value) * factor, 4)}


@register_tool(_schema("get_current_weather", "获取天气", {"location": {"type": "string"}}, ["location"]))
def get_current_weather(location: str) -> dict:
    """{"city", "temperature", "humidity", "condition"} from WEATHER (WEATHER_DEFAULT for other places)."""
    city, (temperature, condition) = _lookup(WEATHER, location.strip(), WEATHER_DEFAULT)
    return {"city": city, "temperature": temperature, "humidity": HUMIDITY, "condition": condition}


@register_tool(
    _schema("get_current_time", "获取时间", {"timezone": {"type": "string", "default": "Asia/Shanghai"}}, [])
)
def get_current_time(timezone: str = "Asia/Shanghai") -> dict:
    """{"datetime", "timezone"} from TIMES (TIME_DEFAULT for other zones); a fixed clock, not the machine's."""
    zone, stamp = _lookup(TIMES, timezone.strip(), TIME_DEFAULT)
    return {"datetime": stamp, "timezone": zone}


@register_tool(
    _schema(
        "get_exchange_rate",
        "查询汇率",
        {"from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
        ["from_currency", "to_currency"],
    )
)
def get_exchange_rate(from_currency: str, to_currency: str) -> dict:
    """{"from", "to", "rate"} from EXCHANGE_RATES, codes in upper case (RATE_DEFAULT for other pairs)."""
    pair = (from_currency.strip().upper(), to_currency.strip().upper())
    return {"from": pair[0], "to": pair[1], "rate": EXCHANGE_RATES.get(pair, RATE_DEFAULT)}


@register_tool(
    _schema(
        "translate_text",
        "翻译文本",
        {"text": {"type": "string"}, "target_language": {"type": "string"}},
        ["text", "target_language"],
    )
)
def translate_text(text: str, target_language: str) -> dict:
    """{"translated_text"} from TRANSLATIONS (the text itself for pairs it does not hold)."""
    _, translated = _lookup(TRANSLATIONS, (text.strip(), target_language.strip().lower()), text)
    return {"translated_text": translated}
