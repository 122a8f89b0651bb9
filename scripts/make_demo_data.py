"""Generate the bundled demo data (deterministic): written-out arithmetic with a checkable answer.

The task: add or subtract two integers of 2 to 4 digits, posed in words in English or Chinese. The SFT
conversations show a column-by-column trace inside ``<think>...</think>`` and then the answer; the RL
prompts carry the reference answer so that ``--answer_reward_weight`` can reward correctness.

Outputs (in ``dataset/``):
    sft_data.jsonl          chat SFT conversations {"conversations": [{"role", "content"}, ...]}
    rlaif_train.jsonl       RL prompts in MiniMind's RLAIF format; the assistant turn holds the answer
    rlaif_heldout.jsonl     held-out RL prompts (disjoint problems) for scripts/eval_policy.py

Usage: python scripts/make_demo_data.py [--seed 42] [--num_sft 12000] [--num_rl 4000] [--num_heldout 300]
"""
import argparse
import json
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EN_PLACES = ["ones", "tens", "hundreds", "thousands", "ten-thousands"]
ZH_PLACES = ["个位", "十位", "百位", "千位", "万位"]

EN_ADD = [
    "What is {a} + {b}?",
    "Compute {a} plus {b}.",
    "Tom has {a} apples and buys {b} more. How many apples does he have now?",
    "A library had {a} books and received {b} new ones. How many books does it have?",
]
EN_SUB = [
    "What is {a} - {b}?",
    "Compute {a} minus {b}.",
    "Tom has {a} apples and gives away {b}. How many apples are left?",
    "A train carries {a} people and {b} get off. How many people are still on the train?",
]
ZH_ADD = [
    "计算 {a} + {b} 等于多少？",
    "{a} 加 {b} 是多少？",
    "小明有 {a} 个苹果，又买了 {b} 个，现在一共有多少个？",
    "图书馆原有 {a} 本书，新到了 {b} 本，现在有多少本？",
]
ZH_SUB = [
    "计算 {a} - {b} 等于多少？",
    "{a} 减 {b} 是多少？",
    "小明有 {a} 个苹果，送出了 {b} 个，还剩多少个？",
    "火车上有 {a} 人，下车了 {b} 人，车上还有多少人？",
]


def digits_reversed(n, width):
    """Digits of n from the ones place up, zero-padded to ``width``."""
    return [int(c) for c in str(n).zfill(width)[::-1]]


def addition_trace(a, b, lang):
    """Column addition, ones place first, as the text inside <think>."""
    width = max(len(str(a)), len(str(b)))
    da, db = digits_reversed(a, width), digits_reversed(b, width)
    carry, steps = 0, []
    for i in range(width):
        total = da[i] + db[i] + carry
        if lang == "en":
            steps.append(f"{EN_PLACES[i]}: {da[i]}+{db[i]}+{carry}={total}, write {total % 10} carry {total // 10}")
        else:
            steps.append(f"{ZH_PLACES[i]}：{da[i]}+{db[i]}+{carry}={total}，写{total % 10}进{total // 10}")
        carry = total // 10
    if lang == "en":
        return f"Add {a} and {b} column by column.\n" + ";\n".join(steps) + f".\nSo the sum is {a + b}."
    return f"把 {a} 和 {b} 逐位相加。\n" + "；\n".join(steps) + f"。\n所以和是 {a + b}。"


def subtraction_trace(a, b, lang):
    """Column subtraction with borrowing, ones place first (a >= b)."""
    width = len(str(a))
    da, db = digits_reversed(a, width), digits_reversed(b, width)
    borrow, steps = 0, []
    for i in range(width):
        diff = da[i] - db[i] - borrow
        new_borrow = 1 if diff < 0 else 0
        if lang == "en":
            steps.append(f"{EN_PLACES[i]}: {da[i]}-{db[i]}-{borrow}={diff}"
                         + (f", +10={diff + 10}, borrow 1" if new_borrow else ", borrow 0"))
        else:
            steps.append(f"{ZH_PLACES[i]}：{da[i]}-{db[i]}-{borrow}={diff}"
                         + (f"，加10得{diff + 10}，借1" if new_borrow else "，借0"))
        borrow = new_borrow
    if lang == "en":
        return f"Subtract {b} from {a} column by column.\n" + ";\n".join(steps) + f".\nSo the difference is {a - b}."
    return f"从 {a} 中逐位减去 {b}。\n" + "；\n".join(steps) + f"。\n所以差是 {a - b}。"


def make_problem(rng):
    """One random problem: (question, thinking trace, final answer text, reference answer)."""
    lang = rng.choice(["en", "zh"])
    op = rng.choice(["+", "-"])
    a = rng.randint(10, 10 ** rng.randint(2, 4) - 1)
    b = rng.randint(10, 10 ** rng.randint(2, 4) - 1)
    if op == "-" and a < b:
        a, b = b, a
    result = a + b if op == "+" else a - b
    templates = {("en", "+"): EN_ADD, ("en", "-"): EN_SUB, ("zh", "+"): ZH_ADD, ("zh", "-"): ZH_SUB}[(lang, op)]
    question = rng.choice(templates).format(a=a, b=b)
    trace = addition_trace(a, b, lang) if op == "+" else subtraction_trace(a, b, lang)
    final = f"The answer is {result}." if lang == "en" else f"答案是 {result}。"
    return question, trace, final, str(result), (a, op, b)


def write_jsonl(path, rows):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--num_sft", type=int, default=12000)
    parser.add_argument("--num_rl", type=int, default=4000)
    parser.add_argument("--num_heldout", type=int, default=300)
    parser.add_argument("--no_think_ratio", type=float, default=0.15,
                        help="share of SFT answers with an empty <think></think> block")
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "dataset"))
    args = parser.parse_args()
    rng = random.Random(args.seed)

    heldout, heldout_keys = [], set()
    while len(heldout) < args.num_heldout:
        question, _, _, answer, key = make_problem(rng)
        if key in heldout_keys:
            continue
        heldout_keys.add(key)
        heldout.append({"conversations": [{"role": "user", "content": question},
                                          {"role": "assistant", "content": answer}]})

    def fresh_problems(count):
        rows = []
        while len(rows) < count:
            problem = make_problem(rng)
            if problem[4] not in heldout_keys:
                rows.append(problem)
        return rows

    sft = []
    for question, trace, final, _, _ in fresh_problems(args.num_sft):
        think = "" if rng.random() < args.no_think_ratio else trace
        sft.append({"conversations": [{"role": "user", "content": question},
                                      {"role": "assistant", "content": f"<think>\n{think}\n</think>\n\n{final}"}]})
    rl = [{"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]}
          for q, _, _, ans, _ in fresh_problems(args.num_rl)]

    os.makedirs(args.out_dir, exist_ok=True)
    write_jsonl(os.path.join(args.out_dir, "sft_data.jsonl"), sft)
    write_jsonl(os.path.join(args.out_dir, "rlaif_train.jsonl"), rl)
    write_jsonl(os.path.join(args.out_dir, "rlaif_heldout.jsonl"), heldout)
    print(f"wrote {len(sft)} SFT, {len(rl)} RL and {len(heldout)} held-out rows to {args.out_dir}")


if __name__ == "__main__":
    main()
