"""What both RL scripts share from the chapter, in its order: the rewards of 8.3 (rule reward, repetition penalty,
answer reward, the external reward model and its conversation, ``calculate_rewards``) and the KL and masks of 8.6
(the completion mask, masked means and the statistics PPO logs from them, the k3 estimator).

Everything that is not in the chapter (processes, flags, weights and checkpoints on disk, dtypes, the optimizer,
metrics) lives in modules named for it, which a learner can skip. Nothing here reads a global: every function takes what
it needs as arguments.
"""
import json
import os
import re

import torch
from transformers import AutoTokenizer

from trainer.infra.internlm2_reward import (
    InternLM2RewardModel, InternLM2RewardTokenizer, is_internlm2_reward, require_sentencepiece,
)


# ----------------------------------------------------------------------------- rewards (chapter 8.3)


def rep_penalty(text, n=3, cap=0.5):
    """n-gram repetition penalty of MiniMind's reward (chapter 8.3), in [0, cap].

    Words and punctuation marks (regex ``\\w+|[^\\w\\s]``, lower-cased) form n-grams; the penalty is
    min(cap, 2 * cap * (#n-grams - #distinct n-grams) / #n-grams), 0 for text with fewer than n tokens.
    """
    tokens = re.findall(r"\w+|[^\w\s]", text.lower())
    ngrams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not ngrams:
        return 0.0
    repeated = len(ngrams) - len(set(ngrams))
    return min(cap, repeated * cap * 2 / len(ngrams))


def split_thinking(response):
    """(thinking, answer): text before / after the first '</think>', or ('', response) without one."""
    if "</think>" in response:
        thinking, answer = response.split("</think>", 1)
        return thinking, answer.strip()
    return "", response.strip()


def rule_reward(response):
    """Rule reward of one response (chapter 8.3), a float.

    +0.5 if 20 <= len(response.strip()) <= 800 else -0.5;
    if the response contains '</think>': +1.0 if 20 <= len(thinking.strip()) <= 300 else -0.5, and
    +0.25 if '</think>' occurs exactly once else -0.25;
    minus ``rep_penalty`` of the answer (the text after '</think>', or the whole response).
    """
    reward = 0.5 if 20 <= len(response.strip()) <= 800 else -0.5
    if "</think>" in response:
        thinking, _ = response.split("</think>", 1)
        reward += 1.0 if 20 <= len(thinking.strip()) <= 300 else -0.5
        reward += 0.25 if response.count("</think>") == 1 else -0.25
    _, answer = split_thinking(response)
    return reward - rep_penalty(answer)


NUMBER_PATTERN = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_number(text):
    """The last number in ``text`` (commas removed), or None. '#### 42' and 'The answer is 42.' -> '42'."""
    matches = NUMBER_PATTERN.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "").rstrip(".")


def answer_reward(response, reference):
    """Verifiable answer reward: 1.0 if the last number of the answer part equals ``reference``, else 0.0.

    ``reference`` "" (no reference answer) gives 0.0. Numbers compare as numbers ("42.0" == "42").
    """
    if not reference:
        return 0.0
    _, answer = split_thinking(response)
    predicted = extract_final_number(answer)
    expected = extract_final_number(reference)
    if predicted is None or expected is None:
        return 0.0
    try:
        return 1.0 if float(predicted) == float(expected) else 0.0
    except ValueError:
        return 0.0


CHAT_TURN_PATTERN = re.compile(r"<\|im_start\|>(system|user|assistant)\s+(.*?)<\|im_end\|>", re.DOTALL)


def prompt_to_messages(prompt):
    """Rebuild [{"role", "content"}] from a chat-templated prompt (the chapter 8.3 regex).

    Every closed ``<|im_start|>role ... <|im_end|>`` turn (system, user, assistant; any number of turns) becomes
    one message with its content stripped; the open generation prompt at the end is not a turn.
    """
    return [{"role": role, "content": content.strip()} for role, content in CHAT_TURN_PATTERN.findall(prompt)]


HISTORY_HEADER = "以上是对话历史。我的新问题是："  # MiniMind's LMForRewardModel.get_score, verbatim


