"""The copy-curriculum SFT mix of docs/agent.md: the agent SFT rows plus column-trace rows in other layouts.

Each of ``--num_trace`` rows is a ``sft_data`` conversation whose answer restates the question in a column trace,
behind 0-4 other ``sft_data`` conversations (earlier turns) and, with probability 0.5, a system turn carrying the
calculator's tools; then every row of ``--agent_sft``; shuffled. The trace rows put the copy the chapter's model
makes in its own short layout at other positions and behind the tools block
(``scripts/agent_copy_study/copy_probe.py`` measures it). Train it with
``trainer/train_full_sft.py --data_path OUT --max_seq_len 1024``.

Usage: python scripts/agent_copy_study/make_copy_mix.py --out /tmp/copy_mix.jsonl [--seed 0] [--num_trace 2000]
"""

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from dataset.lm_dataset import iter_jsonl
from trainer.infra.files import atomic_write


def copy_mix(sft_rows, agent_rows, num_trace, rng):
    """The shuffled rows: ``num_trace`` trace conversations in new layouts, then the agent rows (see the module)."""
    sft = [row["conversations"] for row in sft_rows]
    trace = [conversation for conversation in sft if ", ones first" in conversation[-1]["content"]]
    tools = next(turn["tools"] for row in agent_rows for turn in row["conversations"] if turn.get("tools"))
    rows = []
    for _ in range(num_trace):
        conversation = []
        for _ in range(rng.randint(0, 4)):
            conversation += rng.choice(sft)
        conversation += rng.choice(trace)
        if rng.random() < 0.5:
            system = rng.choice(["You are a helpful assistant.", "你是一个有用的助手。"])
            conversation = [{"role": "system", "content": system, "tools": tools}] + conversation
        rows.append({"conversations": conversation})
    rows += agent_rows
    rng.shuffle(rows)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sft_data", default=os.path.join(ROOT, "dataset", "sft_data.jsonl"))
    parser.add_argument("--agent_sft", default=os.path.join(ROOT, "dataset", "agent_sft.jsonl"))
    parser.add_argument("--num_trace", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = copy_mix(
        [row for _, row in iter_jsonl(args.sft_data)],
        [row for _, row in iter_jsonl(args.agent_sft)],
        args.num_trace,
        random.Random(args.seed),
    )

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)

    atomic_write({args.out: write})
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
