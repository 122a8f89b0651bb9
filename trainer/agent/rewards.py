"""Agent RL's rewards: upstream MiniMind's agent reward (its trainer/train_agent.py ``calculate_rewards``), each term
a small function, summed and clipped by ``agent_reward``; ``calculate_agent_rewards`` scores a rollout's N answers.

The calls are counted once, by the rollout (``rollout.take_turn``: ``num_tool_calls``, ``num_valid_calls``); the
rewards read those counts. Without a call an answer earns the chapter's rule reward (8.3) and the reward model's score;
with calls it earns the call count's match, the ground-truth values found in the final answer, and penalties.
"""

import re

import torch

from trainer.trainer_utils import rep_penalty, rule_reward, split_thinking

TAG_PENALTY = 0.5  # per unbalanced <tool_call> / </tool_call> tag
CALL_COUNT_REWARD = 0.5  # +0.5 when the valid calls match len(gt), else -0.5 per call too many or too few
UNFINISHED_PENALTY = 0.5  # the last turn still called a tool
REWARD_CLIP = 3.0
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\w.])")
REWARD_PARTS = (
    "tag_penalty",
    "rule_reward",
    "reward_model_score",
    "call_reward",
    "answer_reward",
    "unfinished_penalty",
    "repetition_penalty",
)
REWARD_KEYS = {
    "rewards": "reward",
    "rule_rewards": "rule_reward",
    "reward_model_scores": "reward_model_score",
    "answer_rewards": "answer_reward",
    "call_rewards": "call_reward",
    "tag_penalties": "tag_penalty",
    "unfinished_penalties": "unfinished_penalty",
    "repetition_penalties": "repetition_penalty",
    "accuracy": "accuracy",
    "called": "called",
}  # calculate_agent_rewards' key -> agent_reward's


def tag_penalty(turn_answers):
    """-0.5 per unbalanced tool tag: -0.5 * sum over turns of |#'<tool_call>' - #'</tool_call>'| (upstream
    MiniMind's train_agent.py ``calculate_rewards``). turn_answers: each turn's text after '</think>'."""
    return -TAG_PENALTY * sum(abs(t.count("<tool_call>") - t.count("</tool_call>")) for t in turn_answers)


def gt_found(text, gt):
    """The ground-truth values of ``gt`` that ``text`` contains (upstream's ``validate_gt_in_text``): a value as a
    case-insensitive substring, or a number equal (within 1e-6) to a number standing alone in the text (commas
    removed). Returns a set of strings."""
    numbers = [float(n) for n in NUMBER.findall(text.replace(",", ""))]
    found = set()
    for value in gt:
        value = str(value).strip()
        plain = value.replace(",", "")
        if value and value.lower() in text.lower():
            found.add(value)
        elif re.fullmatch(r"[-+]?\d+(?:\.\d+)?", plain) and any(abs(float(plain) - n) < 1e-6 for n in numbers):
            found.add(value)
    return found


def call_count_reward(num_calls, num_valid_calls, num_gt):
    """+0.5 when the valid calls match the ground truth's count and no call is invalid, else -0.5 per unit of
    gap = |valid - len(gt)| + (calls - valid) (upstream's ``tool_gap``)."""
    gap = abs(num_valid_calls - num_gt) + max(0, num_calls - num_valid_calls)
    return CALL_COUNT_REWARD if gap == 0 else -CALL_COUNT_REWARD * gap


def gt_reward(final_text, gt, weight=2.5):
    """weight x the share of ground-truth values found in the final answer (upstream: 2.5); 0 for an empty gt."""
    return weight * len(gt_found(final_text, gt)) / len(gt) if gt else 0.0


def final_answer_text(turn_answers, unfinished):
    """The text a right answer must contain: the last turn's answer after its last '</tool_call>', "" when the
    conversation ended on a call (upstream's ``final_text``)."""
    if unfinished or not turn_answers:
        return ""
    return turn_answers[-1].split("</tool_call>")[-1]


def agent_reward(turn_texts, gt, num_calls, num_valid_calls, unfinished, reward_model_score=0.0, gt_weight=2.5):
    """One answer's reward and its parts (upstream MiniMind's train_agent.py ``calculate_rewards``), clipped to
    [-3, 3]: ``tag_penalty``; without a call the chapter's ``rule_reward`` (length, thinking, minus the
    repetition penalty; 8.3) + the reward model's score; with calls ``call_count_reward`` + ``gt_reward`` - 0.5
    when unfinished - the repetition penalty of the final text. turn_texts: the model's turns; num_calls,
    num_valid_calls: the rollout's counts over them. Departures: the no-call length window is the chapter's 20-800
    characters (upstream 5-800); a malformed call counts as an invalid call (upstream drops it). "accuracy": every
    gt value in the final text (an empty gt: no call). Returns a dict of floats (``REWARD_PARTS``, "reward",
    "accuracy", "called")."""
    turn_answers = [split_thinking(text)[1] for text in turn_texts]
    parts = dict.fromkeys(REWARD_PARTS, 0.0)
    parts["tag_penalty"] = tag_penalty(turn_answers)
    final_text = final_answer_text(turn_answers, unfinished)
    if not num_calls:
        parts["rule_reward"] = rule_reward(turn_texts[-1])
        parts["reward_model_score"] = reward_model_score
    else:
        parts["call_reward"] = call_count_reward(num_calls, num_valid_calls, len(gt))
        parts["answer_reward"] = gt_reward(final_text, gt, gt_weight)
        parts["unfinished_penalty"] = -UNFINISHED_PENALTY if unfinished else 0.0
        parts["repetition_penalty"] = -rep_penalty(final_text or turn_answers[-1])
    total = max(-REWARD_CLIP, min(REWARD_CLIP, sum(parts.values())))
    correct = len(gt_found(final_text, gt)) == len(gt) if gt else not num_calls  # empty gt: no call is right
    return dict(parts, reward=total, accuracy=float(correct), called=float(num_calls > 0))


def calculate_agent_rewards(messages, rollout, gts, reward_model, gt_weight):
    """The rewards of a rollout's N answers (``agent_reward``); the reward model scores the answers without a call
    in one batch (as upstream, which scores those only). messages: N prompt conversations; rollout: the
    ``AgentRolloutResult`` (its ``turn_texts``, ``unfinished``, ``num_tool_calls``, ``num_valid_calls`` are read);
    gts: N lists. Returns a dict of float32 tensors [N]: "rewards" and "rule_rewards", "reward_model_scores",
    "answer_rewards" (the gt reward), "call_rewards", the penalties, "accuracy" and "called" (0/1)."""
    num_calls, num_valid = rollout.num_tool_calls.tolist(), rollout.num_valid_calls.tolist()
    no_call = [i for i, calls in enumerate(num_calls) if not calls]
    scores = [0.0] * len(num_calls)
    if reward_model is not None and no_call:
        prompts = [[{"role": t["role"], "content": t["content"]} for t in messages[i]] for i in no_call]
        for i, score in zip(no_call, reward_model.get_scores(prompts, [rollout.turn_texts[i][-1] for i in no_call])):
            scores[i] = score
    rows = [
        agent_reward(texts, gt, calls, valid, bool(done), score, gt_weight)
        for texts, gt, calls, valid, done, score in zip(
            rollout.turn_texts, gts, num_calls, num_valid, rollout.unfinished.tolist(), scores
        )
    ]
    return {name: torch.tensor([row[key] for row in rows], dtype=torch.float32) for name, key in REWARD_KEYS.items()}
