"""How well a checkpoint copies the question's numbers, behind prefixes of growing length (docs/agent.md).

The chapter's SFT rows with a column trace begin their answer by restating the problem (``987 减 47, ones first:``):
those digits are copies of the question's. This script puts a prefix in front of the same rows (nothing; a system
turn of k x "You are a helpful assistant. "; k x "Please be careful. " before the question; the calculator's tools
block of the agent task) and prints, for each, the mean token count and the model's loss (nats) on the copied digits
(the first left out: there the model also picks the answer's format). A model that copies by content keeps that loss
low whatever stands before; one that learned the rows' positions loses it as the prefix grows.

Usage: python scripts/agent_copy_study/copy_probe.py [--weight full_sft] [--num_rows 12]
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch
import torch.nn.functional as F

from dataset.lm_dataset import iter_jsonl
from trainer.agent.rollout import conversation_tools
from trainer.agent.tools import tool_schemas
from trainer.infra.weights import DEFAULT_SAVE_DIR, build_config, init_model

TRACE_LINE = re.compile(r"<think>\n([^\n]*\d[^\n]*), ones first:")


def trace_rows(path, count):
    """The first ``count`` rows of ``path`` whose answer restates the problem in a column trace, with the character
    span of that restatement inside the assistant's content."""
    rows = []
    for _, row in iter_jsonl(path):
        answer = row["conversations"][-1]["content"]
        found = TRACE_LINE.search(answer)
        if found:
            rows.append((row["conversations"], found.span(1)))
        if len(rows) == count:
            break
    return rows


def with_prefix(conversation, kind, repeats):
    """(messages, tools) of one row behind a prefix: "none", "system", "user" or "tools"."""
    messages = [dict(m) for m in conversation]
    if kind == "system":
        return [{"role": "system", "content": "You are a helpful assistant. " * repeats}] + messages, None
    if kind == "user":
        messages[0]["content"] = "Please be careful. " * repeats + messages[0]["content"]
        return messages, None
    if kind == "tools":
        return [{"role": "system", "content": "You are a helpful assistant."}] + messages, tool_schemas(
            ["calculate_math"]
        )
    return messages, None


@torch.no_grad()
def copy_loss(model, tokenizer, messages, tools, span):
    """(tokens, summed loss, count) over the digit tokens of the restatement at ``span`` of the last turn, its first
    digit left out: there the model also chooses between a trace and an empty ``<think>`` (the SFT rows hold both),
    a choice of format, not a copy."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)
    start = text.rfind(messages[-1]["content"])
    begin, end = start + span[0], start + span[1]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor([encoded["input_ids"]])  # [1, L]
    logits = model(ids).logits[0, :-1].float()  # [L - 1, V], predicting tokens 1..L-1
    nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")  # [L - 1]
    picked = [
        i
        for i, (a, b) in enumerate(encoded["offset_mapping"])
        if i > 0 and begin <= a and b <= end and text[a:b].strip().isdigit()
    ][1:]
    return len(encoded["input_ids"]), sum(nll[i - 1].item() for i in picked), len(picked)


@torch.no_grad()
def agent_copy_loss(model, tokenizer, row):
    """{part: (summed loss, count)} over the digits of the call's expression ("call") and of the final answer
    ("answer") of one agent SFT row that calls the calculator: both are copies (of the question, of the reply)."""
    messages, tools = conversation_tools(row["conversations"])
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)
    call_start = text.rfind(messages[-3]["content"])
    expression = '"expression": "'
    spans = {
        "call": (text.index(expression, call_start) + len(expression), text.index("</tool_call>", call_start)),
        "answer": (
            text.rfind(messages[-1]["content"]),
            text.rfind(messages[-1]["content"]) + len(messages[-1]["content"]),
        ),
    }
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor([encoded["input_ids"]])  # [1, L]
    nll = F.cross_entropy(model(ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")  # [L - 1]
    totals = {}
    for part, (begin, end) in spans.items():
        picked = [
            i
            for i, (a, b) in enumerate(encoded["offset_mapping"])
            if i > 0 and begin <= a and b <= end and text[a:b].strip().isdigit()
        ]
        totals[part] = (sum(nll[i - 1].item() for i in picked), len(picked))
    return totals


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weight", default="full_sft", help="name in out/ ({name}_256.pth) or a path")
    parser.add_argument("--data_path", default=os.path.join(ROOT, "dataset", "sft_data.jsonl"))
    parser.add_argument("--agent_data_path", default=os.path.join(ROOT, "dataset", "agent_sft.jsonl"))
    parser.add_argument("--num_rows", type=int, default=12)
    args = parser.parse_args()
    path = args.weight if os.path.isfile(args.weight) else os.path.join(DEFAULT_SAVE_DIR, f"{args.weight}_256.pth")
    model, tokenizer = init_model(build_config(256, 4, 0), path)
    model.eval()
    rows = trace_rows(args.data_path, args.num_rows)
    print(
        f"{path}: {len(rows)} rows, loss (nats) on the digits each answer copies from its question (its first left out)"
    )
    print("| prefix | mean tokens | copied-digit loss |\n| --- | --- | --- |")
    for kind, repeats in [
        ("none", 0),
        ("system", 1),
        ("system", 3),
        ("system", 10),
        ("system", 25),
        ("user", 3),
        ("user", 10),
        ("user", 25),
        ("tools", 1),
    ]:
        totals = [copy_loss(model, tokenizer, *with_prefix(conv, kind, repeats), span) for conv, span in rows]
        tokens = sum(t for t, _, _ in totals) / len(totals)
        loss = sum(s for _, s, _ in totals) / max(sum(c for _, _, c in totals), 1)
        label = "none" if kind == "none" else f"{kind} x{repeats}" if kind != "tools" else "calculator tools block"
        print(f"| {label} | {tokens:.0f} | {loss:.3f} |")
    calls = [row for _, row in iter_jsonl(args.agent_data_path) if len(row["conversations"]) == 5][: args.num_rows]
    parts = [agent_copy_loss(model, tokenizer, row) for row in calls]
    losses = {
        part: sum(p[part][0] for p in parts) / max(sum(p[part][1] for p in parts), 1) for part in ("call", "answer")
    }
    print(
        f"{len(calls)} rows of {os.path.basename(args.agent_data_path)} that call the calculator: loss per digit "
        f"{losses['call']:.3f} in the call's expression (copied from the question), {losses['answer']:.3f} in the "
        f"answer (copied from the tool's reply); ln 10 = 2.303 is a guess"
    )


if __name__ == "__main__":
    main()