def reward_model_messages(messages, response):
    """The two-turn conversation the external reward model scores (chapter 8.3), upstream MiniMind's text exactly.

    Every turn of ``messages`` (``prompt_to_messages``, may be empty) before the last becomes a "role: content"
    line (contents as they are, thinking included), and the user turn is
    ``f"{history}\\n以上是对话历史。我的新问题是：\\n{last query}"``, or the last query alone without history.
    The assistant turn is the final answer of ``response`` (the text after '</think>', ``split_thinking``);
    ``LMForRewardModel`` gives models with upstream's interface upstream's text instead (``answer_text``).
    Returns [{"role": "user", "content": str}, {"role": "assistant", "content": str}].
    """
    history_text = "\n".join(f"{m['role']}: {m['content']}" for m in messages[:-1])
    last_query = messages[-1]["content"] if messages else ""
    context = f"{history_text}\n{HISTORY_HEADER}\n{last_query}" if history_text else last_query
    return [{"role": "user", "content": context}, {"role": "assistant", "content": split_thinking(response)[1]}]


def render_reward_text(tokenizer, conversation):
    """(text, add_special_tokens) for a sequence-classification reward model.

    With a chat template the text is ``apply_chat_template(conversation, tokenize=False)`` and the template already
    holds any BOS token (add_special_tokens False); without one, "role: content" lines and the tokenizer's own
    special tokens.
    """
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(conversation, tokenize=False), False
    return "\n".join(f"{m['role']}: {m['content']}" for m in conversation), True


