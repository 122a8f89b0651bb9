"""Datasets: chat SFT conversations, RL prompts and reward-model preference pairs, from JSONL files.

SFT and RL lines are ``{"conversations": [{"role": "user" | "assistant" | "system" | "tool", "content": str}, ...]}``
(MiniMind's format; a system turn may carry ``tools``, its tool schemas as a JSON string, as upstream's agent rows
do); preference pairs are described in ``read_preference_pairs``.
Files are parsed line by line (so a bad line is reported with its file and line number) and held in a
``datasets.Dataset``. ``ResumableBatchSampler`` gives the RL scripts a data order that a resumed run continues.
"""

import functools
import gzip
import itertools
import json
import random
import re
import sys

import torch
from datasets import Dataset

from dataset.errors import DataError


class DataFormatError(DataError):
    """A data file line that is not valid UTF-8 JSON in the expected format (names file and line)."""


def read_lines(f, path):
    """The raw lines of an open file; a broken ``.gz`` becomes a DataFormatError naming ``path``."""
    try:
        yield from f
    except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError
        raise DataFormatError(
            f"{path}: cannot be read as {'gzip' if path.endswith('.gz') else 'a file'} ({type(err).__name__}: {err})"
        ) from err


def iter_jsonl(path):
    """Yield (line number, parsed JSON value) for each non-blank line of a JSONL file (``.gz`` too).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        DataFormatError: ``file:line`` for a non-UTF-8 byte or invalid JSON.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for line_no, raw in enumerate(read_lines(f, path), start=1):
            if line_no == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark (Notepad writes one)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataFormatError(f"{path}:{line_no}: not valid UTF-8 ({err.reason} at byte {err.start})") from err
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{path}:{line_no}: invalid JSON ({err.msg} at column {err.colno})") from err
            yield line_no, value


def read_conversations_jsonl(path, require_user_turn=False):
    """Read a JSONL file of ``{"conversations": [...]}`` rows into a ``datasets.Dataset``.

    Every line is checked here, at start-up, so a bad line fails before the first step, not hours in.
    Returns:
        ``datasets.Dataset`` with columns ``conversations`` (list of {"role", "content"}, and ``tools`` (a JSON
        string, None on the other turns) where a file's system turns carry tools) and ``line``
        (1-based line number in ``path``); it has 0 rows for an empty file (callers say how many they need).
    Raises:
        FileNotFoundError: if ``path`` does not exist.
        DataFormatError: on a non-UTF-8 byte, invalid JSON, a row without a non-empty ``conversations``
            list of {"role", "content"} strings, ``tools`` that are not a list of schemas (as JSON or as a list)
            on a system turn, or (``require_user_turn``) a row with no user turn before its last turn; the message
            names file and line.
    """
    rows = []
    for line_no, row in iter_jsonl(path):
        conversations = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(conversations, list) or not conversations:
            raise DataFormatError(f"{path}:{line_no}: expected a non-empty 'conversations' list")
        for turn in conversations:
            if not (
                isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
            ):
                raise DataFormatError(f"{path}:{line_no}: each turn needs string 'role' and 'content'")
        if require_user_turn and not any(t["role"] == "user" for t in prompt_turns(conversations)):
            raise DataFormatError(f"{path}:{line_no}: no user turn to use as the prompt")
        turns = [{"role": t["role"], "content": t["content"]} for t in conversations]
        for turn, raw in zip(turns, conversations):
            if raw.get("tools") is not None:
                turn["tools"] = checked_tools(raw, f"{path}:{line_no}")
        rows.append({"conversations": turns, "line": line_no})
    return Dataset.from_list(rows)


def checked_tools(turn, where):
    """A turn's ``tools`` as a JSON string of a list of schemas (upstream writes the string; a list is dumped);
    raises DataFormatError naming ``where`` for tools off a system turn or not a JSON list of objects."""
    tools = turn["tools"]
    try:
        schemas = json.loads(tools) if isinstance(tools, str) else tools
    except json.JSONDecodeError as err:
        raise DataFormatError(f"{where}: the system turn's 'tools' are not JSON ({err.msg})") from err
    if turn["role"] != "system" or not isinstance(schemas, list) or not all(isinstance(t, dict) for t in schemas):
        raise DataFormatError(
            f"{where}: 'tools' must be a list of tool schemas on a system turn, got "
            f"{str(tools)[:80]!r} on a {turn['role']} turn"
        )
    return tools if isinstance(tools, str) else json.dumps(tools, ensure_ascii=False)


def conversation_tools(conversations):
    """The tool schemas (a list) of the first system turn that carries ``tools``, or None: the ``tools`` argument of
    the chat template, which renders them in the system turn."""
    tools = next((t["tools"] for t in conversations if t["role"] == "system" and t.get("tools")), None)
    return None if tools is None else json.loads(tools)


def prompt_turns(conversations):
    """The turns that form an RL prompt: all but a final assistant turn (which is the reference answer)."""
    if len(conversations) > 1 and conversations[-1]["role"] == "assistant":
        return conversations[:-1]
    return conversations


def escape_special_tokens(text, special_tokens):
    """Make special-token text typed inside a message (e.g. ``<|im_end|>``) ordinary text.

    A zero-width space (U+200B) goes after the first character of each occurrence, so the tokenizer no
    longer matches the special token and a user cannot close their own turn or open another role's.
    Returns (escaped text, number of occurrences escaped).
    """
    count = 0
    for token in special_tokens:
        if token in text:
            count += text.count(token)
            text = text.replace(token, token[0] + "\u200b" + token[1:])
    return text, count


THINK_TOKENS = ("<think>", "</think>")  # the chat template's thinking markers: single tokens of a MiniMind tokenizer


def escape_conversations(conversations, special_tokens):
    """``escape_special_tokens`` on every turn's content, and on user and system turns the thinking markers
    ``THINK_TOKENS`` too (an assistant turn's own thinking keeps them: SFT teaches that format); returns (new turns,
    occurrences escaped)."""
    escaped, total = [], 0
    for turn in conversations:
        tokens = special_tokens if turn["role"] == "assistant" else [*special_tokens, *THINK_TOKENS]
        content, count = escape_special_tokens(turn["content"], tokens)
        escaped.append({"role": turn["role"], "content": content})
        total += count
    return escaped, total


def warn_special_token_text(path, data, special_tokens):
    """One warning that counts the rows whose content holds special-token text (escaped when rendered)."""
    lines = [row["line"] for row in data if escape_conversations(row["conversations"], special_tokens)[1]]
    if lines:
        print(
            f"warning: {path}: {len(lines)} rows contain special-token text ({', '.join(special_tokens)}, and "
            f"{' '.join(THINK_TOKENS)} outside assistant turns) inside a message (first at line {lines[0]}); it is "
            f"escaped with a zero-width space and stays ordinary text",
            file=sys.stderr,
            flush=True,
        )
    return len(lines)


class SFTDataset(torch.utils.data.Dataset):
    """Chat SFT samples; the loss is on assistant tokens only.

    __getitem__ -> (input_ids long [T], labels long [T]) with T <= max_length, labels = -100 outside
    assistant turns. An assistant turn's labels cover its text and its closing ``<|im_end|>``. A system turn's
    ``tools`` reach the chat template (rendered in the system turn); ``tool`` turns are not trained.
    """

    def __init__(self, path, tokenizer, max_length=512):
        self.data = read_conversations_jsonl(path)
        self.tokenizer = tokenizer
        self.special_tokens = list(tokenizer.all_special_tokens)
        self.num_escaped_rows = warn_special_token_text(path, self.data, self.special_tokens)
        self.max_length = max_length
        self.assistant_prefix = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.eos_token_id = tokenizer.eos_token_id

    def __len__(self):
        return len(self.data)

    def assistant_labels(self, input_ids):
        """labels [T]: input_ids inside assistant turns (after the prefix, through EOS), else -100."""
        labels = [-100] * len(input_ids)
        prefix_len = len(self.assistant_prefix)
        i = 0
        while i < len(input_ids):
            if input_ids[i : i + prefix_len] == self.assistant_prefix:
                start = i + prefix_len
                end = start
                while end < len(input_ids) and input_ids[end] != self.eos_token_id:
                    end += 1
                for j in range(start, min(end + 1, len(input_ids))):
                    labels[j] = input_ids[j]
                i = end + 1
            else:
                i += 1
        return labels

    def __getitem__(self, index):
        conversations, _ = escape_conversations(self.data[index]["conversations"], self.special_tokens)
        tools = conversation_tools(self.data[index]["conversations"])
        text = self.tokenizer.apply_chat_template(conversations, tools=tools, tokenize=False)
        input_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_length]
        labels = self.assistant_labels(input_ids)
        return torch.tensor(input_ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def sft_collate(batch, pad_token_id):
    """Right-pad a list of (input_ids [T_i], labels [T_i]) -> input_ids, labels, attention_mask [B, T_max]."""
    max_len = max(ids.size(0) for ids, _ in batch)
    input_ids = torch.full((len(batch), max_len), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), max_len), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for i, (ids, lab) in enumerate(batch):
        input_ids[i, : ids.size(0)] = ids
        labels[i, : lab.size(0)] = lab
        attention_mask[i, : ids.size(0)] = 1
    return input_ids, labels, attention_mask


@functools.lru_cache(maxsize=8)
def longest_token_chars(tokenizer):
    """Characters of the tokenizer's longest vocabulary entry (byte-level entries: one character per byte, so no
    token covers more characters of a text than this)."""
    return max(len(token) for token in tokenizer.get_vocab())


def prompt_tail(text, max_seq_len, tokenizer):
    """The end of ``text`` that keeps its last ``max_seq_len`` tokens, so that a huge prompt is never tokenized
    whole: no token spans more than ``longest_token_chars`` characters, so the last (max_seq_len + 64) x that many
    characters hold more than max_seq_len tokens, and the 64 spare tokens absorb the word the cut splits.
    Shorter text is returned whole. tests/test_dataset.py checks the tokens against the whole text's."""
    keep = (max_seq_len + 64) * longest_token_chars(tokenizer)
    return text if len(text) <= keep else text[-keep:]


