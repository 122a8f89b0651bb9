"""Generate the bundled demo data (deterministic): written-out arithmetic with a checkable answer.

The task: add or subtract two integers of 2 or 3 digits, posed in words in English or Chinese. The SFT
conversations show a column-by-column trace inside ``<think>...</think>`` and then the answer; the RL
prompts carry the reference answer so that ``--answer_reward_weight`` can reward correctness.

Outputs (in ``dataset/``):
    sft_data.jsonl          chat SFT conversations {"conversations": [{"role", "content"}, ...]}
    rlaif_train.jsonl       RL prompts in MiniMind's RLAIF format; the assistant turn holds the answer
    rlaif_heldout.jsonl     held-out RL prompts (disjoint problems) for scripts/eval_policy.py
    rlaif_val.jsonl         validation prompts: the periodic evaluation of both RL scripts, and choosing settings
    rlaif_test.jsonl        test prompts: the README's results table, never used to choose a setting
    reward_train.jsonl      preference pairs {"chosen": [messages], "rejected": [messages]} for
                            trainer/train_reward.py: correct vs wrong answer, well-formed vs broken <think>
                            format, concise vs repetitive answer
    reward_heldout.jsonl    held-out preference pairs (problems disjoint from the training pairs)
    agent_rl_{train,val,test}.jsonl  the agent task in upstream MiniMind's agent RL format: a system turn carrying
                            the calculate_math schema as ``tools`` (a JSON string), the question, the answer; ``gt``
    agent_sft.jsonl         agent SFT conversations: some call the calculator (a <tool_call> turn, the tool's
                            reply from agent.tools.execute_tool, the answer), the others answer at once

The pairs come from their own random stream (seed + 1), the validation and test prompts from another
(seed + 2) and the agent task from a fourth (seed + 3), so each leaves the other files unchanged. Validation and
test problems are disjoint from each other and from every problem of every other file; the agent files' problems
are disjoint from each other's.
The agent task: 3-4 integers of 3-4 digits joined by + - and at most one *, with a non-negative value (up to
about 10**8): beyond the mental arithmetic of a small model, one calculator call away.

Usage: python scripts/make_demo_data.py [--seed 42] [--num_sft 12000] [--num_rl 4000] [--num_heldout 300]
       [--num_pairs 2000] [--num_heldout_pairs 200] [--num_val 500] [--num_test 1000] [--num_agent_train 2000]
       [--num_agent_val 500] [--num_agent_test 500] [--num_agent_sft 2000] [--agent_tool_ratio 0.5]
"""

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `python scripts/x.py` from any folder imports this checkout's packages

from trainer.agent.tools import calculate, execute_tool, tool_schemas
from trainer.infra.files import atomic_write


EN_ADD = [
    "What is {a} + {b}?",
    "Compute {a} plus {b}.",
    "Tom has {a} apples and buys {b} more. How many now?",
]
EN_SUB = [
    "What is {a} - {b}?",
    "Compute {a} minus {b}.",
    "Tom has {a} apples and gives away {b}. How many are left?",
]
ZH_ADD = [
    "计算 {a} + {b} 等于多少？",
    "{a} 加 {b} 是多少？",
    "小明有 {a} 个苹果，又买了 {b} 个，一共多少个？",
]
ZH_SUB = [
    "计算 {a} - {b} 等于多少？",
    "{a} 减 {b} 是多少？",
    "小明有 {a} 个苹果，送出了 {b} 个，还剩多少个？",
]


def digits_reversed(n, width):
    """Digits of n from the ones place up, zero-padded to ``width``."""
    return [int(c) for c in str(n).zfill(width)[::-1]]


