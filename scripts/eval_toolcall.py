"""Greedy tool use and accuracy of a checkpoint on agent prompts, rolled out by trainer/agent/rollout.py.

One greedy multi-turn answer to each of the first --num_prompts rows of --data_path (upstream's agent format:
tools on the system turn, ``gt``), the calculator and the other registered tools answering its calls. Prints one
JSON line: called (share of answers with a <tool_call>), with_valid_call (share of answers with at least one valid
call), valid (share of calls to an offered tool with arguments that pass check_arguments), correct (share whose
final turn calls nothing and holds every ``gt`` value as a whole number or text), the same split by answers that
called and did not, turns per answer.

Greedy by default; ``--seeds 1 2`` adds one sampled answer per prompt and seed (at ``--temperature``), one line
each. ``--no_tools`` renders the same questions without the tools block (the chapter's models answer in their head).

Usage: python scripts/eval_toolcall.py [--weight agent_copy] [--data_path dataset/agent_rl_val.jsonl]
       [--num_prompts 200] [--seeds 1 2] [--no_tools]
"""

import argparse
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from dataset.lm_dataset import iter_jsonl, prompt_turns
from trainer.agent.rollout import agent_rollout
from trainer.infra.errors import run_script
from trainer.infra.weights import DEFAULT_SAVE_DIR, build_config, init_model


class Greedy(torch.nn.Module):
    """The policy with greedy ``generate`` (agent_rollout samples; this picks each most likely token)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def generate(self, input_ids, **kwargs):
        return self.model.generate(input_ids, **dict(kwargs, do_sample=False))


def holds(answer, value):
    """``value`` appears in ``answer``, a number not inside a longer number."""
    return re.search(rf"(?<![\d.\-]){re.escape(value)}(?!\d|\.\d)", answer) is not None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weight", default="agent_copy", help="the agent RL start (default: train_agent.py's)")
    parser.add_argument("--save_dir", default=DEFAULT_SAVE_DIR)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--data_path", default=os.path.join(ROOT, "dataset", "agent_rl_val.jsonl"))
    parser.add_argument("--num_prompts", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=50)
    parser.add_argument("--max_new_tokens", type=int, default=160, help="per model turn")
    parser.add_argument("--max_total_len", type=int, default=1280)
    parser.add_argument("--max_turns", type=int, default=3)
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="*",
        default=[],
        help="also sample one answer per prompt at --temperature with each of these seeds",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--no_tools",
        action="store_true",
        help="drop the tools from the system turns: the same questions answered without a tool",
    )
    args = parser.parse_args(argv)
    model, tokenizer = init_model(build_config(args.hidden_size, args.num_hidden_layers, 0), args.weight, args.save_dir)
    model.eval()
    rows = [row for _, row in iter_jsonl(args.data_path)][: args.num_prompts]
    if args.no_tools:
        rows = [
            dict(row, conversations=[{k: v for k, v in turn.items() if k != "tools"} for turn in row["conversations"]])
            for row in rows
        ]
    suffix = ", no tools" if args.no_tools else ""
    evaluate(Greedy(model), tokenizer, rows, args, "greedy" + suffix, None)
    for seed in args.seeds:
        evaluate(model, tokenizer, rows, args, f"sampled seed {seed}{suffix}", torch.Generator().manual_seed(seed))


def evaluate(policy, tokenizer, rows, args, mode, generator):
    """Answer every row once with ``policy`` (greedy, or sampled from ``generator``); print the JSON line."""
    start = time.time()
    stats = {"called": [], "called_validly": [], "valid_calls": 0, "calls": 0, "correct": [], "turns": 0}
    for first in range(0, len(rows), args.batch_size):
        batch = rows[first : first + args.batch_size]
        result = agent_rollout(
            policy,
            tokenizer,
            [prompt_turns(row["conversations"]) for row in batch],
            1,
            max_new_tokens=args.max_new_tokens,
            max_total_len=args.max_total_len,
            max_turns=args.max_turns,
            temperature=args.temperature,
            generator=generator,
        )
        for n, row in enumerate(batch):
            stats["called"].append(int(result.num_tool_calls[n]) > 0)
            stats["called_validly"].append(int(result.num_valid_calls[n]) > 0)
            stats["calls"] += int(result.num_tool_calls[n])
            stats["valid_calls"] += int(result.num_valid_calls[n])
            stats["turns"] += int(result.num_turns[n])
            answer = result.final_answers[n]
            stats["correct"].append(not result.unfinished[n] and all(holds(answer, str(v)) for v in row["gt"]))
    called, correct, count = stats["called"], stats["correct"], len(rows)

    def share(flags):
        return round(sum(flags) / len(flags), 3) if flags else None

    print(
        json.dumps(
            {
                "weight": args.weight,
                "mode": mode,
                "prompts": count,
                "called": share(called),
                "with_valid_call": share(stats["called_validly"]),
                "valid": round(stats["valid_calls"] / stats["calls"], 3) if stats["calls"] else None,
                "correct": share(correct),
                "correct_when_called": share([c for c, t in zip(correct, called) if t]),
                "correct_without_call": share([c for c, t in zip(correct, called) if not t]),
                "turns_per_answer": round(stats["turns"] / count, 3),
                "seconds": round(time.time() - start),
            }
        )
    )


if __name__ == "__main__":
    run_script(main)  # a user's mistake ends in one line naming it; a bug keeps its traceback
