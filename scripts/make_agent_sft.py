"""Write the copy-rich agent SFT data that makes the agent RL start ``out/agent_copy_256.pth`` (docs/agent.md).

A right answer to the agent task needs two copies: the question's expression into the ``calculate_math`` call,
and the calculator's reply into the answer. A small model learns to copy only where the position of what it copies
varies; where every row has one layout it learns the layout's offsets instead. So each row here is a conversation
of 1-4 agent problems in a row (``scripts/make_demo_data.py``'s task, phrasings and calculator replies), each
answered with a call, the reply and the answer, or at once, and:

- with probability ``--tools_share`` the row opens with the system turn carrying the calculator's schema (the RL
  prompts' layout; 1-2 problems, so it fits 1024 tokens);
- otherwise the schema is left out, a plain system line stands in front with probability 1/2, and before each
  problem, with probability 1/2, 1-3 of the chapter's SFT conversations (``dataset/sft_data.jsonl``) sit as earlier
  turns: the distance between a number and its copy changes from row to row, and earlier problems' digits stand
  in the context.

The first problem of a row calls the calculator with probability ``--first_call_ratio`` (the choice RL then
shapes), later ones with ``--later_call_ratio``. No problem of ``dataset/agent_rl_{train,val,test}.jsonl`` appears.
Deterministic for a given seed; the rows are in upstream's conversation format (``tools`` on the system turn).

Usage: python scripts/make_agent_sft.py [--out dataset/agent_copy_sft.jsonl] [--num_rows 30000] [--seed 11]
"""

import argparse
import json
import os
import random
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from make_demo_data import AGENT_SYSTEM, agent_final, agent_prompt, make_agent_problem, write_jsonl  # noqa: E402

from dataset.lm_dataset import iter_jsonl  # noqa: E402
from trainer.agent.tools import execute_tool  # noqa: E402

EXPRESSION = re.compile(r"\d+(?: [-+*] \d+)+")  # the arithmetic of a question, as make_agent_problem writes it
RL_FILES = ("agent_rl_train.jsonl", "agent_rl_val.jsonl", "agent_rl_test.jsonl")


def problem_turns(problem, call_tool):
    """The turns of one problem: the question, then a calculator call, its reply and the answer, or the answer."""
    lang, question, expression, answer = problem
    turns = [{"role": "user", "content": question}]
    if call_tool:
        arguments = {"expression": expression}
        call = json.dumps({"name": "calculate_math", "arguments": arguments}, ensure_ascii=False)
        turns += [
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": execute_tool("calculate_math", arguments)},
        ]
    return turns + [{"role": "assistant", "content": agent_final(lang, answer)}]


def copy_rich_row(rng, draw_problem, chat_rows, tools_share, first_call_ratio, later_call_ratio):
    """One conversation of the mix (module docstring). draw_problem(): a fresh agent problem; chat_rows: the
    chapter's SFT conversations (lists of turns)."""
    with_tools = rng.random() < tools_share
    problems = [draw_problem() for _ in range(rng.randint(1, 2 if with_tools else 4))]
    lang = problems[0][0]
    if with_tools:
        turns = agent_prompt(lang, problems[0][1])[:1]  # the system turn with the schema
    else:
        turns = [{"role": "system", "content": AGENT_SYSTEM[lang]}] if rng.random() < 0.5 else []
    for index, problem in enumerate(problems):
        if not with_tools and rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                turns += [dict(turn) for turn in rng.choice(chat_rows) if turn["role"] != "system"]
        turns += problem_turns(problem, rng.random() < (first_call_ratio if index == 0 else later_call_ratio))
    return {"conversations": turns}


def rl_expressions(dataset_dir):
    """The expressions of every agent RL prompt (the first user turn's arithmetic), kept out of the SFT rows."""
    seen = set()
    for name in RL_FILES:
        path = os.path.join(dataset_dir, name)
        for _, row in iter_jsonl(path):
            question = next(turn["content"] for turn in row["conversations"] if turn["role"] == "user")
            seen.update(EXPRESSION.findall(question))
    return seen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "dataset", "agent_copy_sft.jsonl"))
    parser.add_argument("--num_rows", type=int, default=30000)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--tools_share",
        type=float,
        default=0.25,
        help="share of rows that open with the calculator's schema (the RL prompts' layout)",
    )
    parser.add_argument(
        "--first_call_ratio",
        type=float,
        default=0.6,
        help="share of a row's first problems answered with a calculator call",
    )
    parser.add_argument(
        "--later_call_ratio",
        type=float,
        default=0.85,
        help="share of a row's later problems answered with a calculator call",
    )
    parser.add_argument("--dataset_dir", default=os.path.join(ROOT, "dataset"))
    args = parser.parse_args(argv)
    for flag in ("tools_share", "first_call_ratio", "later_call_ratio"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            parser.error(f"--{flag} must be in [0, 1], got {getattr(args, flag)}")
    if args.num_rows < 1:
        parser.error(f"--num_rows must be >= 1, got {args.num_rows}")
    chat_rows = [row["conversations"] for _, row in iter_jsonl(os.path.join(args.dataset_dir, "sft_data.jsonl"))]
    held = rl_expressions(args.dataset_dir)
    rng = random.Random(args.seed)

    def draw_problem():
        while True:
            problem = make_agent_problem(rng)
            if problem[2] not in held:
                return problem

    rows = [
        copy_rich_row(rng, draw_problem, chat_rows, args.tools_share, args.first_call_ratio, args.later_call_ratio)
        for _ in range(args.num_rows)
    ]
    write_jsonl(args.out, rows)
    print(f"wrote {len(rows)} conversations to {args.out}")


if __name__ == "__main__":
    main()
