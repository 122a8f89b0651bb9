"""A standard tool-calling client drives the bundled agent start and gets the answers ``agent_rollout`` gets.

The client is what a user writes with nothing of this project's agent code: the tokenizer's
``apply_chat_template(messages, tools=...)``, the model's greedy ``generate``, a regular expression and ``json.loads``
for the ``<tool_call>`` blocks, its own calculator (a plain loop over ``+ - *``) and a ``tool`` message with the
result. On validation prompts its greedy conversations must equal ``agent_rollout``'s (the calculator's replies,
the calls and the final answers), so the trained default is usable outside the training script."""

import json
import os
import re

import pytest
import torch

from conftest import ROOT
from trainer.agent.rollout import agent_rollout
from trainer.infra.weights import build_config, init_model
from dataset.agent_dataset import AGENT_VAL_DATA
from trainer.evaluation import GreedyPolicy
from trainer.train_agent import parse_args

NUM_PROMPTS = 6
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def client_calculate(expression):
    """The value of integers joined by ``+ - *`` (``*`` first), by a plain loop: the client's own calculator."""
    tokens = expression.split()
    if (
        not tokens
        or len(tokens) % 2 == 0
        or not all(t.isdigit() for t in tokens[::2])
        or not all(t in "+-*" for t in tokens[1::2])
    ):
        return None
    terms, signs = [int(tokens[0])], [1]
    for op, number in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            terms[-1] *= int(number)
        else:
            terms.append(int(number))
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms))


def client_conversation(model, tokenizer, row, max_new_tokens, max_turns):
    """One greedy conversation as a plain client runs it: (the model's turns, the tool messages it sent)."""
    system = next(turn for turn in row["conversations"] if turn["role"] == "system")
    tools = json.loads(system["tools"])
    messages = [
        {"role": turn["role"], "content": turn["content"]}
        for turn in row["conversations"]
        if turn["role"] != "assistant"
    ]
    turns, replies = [], []
    for _ in range(max_turns):
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        output = model.generate(
            input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        turn = tokenizer.decode(output.output_ids[0, input_ids.size(1) :], skip_special_tokens=True)
        turns.append(turn)
        calls = TOOL_CALL.findall(turn)
        if not calls:
            break
        messages.append({"role": "assistant", "content": turn})
        for call in calls:
            try:
                expression = json.loads(call)["arguments"]["expression"]
                value = client_calculate(expression)
            except (ValueError, KeyError, TypeError):
                value = None
            reply = json.dumps(
                {"result": str(value)} if value is not None else {"error": "bad call"}, ensure_ascii=False
            )
            replies.append(reply)
            messages.append({"role": "tool", "content": reply})
    return turns, replies


@pytest.fixture(scope="module")
def bundled_start():
    """The bundled agent RL start (train_agent.py's default --from_weight) and its tokenizer."""
    args = parse_args([])
    model, tokenizer = init_model(
        build_config(args.hidden_size, args.num_hidden_layers, args.use_moe),
        args.from_weight,
        os.path.join(ROOT, "out"),
    )
    return model.eval(), tokenizer, args


def test_client_calculator_is_right():
    """The client's calculator against numbers worked by hand."""
    assert client_calculate("12 + 3 * 4 - 5") == 19
    assert client_calculate("7 * 8") == 56
    assert client_calculate("100 - 250") == -150
    assert client_calculate("2 +") is None


@torch.no_grad()
def test_standard_client_matches_agent_rollout(bundled_start):
    """On validation prompts, greedy: the same turns and the same tool replies from both drivers, and the client's
    calculator agrees with the project's wherever the model called it."""
    model, tokenizer, args = bundled_start
    rows = [json.loads(line) for line in open(AGENT_VAL_DATA, encoding="utf-8")][:NUM_PROMPTS]
    rollout = agent_rollout(
        GreedyPolicy(model),
        tokenizer,
        [[t for t in row["conversations"] if t["role"] != "assistant"] for row in rows],
        1,
        max_new_tokens=args.max_gen_len,
        max_total_len=args.max_total_len,
        max_turns=args.max_turns,
    )
    calls = 0
    for n, row in enumerate(rows):
        turns, replies = client_conversation(model, tokenizer, row, args.max_gen_len, args.max_turns)
        assert turns == rollout.turn_texts[n], f"prompt {n}"
        calls += len(replies)
        for reply in replies:
            assert reply in tokenizer.decode(rollout.completion_ids[n], skip_special_tokens=False)
    assert calls > 0, "the bundled start called no tool on these prompts"
