"""Train the project's byte-level BPE tokenizer (vocab 6400) on the bundled corpus.

Special tokens: <|endoftext|> = 0 (pad), <|im_start|> = 1, <|im_end|> = 2 (eos), as in MiniMind;
``<think>`` and ``</think>`` are added (non-special) tokens so that decoding keeps them. Digits are
split one per token, which makes column arithmetic learnable for a small model. The chat template
follows MiniMind's: system/user/assistant turns, a ``<think>...</think>`` block in assistant turns, and
the ``open_thinking`` switch for the generation prompt (``<think>\\n`` when true, an empty think block
otherwise). With ``tools`` it renders them in the system turn, an assistant's ``tool_calls`` as
``<tool_call>`` blocks and ``tool`` turns inside ``<tool_response>`` as upstream's template does (the markers are
spelled in bytes); without tools its text is that of the think-only template (tests/test_chat_template.py).

Usage: python trainer/train_tokenizer.py [--data dataset/sft_data.jsonl] [--out_dir model]
"""

import argparse
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dataset.lm_dataset import read_conversations_jsonl
from trainer.infra.errors import run_script
from trainer.infra.files import atomic_write, check_writable_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]

TOOLS_HEADER = (  # upstream MiniMind's tools block, verbatim
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
TOOLS_FOOTER = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n"
)
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    '{{- "' + TOOLS_HEADER + '" }}'
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- "' + TOOLS_FOOTER + '" }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}"
    "{%- endif %}"
    "{%- if tools and loop.first and message.role == 'system' %}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if open_thinking is defined and open_thinking is true %}{{- '<think>\\n' }}"
    "{%- else %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def iter_texts(paths):
    """Yield every message text of the JSONL conversation files.

    Each file is read and checked whole first (``read_conversations_jsonl``), so a bad line fails before
    training with its file and line number.
    """
    for path in paths:
        for row in read_conversations_jsonl(path):
            for message in row["conversations"]:
                yield message["content"]


def train_tokenizer(paths, out_dir, vocab_size=6400):
    """Train and save ``tokenizer.json`` + ``tokenizer_config.json`` to out_dir; returns the Tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(iter_texts(paths), trainer=trainer)
    tokenizer.add_tokens(THINK_TOKENS)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, f"{token} must have id {i}"
    check_writable_dir(out_dir)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }

    def write_config(path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)

    atomic_write(
        {
            os.path.join(out_dir, "tokenizer.json"): tokenizer.save,
            os.path.join(out_dir, "tokenizer_config.json"): write_config,
        }
    )
    return tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train the byte-level BPE tokenizer")
    parser.add_argument(
        "--data",
        nargs="+",
        default=[os.path.join(ROOT, "dataset", "sft_data.jsonl"), os.path.join(ROOT, "dataset", "rlaif_train.jsonl")],
    )
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "model"))
    parser.add_argument("--vocab_size", type=int, default=6400)
    args = parser.parse_args(argv)
    for path in args.data:
        if not os.path.isfile(path):
            parser.error(f"--data {path} does not exist")
    if args.vocab_size < 256 + len(SPECIAL_TOKENS) + len(THINK_TOKENS):
        parser.error(
            f"--vocab_size must be >= {256 + len(SPECIAL_TOKENS) + len(THINK_TOKENS)} (the byte alphabet "
            f"and the special tokens), got {args.vocab_size}"
        )
    try:
        check_writable_dir(args.out_dir)
    except OSError as err:
        parser.error(f"--out_dir: {err.strerror}")
    tokenizer = train_tokenizer(args.data, args.out_dir, args.vocab_size)
    print(f"saved tokenizer with {tokenizer.get_vocab_size()} tokens to {args.out_dir}")


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