def addition_trace(a, b, lang):
    """Column addition, ones place first, as the text inside <think>: one 'x+y+carry=s' step per column."""
    width = max(len(str(a)), len(str(b)))
    da, db = digits_reversed(a, width), digits_reversed(b, width)
    carry, steps = 0, []
    for i in range(width):
        total = da[i] + db[i] + carry
        steps.append(f"{da[i]}+{db[i]}+{carry}={total}")
        carry = total // 10
    head = f"{a} + {b}" if lang == "en" else f"{a} 加 {b}"
    tail = f"so the sum is {a + b}." if lang == "en" else f"所以和是 {a + b}。"
    return f"{head}, ones first:\n" + "\n".join(steps) + f"\n{tail}"


def subtraction_trace(a, b, lang):
    """Column subtraction with borrowing, ones place first (a >= b): 'x-y-borrow=d' (+10 when d < 0)."""
    width = len(str(a))
    da, db = digits_reversed(a, width), digits_reversed(b, width)
    borrow, steps = 0, []
    for i in range(width):
        diff = da[i] - db[i] - borrow
        steps.append(f"{da[i]}-{db[i]}-{borrow}={diff}" + (f"+10={diff + 10}" if diff < 0 else ""))
        borrow = 1 if diff < 0 else 0
    head = f"{a} - {b}" if lang == "en" else f"{a} 减 {b}"
    tail = f"so the difference is {a - b}." if lang == "en" else f"所以差是 {a - b}。"
    return f"{head}, ones first:\n" + "\n".join(steps) + f"\n{tail}"


def make_problem(rng):
    """One random problem: (question, thinking trace, final answer text, reference answer)."""
    lang = rng.choice(["en", "zh"])
    op = rng.choice(["+", "-"])
    a = rng.randint(10, 10 ** rng.randint(2, 3) - 1)
    b = rng.randint(10, 10 ** rng.randint(2, 3) - 1)
    if op == "-" and a < b:
        a, b = b, a
    result = a + b if op == "+" else a - b
    templates = {("en", "+"): EN_ADD, ("en", "-"): EN_SUB, ("zh", "+"): ZH_ADD, ("zh", "-"): ZH_SUB}[(lang, op)]
    question = rng.choice(templates).format(a=a, b=b)
    trace = addition_trace(a, b, lang) if op == "+" else subtraction_trace(a, b, lang)
    final = f"The answer is {result}." if lang == "en" else f"答案是 {result}。"
    return question, trace, final, str(result), (a, op, b)


def wrong_result(result, rng):
    """A plausible wrong answer: off by one digit's worth (a dropped carry or borrow, a slip in the ones), never
    the result itself, never negative."""
    while True:
        wrong = result + rng.choice([-100, -10, 10, 100, -1, 1, -2, 2, rng.randint(-50, 50)])
        if wrong != result and wrong >= 0:
            return wrong


def preference_pair(problem, rng):
    """One preference pair for a problem: the chosen answer is the SFT format (trace in <think>, then the
    correct answer); the rejected one, drawn at random (half of the pairs are the first kind):
      wrong:      the same trace, a wrong final number;
      format:     no '</think>' (the trace leaks into the answer) or nothing after '</think>';
      repetitive: the final sentence repeated 3-6 times.
    Returns {"chosen": [user, assistant], "rejected": [user, assistant]}.
    """
    question, trace, final, answer, _ = problem
    think = f"<think>\n{trace}\n</think>\n\n"
    kind = rng.choice(["wrong", "wrong", "format", "repetitive"])
    if kind == "wrong":
        rejected = think + final.replace(answer, str(wrong_result(int(answer), rng)))
    elif kind == "format":
        rejected = rng.choice([f"<think>\n{trace}\n\n{final}", f"{trace}\n\n{final}", think])
    else:
        rejected = think + " ".join([final] * rng.randint(3, 6))
    user = {"role": "user", "content": question}
    return {
        "chosen": [user, {"role": "assistant", "content": think + final}],
        "rejected": [user, {"role": "assistant", "content": rejected}],
    }


