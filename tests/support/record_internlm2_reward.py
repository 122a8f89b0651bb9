"""Record upstream MiniMind's reward-model scores of the tiny internlm2 reward folder, under transformers 4.57.

Runs upstream's own code, not this project's: upstream MiniMind's ``LMForRewardModel`` (trainer/trainer_utils.py)
and the ``calculate_rewards`` of its trainer/train_grpo.py and trainer/train_ppo.py, on the folder that
``tests/support/tiny_internlm2_reward.py`` builds from ``../shared/compat/internlm2-1_8b-reward/`` (the published
remote code ``modeling_internlm2.py`` and tokenizer run as published: ``trust_remote_code=True``). The result,
``tests/support/reference_internlm2_reward.json``, is what ``tests/test_internlm2_reward.py`` compares this project
with.

How the committed file was made (a throwaway venv outside the repository; protobuf because transformers 4.57's
AutoTokenizer builds the remote fast tokenizer from tokenizer.model with it; huggingface-hub < 1 for 4.57):

    python -m venv /tmp/tf457
    /tmp/tf457/bin/pip install torch==2.13.0 transformers==4.57.6 sentencepiece einops protobuf \\
        "huggingface-hub<1.0" "datasets<4" requests
    git clone https://github.com/jingyaogong/minimind /tmp/minimind
    git -C /tmp/minimind checkout d65ef2c00ebc6082f9df11541e1b191655eddb00   # the commit the file was recorded at
    /tmp/tf457/bin/python tests/support/record_internlm2_reward.py --minimind /tmp/minimind \\
        --out tests/support/reference_internlm2_reward.json
"""

import argparse
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCE = os.path.join(os.path.dirname(ROOT), "shared", "compat", "internlm2-1_8b-reward")


def chat_prompt(turns):
    """A prompt in the chat format of MiniMind's RLAIFDataset: closed turns, then the open assistant turn."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"


# GRPO cases: 2 prompts x 3 generations; PPO cases: one answer per prompt
PROMPTS = [
    chat_prompt([("user", "What is 2 + 3?")]),
    chat_prompt(
        [
            ("system", "You are a helpful assistant."),
            ("user", "Hi"),
            ("assistant", "Hello!"),
            ("user", "请计算 12 * 3，并说明理由。"),
        ]
    ),
]
RESPONSES = [
    " The answer is 5.\n",  # no </think>: upstream scores it with its spaces
    "<think>\nadd the ones: 2 + 3 = 5\n</think>\n\nThe answer is 5.",
    "5",
    "12 * 3 = 36。答案是 36。  ",
    "<think>\n十二乘三\n</think>\n  答案：36\n",
    "Let me think.</think>36</think> again",
]
NUM_GENERATIONS = 3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minimind", required=True, help="a checkout of jingyaogong/minimind")
    parser.add_argument("--source", default=SOURCE, help="the published internlm2-1_8b-reward files")
    parser.add_argument("--out", default=os.path.join(HERE, "reference_internlm2_reward.json"))
    opts = parser.parse_args()

    sys.path.insert(0, HERE)
    from tiny_internlm2_reward import build_tiny_internlm2_reward, weights_digest

    sys.path.insert(0, os.path.abspath(opts.minimind))  # upstream's packages: trainer, model, dataset
    import torch
    import transformers
    from trainer import train_grpo, train_ppo
    from trainer.trainer_utils import LMForRewardModel

    folder = build_tiny_internlm2_reward(opts.source, os.path.join(tempfile.mkdtemp(), "tiny_reward"))
    reward_model = LMForRewardModel(folder, device="cpu", dtype=torch.float32)  # upstream's class
    prompts_grpo = [p for p in PROMPTS for _ in range(NUM_GENERATIONS)]
    record = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "weights_sha256": weights_digest(folder),
        "dtype": "float32",
        "prompts": PROMPTS,
        "responses": RESPONSES,
        "num_generations": NUM_GENERATIONS,
    }

    # upstream's GRPO and PPO rewards (rule parts + the clipped reward-model score); they read a global ``args``
    train_grpo.args = argparse.Namespace(device="cpu", num_generations=NUM_GENERATIONS)
    record["grpo_rewards"] = train_grpo.calculate_rewards(PROMPTS, RESPONSES, reward_model).tolist()
    train_ppo.args = argparse.Namespace(device="cpu")
    record["ppo_rewards"] = train_ppo.calculate_rewards(prompts_grpo, RESPONSES, reward_model).tolist()

    # the reward-model part alone: upstream's LMForRewardModel.get_score on upstream's answer text
    answers = [r.split("</think>", 1)[1].strip() if "</think>" in r else r for r in RESPONSES]  # as calculate_rewards
    turn = re.compile(r"<\|im_start\|>(system|user|assistant)\s+(.*?)<\|im_end\|>", re.DOTALL)  # upstream's
    messages = [[{"role": role, "content": content.strip()} for role, content in turn.findall(p)] for p in prompts_grpo]
    record["reward_model_scores"] = [reward_model.get_score(m, a) for m, a in zip(messages, answers)]

    # upstream's own precision, float16 (its LMForRewardModel's default)
    half_model = LMForRewardModel(folder, device="cpu", dtype=torch.float16)
    record["grpo_rewards_float16"] = train_grpo.calculate_rewards(PROMPTS, RESPONSES, half_model).tolist()
    record["reward_model_scores_float16"] = [half_model.get_score(m, a) for m, a in zip(messages, answers)]

    # the remote model's own calls on the conversations that upstream builds (unclipped)
    tokenizer, model = reward_model.tokenizer, reward_model.model
    history = "\n".join(f"{m['role']}: {m['content']}" for m in messages[3][:-1])
    conversations = [
        [{"role": "user", "content": messages[0][-1]["content"]}, {"role": "assistant", "content": answers[0]}],
        [
            {"role": "user", "content": f"{history}\n以上是对话历史。我的新问题是：\n{messages[3][-1]['content']}"},
            {"role": "assistant", "content": answers[3]},
        ],
    ]
    record["conversations"] = conversations
    record["conversation_ids"] = [
        tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False), add_special_tokens=False)
        for c in conversations
    ]
    record["get_score"] = [model.get_score(tokenizer, c) for c in conversations]
    record["get_scores_two"] = model.get_scores(tokenizer, conversations)
    record["get_scores_one"] = model.get_scores(tokenizer, conversations[:1])  # a bare float
    with open(opts.out, "w", encoding="utf-8") as f:
        json.dump(record, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(json.dumps(record, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
