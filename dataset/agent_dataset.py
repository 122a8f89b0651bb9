"""Upstream MiniMind's agent RL rows as a dataset: each row checked when the file is read (the tool schemas parse and
name registered tools, ``gt`` is a list of values, a user turn to answer), so bad input fails before a model is built.
The bundled task's splits: ``AGENT_TRAIN_DATA`` to train, ``AGENT_VAL_DATA`` to choose settings on, ``AGENT_TEST_DATA``
to report (``scripts/make_demo_data.py`` writes them, disjoint)."""

import os
import random

import torch

from dataset.errors import DataError
from dataset.lm_dataset import DataFormatError, escape_conversations, iter_jsonl

DATASET_DIR = os.path.dirname(os.path.abspath(__file__))
AGENT_TRAIN_DATA = os.path.join(DATASET_DIR, "agent_rl_train.jsonl")
AGENT_VAL_DATA = os.path.join(DATASET_DIR, "agent_rl_val.jsonl")
AGENT_TEST_DATA = os.path.join(DATASET_DIR, "agent_rl_test.jsonl")


class AgentRLDataset(torch.utils.data.Dataset):
    """Upstream MiniMind's agent RL rows (``AgentRLDataset``): ``{"conversations": [...], "gt": [values]}``, a
    system turn carrying the tool schemas as ``tools`` (a JSON string or a list). Items: {"messages": the prompt
    turns (a final assistant turn dropped, contents escaped as ``RLAIFDataset`` escapes them), "gt": list[str],
    "open_thinking": bool, "index": int}. A prompt opens thinking with probability ``thinking_ratio``, drawn as
    ``RLAIFDataset`` draws it (a fixed function of seed and index: a resumed run sees the same prompts). Every row
    is checked when the file is read: bad input fails before any model is built. ``check_tools(conversations)``
    checks a row's tool schemas (``trainer.agent.tools.conversation_tools``: they parse and name registered tools;
    ValueError otherwise). Raises DataFormatError naming file and line (``check_agent_row``), DataError for a ratio
    outside [0, 1]."""

    def __init__(self, path, tokenizer, thinking_ratio=0.0, seed=42, *, check_tools):
        if not 0.0 <= thinking_ratio <= 1.0:
            raise DataError(f"thinking_ratio must be in [0, 1], got {thinking_ratio}")
        special_tokens = list(tokenizer.all_special_tokens)
        self.rows = [
            check_agent_row(row, f"{path}:{line}", special_tokens, check_tools) for line, row in iter_jsonl(path)
        ]
        self.thinking_ratio, self.seed = thinking_ratio, seed

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        open_thinking = random.Random(self.seed * 1_000_003 + index).random() < self.thinking_ratio
        return dict(self.rows[index], open_thinking=open_thinking, index=index)


def check_agent_row(row, where, special_tokens, check_tools):
    """One row as {"messages", "gt"}; DataFormatError ``where: reason`` for a row without a conversation of
    role/content strings, without ``tools`` on a system turn (or with tools that ``check_tools`` refuses: not JSON,
    not schemas, not registered), without a ``gt`` list, or without a user turn to answer."""
    conversations = row.get("conversations") if isinstance(row, dict) else None
    if (
        not isinstance(conversations, list)
        or not conversations
        or not all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
            for t in conversations
        )
    ):
        raise DataFormatError(f"{where}: expected a non-empty 'conversations' list of role/content strings")
    if not any(t["role"] == "system" and t.get("tools") for t in conversations):
        raise DataFormatError(f"{where}: no system turn with 'tools' (the tool schemas the model may call)")
    gt = row.get("gt")
    if not isinstance(gt, list) or not all(isinstance(g, (str, int, float)) and not isinstance(g, bool) for g in gt):
        raise DataFormatError(
            f"{where}: expected 'gt', a list of the values a right answer contains, got {str(gt)[:60]!r}"
        )
    try:
        check_tools(conversations)  # the schemas parse and every tool is registered
    except ValueError as error:
        raise DataFormatError(f"{where}: {error}") from error
    if conversations[-1]["role"] == "assistant":
        conversations = conversations[:-1]  # upstream's reference answer, not part of the prompt
    if not any(t["role"] == "user" for t in conversations):
        raise DataFormatError(f"{where}: no user turn to use as the prompt")
    escaped, _ = escape_conversations(conversations, special_tokens)
    messages = [dict(turn, content=e["content"]) for turn, e in zip(conversations, escaped)]
    return {"messages": messages, "gt": [str(g) for g in gt]}


def collate_agent_rows(items):
    """A batch of dataset items as lists (messages and gt keep their nesting) and the indices as a tensor."""
    return {
        "messages": [item["messages"] for item in items],
        "gt": [item["gt"] for item in items],
        "open_thinking": [item["open_thinking"] for item in items],
        "index": torch.tensor([item["index"] for item in items], dtype=torch.long),
    }