AGENT_EN = [
    "What is {e}?",
    "Compute {e}.",
    "Calculate {e} exactly.",
]
AGENT_ZH = [
    "计算 {e} 等于多少？",
    "{e} 是多少？",
    "帮我算一下 {e} 是多少",
]
AGENT_SYSTEM = {"en": "You are a helpful assistant.", "zh": "你是一个有用的助手。"}
AGENT_TOOLS = json.dumps(tool_schemas(["calculate_math"]), ensure_ascii=False)  # the system turn's ``tools``


def make_agent_problem(rng):
    """One agent problem: (language, question, expression, answer text); the value is agent.tools.calculate's."""
    while True:
        numbers = [rng.randint(100, 9999) for _ in range(rng.randint(3, 4))]
        ops = []
        for _ in numbers[1:]:
            ops.append(rng.choice("+-" if "*" in ops else "+-*"))
        expression = " ".join([str(numbers[0])] + [f"{op} {n}" for op, n in zip(ops, numbers[1:])])
        value = calculate(expression)
        if value >= 0:
            break
    lang = rng.choice(["en", "zh"])
    question = rng.choice(AGENT_EN if lang == "en" else AGENT_ZH).format(e=expression)
    return lang, question, expression, str(value)


def agent_final(lang, answer):
    return f"The answer is {answer}." if lang == "en" else f"答案是 {answer}。"


def agent_prompt(lang, question):
    """The prompt turns of an agent row: the system turn with the calculator's schema, then the question."""
    return [
        {"role": "system", "content": AGENT_SYSTEM[lang], "tools": AGENT_TOOLS},
        {"role": "user", "content": question},
    ]


def agent_rl_row(problem):
    """An agent RL row in upstream's format: prompt turns, the reference answer turn and ``gt``."""
    lang, question, _, answer = problem
    final = {"role": "assistant", "content": agent_final(lang, answer)}
    return {"conversations": agent_prompt(lang, question) + [final], "gt": [answer]}


def agent_sft_row(problem, call_tool):
    """An agent SFT conversation: a calculator call, the tool's reply and the answer, or the answer at once."""
    lang, question, expression, answer = problem
    turns = agent_prompt(lang, question)
    if call_tool:
        arguments = {"expression": expression}
        call = json.dumps({"name": "calculate_math", "arguments": arguments}, ensure_ascii=False)
        turns += [
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": execute_tool("calculate_math", arguments)},
        ]
    return {"conversations": turns + [{"role": "assistant", "content": agent_final(lang, answer)}]}