class RLAIFDataset(torch.utils.data.Dataset):
    """RL prompts: ``{"prompt": chat-templated text ending in the generation prompt, "answer": str, "index": int}``.

    The prompt is every turn but the last, rendered with ``add_generation_prompt=True``; ``answer`` is
    the last turn's content when it is an assistant turn (the reference answer), else "". Like MiniMind,
    each prompt opens thinking (``open_thinking=True``: the prompt ends in ``<think>\\n``) with
    probability ``thinking_ratio``; the draw is a fixed function of (seed, index), so a resumed run
    sees the same prompts.
    """

    def __init__(self, path, tokenizer, thinking_ratio=0.9, seed=42):
        if not 0.0 <= thinking_ratio <= 1.0:
            raise DataError(f"thinking_ratio must be in [0, 1], got {thinking_ratio}")
        self.data = read_conversations_jsonl(path, require_user_turn=True)
        self.tokenizer = tokenizer
        self.special_tokens = list(tokenizer.all_special_tokens)
        self.num_escaped_rows = warn_special_token_text(path, self.data, self.special_tokens)
        self.thinking_ratio = thinking_ratio
        self.seed = seed

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        conversations, _ = escape_conversations(self.data[index]["conversations"], self.special_tokens)
        answer = ""
        if len(conversations) > 1 and conversations[-1]["role"] == "assistant":
            answer = self.data[index]["conversations"][-1]["content"]
        conversations = prompt_turns(conversations)
        open_thinking = random.Random(self.seed * 1_000_003 + index).random() < self.thinking_ratio
        prompt = self.tokenizer.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=True, open_thinking=open_thinking
        )
        return {"prompt": prompt, "answer": answer, "index": index}

    def lines_without_answer(self):
        """Line numbers of the rows whose last turn is not an assistant turn with text: no reference answer, so
        their answer reward is 0 for every answer."""
        return [
            row["line"]
            for row in self.data
            if not (
                len(row["conversations"]) > 1
                and row["conversations"][-1]["role"] == "assistant"
                and row["conversations"][-1]["content"].strip()
            )
        ]

    def count_longer_than(self, max_seq_len):
        """How many prompts are longer than ``max_seq_len`` tokens (a run cuts them from the left)."""
        prompts = [prompt_tail(self[i]["prompt"], max_seq_len, self.tokenizer) for i in range(len(self))]
        lengths = [len(ids) for ids in self.tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        return sum(length > max_seq_len for length in lengths)


class ResumableBatchSampler(torch.utils.data.Sampler):
    """Batches of one epoch's prompt indices for this rank, skipping the batches a resumed run already saw.

    The order of epoch ``e`` is DistributedSampler's (a permutation seeded by ``seed + e``, split over ranks;
    world size 1 when not distributed), so it does not depend on whether or where the run was interrupted.
    ``set_epoch(e, skip_batches)`` picks the epoch; the last partial batch is dropped.
    """

    def __init__(self, dataset, batch_size, world_size, rank, seed):
        self.sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.batch_size = batch_size
        self.skip_batches = 0

    def set_epoch(self, epoch, skip_batches=0):
        self.sampler.set_epoch(epoch)
        self.skip_batches = skip_batches

    def __iter__(self):
        indices = list(self.sampler)
        full = len(indices) // self.batch_size * self.batch_size
        for start in range(self.skip_batches * self.batch_size, full, self.batch_size):
            yield indices[start : start + self.batch_size]

    def __len__(self):
        return len(self.sampler) // self.batch_size - self.skip_batches


def check_prompt_count(dataset, path, batch_size, world_size, max_seq_len, answer_reward_weight):
    """Refuse prompt data too small for one batch of every process; warn about prompts longer than ``max_seq_len``
    tokens (a run cuts them from the left so that the generation prompt survives) and, when the answer reward counts
    (``answer_reward_weight`` > 0), about rows without a reference answer (their answer reward is 0 for every
    answer, naming the first lines and the fix).

    Raises:
        ValueError: naming ``path``, how many prompts it has and how many one step of every process needs.
    """
    if len(dataset) < batch_size * world_size:
        raise DataError(
            f"--data_path {path}: found {len(dataset)} prompts, need at least {batch_size * world_size} "
            f"(--batch_size {batch_size} x {world_size} processes) for one full batch"
        )
    missing = dataset.lines_without_answer() if answer_reward_weight else []
    if missing and len(missing) == len(dataset):
        print(
            f"note: {path} has no reference answers (no final assistant turn with text): the answer reward is 0 "
            f"for every answer, so only the rule rewards and the reward model train (as upstream MiniMind's "
            f"RLAIF data does)",
            flush=True,
        )
    elif missing:
        print(
            f"warning: {path}: {len(missing)} of {len(dataset)} rows have no reference answer (lines "
            f"{', '.join(map(str, missing[:5]))}{', ...' if len(missing) > 5 else ''}): their answer reward is 0 "
            f"for every answer while the others can earn {answer_reward_weight:g}. Give each row its answer as a "
            f"final assistant turn, or pass --answer_reward_weight 0",
            flush=True,
        )
    long_prompts = dataset.count_longer_than(max_seq_len)
    if long_prompts:
        print(
            f"warning: {long_prompts} of {len(dataset)} prompts are longer than --max_seq_len {max_seq_len} "
            f"tokens; they are cut from the left so the generation prompt survives",
            flush=True,
        )


def count_total_steps(max_steps, epochs, steps_per_epoch):
    """Steps of the run: ``max_steps`` when set (capped by the data), else ``epochs`` full passes."""
    return min(max_steps, epochs * steps_per_epoch) if max_steps else epochs * steps_per_epoch


def epoch_batches(loader, batch_sampler, start, epochs):
    """Yield (position, batch) from a run's start (or resumed position) to the end of its last epoch.

    Args:
        loader: the DataLoader over ``batch_sampler`` (a ``ResumableBatchSampler``).
        start: {"epoch", "batch_in_epoch"}: the epoch the run is in and its batches done.
    Yields:
        position {"epoch", "batch_in_epoch"} after this batch (what a checkpoint saves), and the batch: a dict of
        lists "prompt", "answer" (str) and "index" (a tensor of dataset indices).
    """
    for epoch in range(start["epoch"], epochs):
        batch_sampler.set_epoch(epoch, start["batch_in_epoch"] if epoch == start["epoch"] else 0)
        for batch_in_epoch, batch in enumerate(loader, start=batch_sampler.skip_batches + 1):
            yield {"epoch": epoch, "batch_in_epoch": batch_in_epoch}, batch


def resumable_batches(loader, batch_sampler, start, epochs, total_steps, data=None):
    """Yield (step, position, batch) from a run's start (or resumed position) to ``total_steps``, epoch after epoch.

    Args:
        loader, batch_sampler, epochs: as ``epoch_batches``.
        start: {"step", "epoch", "batch_in_epoch"}: steps done, the epoch they end in and its batches done.
        data: the ``epoch_batches`` iterator to number (default: a new one); the loop may draw more batches from
            it between steps (DAPO's dynamic sampling), which then count as seen but not as steps.
    Yields:
        step (1-based), position {"epoch", "batch_in_epoch"} after this batch (what a checkpoint saves), and the
        batch: a dict of lists "prompt", "answer" (str) and "index" (a tensor of dataset indices).
    """
    step = start["step"]
    if step >= total_steps:
        return
    for position, batch in epoch_batches(loader, batch_sampler, start, epochs) if data is None else data:
        step += 1
        yield step, position, batch
        if step >= total_steps:
            return


def spare_batches(data, position, epochs, batch_sampler, steps_left):
    """The batches of ``data`` (an ``epoch_batches`` iterator at ``position``) a step may draw beyond its own
    while ``steps_left`` steps still get one each: an iterator of (position, batch), empty when none is spare."""
    per_epoch = len(batch_sampler.sampler) // batch_sampler.batch_size
    left = (epochs - position["epoch"]) * per_epoch - position["batch_in_epoch"]
    return itertools.islice(data, max(left - steps_left, 0))


HH_TURN_PATTERN = re.compile(r"\n\n(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def parse_hh_transcript(text):
    """An HH-RLHF transcript "\\n\\nHuman: ...\\n\\nAssistant: ..." -> [{"role", "content"}] (Bai et al. 2022).

    Human turns become "user", Assistant turns "assistant"; contents are stripped.
    Raises:
        ValueError: if the text does not start with a "\\n\\nHuman:" turn or does not end with an Assistant turn.
    """
    parts = HH_TURN_PATTERN.split(text)  # ['', 'Human', ' q', 'Assistant', ' a', ...]
    if len(parts) < 3 or parts[0].strip() or parts[1] != "Human":
        raise ValueError("an HH-RLHF transcript starts with '\\n\\nHuman:'")
    messages = [{"role": HH_ROLES[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts), 2)]
    if messages[-1]["role"] != "assistant":
        raise ValueError("an HH-RLHF transcript ends with an '\\n\\nAssistant:' turn")
    return messages


def preference_side(value):
    """One side of a preference pair (a message list or an HH-RLHF transcript) -> validated [{"role", "content"}].

    Raises:
        ValueError: if it is neither, a turn lacks string role/content, or the last turn is not the assistant's.
    """
    if isinstance(value, str):
        return parse_hh_transcript(value)
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty list of messages or an HH-RLHF transcript string")
    for turn in value:
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise ValueError("each message needs string 'role' and 'content'")
    if value[-1]["role"] != "assistant":
        raise ValueError(f"the last message is the answer and must be the assistant's, not {value[-1]['role']!r}")
    return [{"role": t["role"], "content": t["content"]} for t in value]


def read_preference_pairs(path):
    """Read preference pairs from JSONL (``.gz`` too) in either format, one pair per line:
    ``{"chosen": [messages], "rejected": [messages]}`` or HH-RLHF's ``{"chosen": "\\n\\nHuman: ...", "rejected": ...}``.

    Returns:
        list of {"chosen": [{"role", "content"}, ...], "rejected": [...]}, each ending in the assistant's answer.
    Raises:
        FileNotFoundError: if ``path`` does not exist.
        DataFormatError: naming file and line, for non-UTF-8 bytes, invalid JSON, a missing side, or a side that
            ``preference_side`` rejects.
    """
    pairs = []
    for line_no, row in iter_jsonl(path):
        if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
            raise DataFormatError(f"{path}:{line_no}: expected an object with 'chosen' and 'rejected'")
        pair = {}
        for side in ("chosen", "rejected"):
            try:
                pair[side] = preference_side(row[side])
            except ValueError as err:
                raise DataFormatError(f"{path}:{line_no}: '{side}': {err}") from err
        pairs.append(pair)
    if not pairs:
        raise DataFormatError(f"{path}: no preference pairs")
    return pairs