def read_reward_model_config(path, trust_remote_code):
    """Check a reward-model folder before anything is loaded; returns its config.json as a dict.

    An InternLM2 reward model (``auto_map`` naming ``InternLM2ForRewardModel``, upstream MiniMind's default
    ``internlm2-1_8b-reward``) loads without running its code (``trainer/infra/internlm2_reward.py``), so it needs no
    ``trust_remote_code``; it needs the sentencepiece package.

    Raises:
        FileNotFoundError: if ``path`` or its config.json does not exist.
        ValueError: if config.json is not JSON, or the model needs remote code (an ``auto_map`` in config.json)
            and ``trust_remote_code`` is false, or an InternLM2 reward model while sentencepiece is not installed
            (the message gives the pip command).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"--reward_model_path {path} does not exist (use 'none' to disable)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"--reward_model_path {path}: no config.json, not a transformers model folder")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path}:{err.lineno}: invalid JSON ({err.msg})") from err
    if is_internlm2_reward(config):
        try:
            require_sentencepiece(path)
        except ModuleNotFoundError as err:
            raise ValueError(str(err)) from err
    elif config.get("auto_map") and not trust_remote_code:
        raise ValueError(f"--reward_model_path {path} runs its own Python code (auto_map in config.json: "
                         f"{sorted(config['auto_map'])}); pass --trust_remote_code to allow it "
                         f"(after reading that code)")
    return config


class LMForRewardModel:
    """External reward model of chapter 8.3: ``get_scores`` -> one score per answer, clipped to [-3, 3].

    Three kinds of ``path`` load (docs/reward_model.md): a sequence-classification model with one label (the
    ``reward_model_messages`` conversation in its own chat template, the logit at the last non-pad token), an
    InternLM2 reward model (upstream MiniMind's default, without its remote code: ``trainer/infra/internlm2_reward.py``)
    and a remote-code model with ``get_score`` (only with ``trust_remote_code``); the last two score upstream's text
    (``answer_text``). ``batch_size``: answers per forward; ``max_length``: tokens kept per answer, from the right.
    Raises FileNotFoundError / ValueError as ``read_reward_model_config`` does; ValueError also for a classifier with
    more than one label or a remote-code model without ``get_score``.
    """

    def __init__(self, path, device="cpu", dtype=torch.float32, batch_size=16, max_length=2048,
                 trust_remote_code=False):
        from transformers import AutoModel, AutoModelForSequenceClassification

        config = read_reward_model_config(path, trust_remote_code)
        auto_map = config.get("auto_map") or {}
        if is_internlm2_reward(config):
            self.kind = "internlm2"
            self.tokenizer = InternLM2RewardTokenizer(path)
            self.model = InternLM2RewardModel.from_pretrained(path, config, dtype=dtype)
        elif auto_map and "AutoModelForSequenceClassification" not in auto_map:
            self.kind = "remote"
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=True)
            if not callable(getattr(self.model, "get_score", None)):
                raise ValueError(f"--reward_model_path {path}: {type(self.model).__name__} has no "
                                 f"get_score(tokenizer, messages) and is not a sequence-classification model")
        else:
            self.kind = "classifier"
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code)
            if self.model.config.num_labels != 1:
                raise ValueError(f"--reward_model_path {path}: a reward model has one output label, this one has "
                                 f"{self.model.config.num_labels}")
            if self.tokenizer.pad_token_id is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.tokenizer.padding_side = "right"  # real tokens keep their positions: batched == one by one
            self.tokenizer.truncation_side = "left"  # a long history loses its start, never the answer
            self.model.config.pad_token_id = self.tokenizer.pad_token_id  # the head reads the last non-pad token
        self.model = self.model.to(device).eval()
        self.model.requires_grad_(False)
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length

    @staticmethod
    def score_list(scores, count):
        """``count`` floats from what a remote ``get_scores`` returned: a list, a tensor, or a bare float (its
        ``squeeze().tolist()`` for one conversation). Raises ValueError when the number of scores is not ``count``."""
        values = torch.as_tensor(scores, dtype=torch.float32).reshape(-1).tolist()
        if len(values) != count:
            raise ValueError(f"the reward model's get_scores returned {len(values)} scores for {count} conversations")
        return values

    @staticmethod
    def answer_text(response):
        """The answer text that upstream MiniMind's ``calculate_rewards`` gives the reward model: the text after the
        first '</think>', stripped, or the whole response unchanged when it has no '</think>'."""
        if "</think>" in response:
            return response.split("</think>", 1)[1].strip()
        return response

    @torch.no_grad()
    def raw_scores(self, conversations):
        """Unclipped fp32 scores (list of floats) of conversations ([user, assistant] messages), in chunks."""
        scores = []
        for start in range(0, len(conversations), self.batch_size):
            chunk = conversations[start:start + self.batch_size]
            if self.kind == "internlm2":
                scores.extend(self.model.get_scores(self.tokenizer, chunk, max_length=self.max_length))
            elif self.kind == "remote" and callable(getattr(self.model, "get_scores", None)):
                scores.extend(self.score_list(self.model.get_scores(self.tokenizer, chunk), len(chunk)))
            elif self.kind == "remote":
                scores.extend(float(self.model.get_score(self.tokenizer, c)) for c in chunk)
            else:
                scores.extend(self.classifier_scores(chunk))
        return scores

    def classifier_scores(self, conversations):
        """One right-padded forward of a sequence-classification model over ``conversations`` -> list of floats."""
        rendered = [render_reward_text(self.tokenizer, c) for c in conversations]
        enc = self.tokenizer([text for text, _ in rendered], return_tensors="pt", padding=True, truncation=True,
                             max_length=self.max_length, add_special_tokens=rendered[0][1]).to(self.device)
        logits = self.model(**enc).logits  # [b, 1]
        return logits[:, 0].float().tolist()

    def get_scores(self, messages_list, responses):
        """Scores of a batch of answers (chapter 8.3), each clipped to [-3, 3].

        Args:
            messages_list: list of N message lists (the prompts, ``prompt_to_messages``).
            responses: list of N completions; the final answer is scored (after '</think>'; see the class
                docstring for the text of each kind).
        Returns:
            list of N floats in [-3, 3].
        """
        conversations = [reward_model_messages(m, r) for m, r in zip(messages_list, responses)]
        if self.kind != "classifier":  # upstream's interface: upstream's text
            for conversation, response in zip(conversations, responses):
                conversation[-1]["content"] = self.answer_text(response)
        return [max(min(score, 3.0), -3.0) for score in self.raw_scores(conversations)]

    def get_score(self, messages, response):
        """The score of one answer, clipped to [-3, 3] (the chapter's one-sample interface)."""
        return self.get_scores([messages], [response])[0]


def load_reward_model(args, device, dtype):
    """The reward model of ``--reward_model_path`` (chapter 8.3, ``LMForRewardModel``), or None for 'none'.

    Placed on ``--reward_device`` (default ``device``) in the torch dtype ``dtype`` (the harness resolves
    ``--reward_dtype``: half precision on a GPU, as upstream MiniMind loads it, fp32 on the CPU), scoring
    ``--reward_batch_size`` answers per forward; ``--trust_remote_code 1`` allows a model with its own code.
    Raises what ``LMForRewardModel`` raises (a missing folder, remote code not allowed, more than one label).
    """
    if args.reward_model_path == "none":
        return None
    return LMForRewardModel(args.reward_model_path, device=args.reward_device or device, dtype=dtype,
                            batch_size=args.reward_batch_size, trust_remote_code=args.trust_remote_code)


def calculate_rewards(prompts, responses, answers, reward_model, answer_reward_weight):
    """Sequence rewards of a batch (chapter 8.3): rule reward + reward-model score + weighted answer reward.

    Args:
        prompts: list[str] of length N (for GRPO, each prompt repeated num_generations times, in place).
        responses: list[str] of length N, the decoded completions (without the EOS token).
        answers: list[str] of length N, reference answers ("" when a sample has none).
        reward_model: an ``LMForRewardModel`` or None (``--reward_model_path none``).
        answer_reward_weight: weight of ``answer_reward``.
    Returns:
        dict of float32 tensors [N]: "rewards" (the total) and its parts "rule_rewards",
        "reward_model_scores", "answer_rewards".
    """
    rule_rewards = torch.tensor([rule_reward(r) for r in responses], dtype=torch.float32)  # [N]
    answer_rewards = torch.tensor([answer_reward(r, a) for r, a in zip(responses, answers)],
                                  dtype=torch.float32)  # [N]
    reward_model_scores = torch.zeros(len(responses), dtype=torch.float32)  # [N]
    if reward_model is not None:
        messages_list = [prompt_to_messages(p) for p in prompts]
        reward_model_scores = torch.tensor(reward_model.get_scores(messages_list, responses),
                                           dtype=torch.float32)  # [N], one batched call
    rewards = rule_rewards + reward_model_scores + answer_reward_weight * answer_rewards  # [N]
    return {"rewards": rewards, "rule_rewards": rule_rewards, "reward_model_scores": reward_model_scores,
            "answer_rewards": answer_rewards}


# ----------------------------------------------------------------------------- KL and masks (chapter 8.6)


def completion_mask_from_ids(completion_ids, eos_token_id):
    """Mask of the completion tokens that count: every token up to and including the first EOS.

    completion_ids: long [N, R] -> long [N, R] of 0/1. A row without EOS (truncated) is all ones.
    Everything after the first EOS (padding or stray tokens) is 0.
    """
    is_eos = completion_ids == eos_token_id  # [N, R]
    positions = torch.arange(completion_ids.size(1), device=completion_ids.device).expand_as(completion_ids)
    first_eos = torch.where(is_eos, positions, torch.full_like(positions, completion_ids.size(1))).min(dim=1).values
    return (positions <= first_eos.unsqueeze(1)).long()


def masked_mean(values, mask, dim=None):
    """Mean of ``values`` over positions where mask == 1 (sum / count, count clamped to >= 1); chapter 8.4.2-8.6.

    values, mask: same shape (mask 0/1, any dtype). dim=None averages over all entries -> scalar;
    an int averages along that dimension. An all-zero mask gives 0, never NaN.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1)


def k3_kl(ref_per_token_logps, per_token_logps, mask=None):
    """k3 estimator of KL(pi_theta || pi_ref) per token (Schulman 2020, "Approximating KL divergence"; chapter 8.6).

    k3 = exp(ref - logp) - (ref - logp) - 1, elementwise on [N, R] fp32 log-probs (nats); >= 0, and 0 where
    the two log-probs are equal. With ``mask`` ([N, R] 0/1), the log-ratio is set to 0 at masked positions
    *before* ``exp``, so k3 is 0 there and its gradient is 0, never 0 * inf = NaN (a padded position can
    hold any log-prob, e.g. -95, whose exp overflows).
    """
    log_ratio = ref_per_token_logps - per_token_logps  # [N, R]
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    return torch.exp(log_ratio) - log_ratio - 1


def masked_std(values, mask):
    """Population standard deviation of ``values`` over positions where mask == 1 (a scalar tensor; 0 if none):
    the spread of PPO's whitened advantages (chapter 8.4.2) over real tokens, as the loop logs it."""
    return masked_mean((values - masked_mean(values, mask)) ** 2, mask).sqrt()


def explained_variance(values, returns, mask):
    """1 - Var[returns - values] / Var[returns] over real tokens (1 = perfect critic, <= 0 = no better than a constant):
    how much of the returns PPO's critic (chapter 8.4.4) predicts. values, returns: fp32 [B, R]; mask: [B, R] 0/1.

    NaN when the returns do not vary (e.g. every answer got the same reward): the ratio is undefined then, and a
    clamped denominator would report 1.0 or a huge negative number. Plots and README means skip NaN.
    """
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    if var_returns.item() <= 1e-12:
        return float("nan")
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return (1.0 - var_residual / var_returns).item()