def agent_rows(args):
    """(train, val, test RL rows, SFT rows) of the agent task, disjoint problems, from the stream seed + 3."""
    rng = random.Random(args.seed + 3)
    counts = [args.num_agent_test, args.num_agent_val, args.num_agent_train, args.num_agent_sft]
    problems, seen = [], set()
    while len(problems) < sum(counts):
        problem = make_agent_problem(rng)
        if problem[2] not in seen:
            seen.add(problem[2])
            problems.append(problem)
    test, val, train, sft = (problems[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(4))
    sft_rows = [agent_sft_row(problem, rng.random() < args.agent_tool_ratio) for problem in sft]
    return [agent_rl_row(p) for p in train], [agent_rl_row(p) for p in val], [agent_rl_row(p) for p in test], sft_rows


def write_jsonl(path, rows):
    """Rows as JSON lines at ``path`` (``atomic_write``)."""

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    atomic_write({path: write})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--num_sft", type=int, default=12000)
    parser.add_argument("--num_rl", type=int, default=4000)
    parser.add_argument("--num_heldout", type=int, default=300)
    parser.add_argument("--num_pairs", type=int, default=2000, help="reward-model training pairs")
    parser.add_argument("--num_heldout_pairs", type=int, default=200)
    parser.add_argument("--num_val", type=int, default=500, help="validation prompts (choosing settings)")
    parser.add_argument("--num_test", type=int, default=1000, help="test prompts (reported results)")
    parser.add_argument("--num_agent_train", type=int, default=2000, help="agent RL training prompts")
    parser.add_argument("--num_agent_val", type=int, default=500)
    parser.add_argument("--num_agent_test", type=int, default=500)
    parser.add_argument("--num_agent_sft", type=int, default=2000, help="agent SFT conversations")
    parser.add_argument(
        "--agent_tool_ratio", type=float, default=0.5, help="share of agent SFT conversations that call the calculator"
    )
    parser.add_argument(
        "--no_think_ratio", type=float, default=0.1, help="share of SFT answers with an empty <think></think> block"
    )
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "dataset"))
    args = parser.parse_args()
    rng = random.Random(args.seed)

    heldout, heldout_keys = [], set()
    while len(heldout) < args.num_heldout:
        question, _, _, answer, key = make_problem(rng)
        if key in heldout_keys:
            continue
        heldout_keys.add(key)
        heldout.append(
            {"conversations": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        )

    used_keys = set(heldout_keys)  # every problem written anywhere, for the validation and test sets

    def fresh_problems(count):
        rows = []
        while len(rows) < count:
            problem = make_problem(rng)
            if problem[4] not in heldout_keys:
                rows.append(problem)
                used_keys.add(problem[4])
        return rows

    sft = []
    for question, trace, final, _, _ in fresh_problems(args.num_sft):
        think = "" if rng.random() < args.no_think_ratio else trace
        sft.append(
            {
                "conversations": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": f"<think>\n{think}\n</think>\n\n{final}"},
                ]
            }
        )
    rl = [
        {"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]}
        for q, _, _, ans, _ in fresh_problems(args.num_rl)
    ]

    pair_rng = random.Random(args.seed + 1)
    pair_problems, pair_keys = [], set(heldout_keys)  # no pair on the policy's held-out problems
    while len(pair_problems) < args.num_pairs + args.num_heldout_pairs:
        problem = make_problem(pair_rng)
        if problem[4] not in pair_keys:
            pair_keys.add(problem[4])
            pair_problems.append(problem)
    pairs = [preference_pair(problem, pair_rng) for problem in pair_problems]
    used_keys |= pair_keys

    eval_rng = random.Random(args.seed + 2)
    eval_rows = []
    while len(eval_rows) < args.num_val + args.num_test:
        question, _, _, answer, key = make_problem(eval_rng)
        if key not in used_keys:
            used_keys.add(key)
            eval_rows.append(
                {"conversations": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            )

    os.makedirs(args.out_dir, exist_ok=True)
    write_jsonl(os.path.join(args.out_dir, "sft_data.jsonl"), sft)
    write_jsonl(os.path.join(args.out_dir, "rlaif_train.jsonl"), rl)
    write_jsonl(os.path.join(args.out_dir, "rlaif_heldout.jsonl"), heldout)
    write_jsonl(os.path.join(args.out_dir, "reward_train.jsonl"), pairs[: args.num_pairs])
    write_jsonl(os.path.join(args.out_dir, "reward_heldout.jsonl"), pairs[args.num_pairs :])
    write_jsonl(os.path.join(args.out_dir, "rlaif_val.jsonl"), eval_rows[: args.num_val])
    write_jsonl(os.path.join(args.out_dir, "rlaif_test.jsonl"), eval_rows[args.num_val :])
    agent_train, agent_val, agent_test, agent_sft = agent_rows(args)
    for name, rows in [
        ("agent_rl_train", agent_train),
        ("agent_rl_val", agent_val),
        ("agent_rl_test", agent_test),
        ("agent_sft", agent_sft),
    ]:
        write_jsonl(os.path.join(args.out_dir, f"{name}.jsonl"), rows)
    print(
        f"wrote {len(sft)} SFT, {len(rl)} RL, {len(heldout)} held-out rows, {args.num_pairs} + "
        f"{args.num_heldout_pairs} preference pairs, {args.num_val} validation and {args.num_test} test prompts "
        f"to {args.out_dir}; agent task: {len(agent_train)} + {len(agent_val)} + {len(agent_test)} RL prompts, "
        f"{len(agent_sft)} SFT conversations"
    )


if __name__ == "__main__":
    main()
