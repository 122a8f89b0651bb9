"""What both RL scripts share from the chapter, in its order: the rewards of 8.3 (rule reward, repetition penalty,
answer reward, the external reward model and its conversation, ``calculate_rewards``), the rewards per token (8.4.2,
8.6), GRPO's group advantages (8.5.1) and the KL and masks of 8.6 (the completion mask, masked means, the k3
estimator).

Everything that is not in the chapter (processes, flags, weights, checkpoints and reward-model folders on disk,
dtypes, the optimizer, metrics) lives in trainer/infra/, which a learner can skip. Nothing here reads a global: every
function takes what it needs as arguments.
"""

import re

import torch

from trainer.infra.reward_models import load_reward_model_files, render_reward_text


# ----------------------------------------------------------------------------- rewards (chapter 8.3)


# Scripts written without spaces between words: CJK ideographs (the basic block, extension A, the compatibility block,
# extensions B-F) and Japanese kana. Each such character is one token of ``rep_penalty``, as sacrebleu's zh tokenizer
# splits Chinese; Hangul is written with spaces, so its words stay words.
UNSPACED_CHARACTER = "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]"
REPETITION_TOKEN_PATTERN = re.compile(rf"{UNSPACED_CHARACTER}|(?:(?!{UNSPACED_CHARACTER})\w)+|[^\w\s]")


def repetition_tokens(text):
    """The tokens ``rep_penalty`` counts n-grams of: each CJK ideograph or kana on its own, a run of other word
    characters (a word, a number), each punctuation mark; lower-cased. "答案是 940。" -> 答, 案, 是, 940, 。"""
    return REPETITION_TOKEN_PATTERN.findall(text.lower())


def rep_penalty(text, n=3, cap=0.5):
    """n-gram repetition penalty of MiniMind's reward (chapter 8.3), in [0, cap].

    The penalty is min(cap, 2 * cap * (#n-grams - #distinct n-grams) / #n-grams) over the n-grams of
    ``repetition_tokens`` (0 for text with fewer than n tokens). The chapter's words (regex ``\\w+|[^\\w\\s]``) make
    an unpunctuated run of Chinese one "word", so under them "你好" repeated six times scores 0 (upstream MiniMind's
    issue #810); here every CJK character is a token, so the penalty sees Chinese, English and mixed text alike:
    "你好" x 6 gives 10 trigrams of which 2 are distinct -> 0.5. Characters rather than tokenizer ids keep the reward
    a function of the text alone, the same whatever tokenizer the policy has.
    """
    tokens = repetition_tokens(text)
    ngrams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
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


class LMForRewardModel:
    """External reward model of chapter 8.3: ``get_scores`` -> one score per answer, clipped to [-3, 3].

    Three kinds of ``path`` load (docs/reward_model.md): a sequence-classification model with one label (the
    ``reward_model_messages`` conversation in its own chat template, the logit at the last non-pad token), an
    InternLM2 reward model (upstream MiniMind's default, without its remote code: ``trainer/infra/internlm2_reward.py``)
    and a remote-code model with ``get_score`` (only with ``trust_remote_code``); the last two score upstream's text
    (``answer_text``). ``batch_size``: answers per forward; ``max_length``: tokens kept per answer, from the right.
    Loading and its checks: ``trainer/infra/reward_models.py`` (raises FileNotFoundError / ValueError for a missing
    folder, remote code not allowed, a classifier with more than one label, a remote-code model without get_score).
    """

    def __init__(
        self, path, device="cpu", dtype=torch.float32, batch_size=16, max_length=2048, trust_remote_code=False
    ):
        self.kind, self.tokenizer, self.model = load_reward_model_files(path, device, dtype, trust_remote_code)
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
            chunk = conversations[start : start + self.batch_size]
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
        enc = self.tokenizer(
            [text for text, _ in rendered],
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=rendered[0][1],
        ).to(self.device)
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
    return LMForRewardModel(
        args.reward_model_path,
        device=args.reward_device or device,
        dtype=dtype,
        batch_size=args.reward_batch_size,
        trust_remote_code=args.trust_remote_code,
    )


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
    answer_rewards = torch.tensor([answer_reward(r, a) for r, a in zip(responses, answers)], dtype=torch.float32)  # [N]
    reward_model_scores = torch.zeros(len(responses), dtype=torch.float32)  # [N]
    if reward_model is not None:
        messages_list = [prompt_to_messages(p) for p in prompts]
        reward_model_scores = torch.tensor(
            reward_model.get_scores(messages_list, responses), dtype=torch.float32
        )  # [N], one batched call
    rewards = rule_rewards + reward_model_scores + answer_reward_weight * answer_rewards  # [N]
    return {
        "rewards": rewards,
        "rule_rewards": rule_rewards,
        "reward_model_scores": reward_model_scores,
        "answer_rewards": answer_rewards,
    }


# ----------------------------------------------------------------------------- rewards per token (chapter 8.4.2, 8.6)
# PPO puts each answer's reward on its last token (GAE reads rewards per token); so does REINFORCE++
# (advantage_estimators.py). ``--kl_placement reward`` adds the KL penalty to every token's reward.


def place_sequence_rewards(rewards, completion_mask):
    """Put each sequence reward on its last real token (chapter 8.4.2).

    rewards: fp32 [B]; completion_mask: [B, R] 0/1 (1 through the first EOS) -> token_rewards fp32 [B, R],
    zero except at the last position whose mask is 1: the first EOS, or the last token when truncated (in the agent
    script, whose mask is 0 on the tools' replies, the model's last token). A row without any real token gets no
    reward.
    """
    token_rewards = torch.zeros(completion_mask.shape, dtype=torch.float32, device=rewards.device)  # [B, R]
    positions = torch.arange(completion_mask.size(1), device=completion_mask.device).expand_as(completion_mask)
    last_real = torch.where(completion_mask.bool(), positions, -1).max(dim=1).values  # [B], -1 without tokens
    valid_resp = last_real >= 0
    rows = torch.arange(completion_mask.size(0), device=rewards.device)[valid_resp]
    token_rewards[rows, last_real[valid_resp]] = rewards[valid_resp].float()
    return token_rewards


KL_PLACEMENTS = ("loss", "reward")  # --kl_placement: beta * k3 in the loss (8.6), or -beta * k1 in the rewards


def kl_penalty_rewards(old_per_token_logps, ref_per_token_logps, completion_mask, kl_coef):
    """The KL penalty as a per-token reward, for ``--kl_placement reward`` (InstructGPT, Ouyang et al. 2022, eq. 2;
    the learner's article; TRL's PPOTrainer): r_t = -kl_coef * (log pi_old(y_t) - log pi_ref(y_t)).

    The chapter (8.6) puts k3 into the loss instead (``ppo_policy_loss``); this form adds the sampled log-ratio
    (k1) to the rewards before GAE, so the critic learns the penalised return.

    Args:
        old_per_token_logps, ref_per_token_logps: fp32 [B, R]; completion_mask: [B, R] 0/1; kl_coef >= 0.
    Returns:
        fp32 [B, R], 0 where masked.
    """
    mask = completion_mask.bool()  # [B, R]
    log_ratio = torch.where(mask, old_per_token_logps - ref_per_token_logps, torch.zeros_like(old_per_token_logps))
    return -kl_coef * log_ratio.float()  # [B, R]


# ----------------------------------------------------------------------------- group advantages (chapter 8.5.1)


def grpo_advantages(rewards, num_generations, eps=1e-4, scale_rewards="group"):
    """Group-relative advantages A_i = (r_i - mean(r_group)) / (std + eps) (chapter 8.5.1; Shao et al. 2024, eq. 3).

    The std is the group's population std (``scale_rewards`` "group", the chapter's), the batch's ("batch"), or no
    division ("none", Dr. GRPO). rewards: fp32 [B*G], each prompt's G rewards adjacent -> advantages [B*G] in the
    rewards' dtype; statistics in fp64, so a group of equal rewards gives exactly 0.
    Raises ValueError when rewards.numel() is not a multiple of G, or for an unknown ``scale_rewards``.
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {num_generations}")
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; valid: group, batch, none")
    # fp64 statistics: an fp32 mean of equal values can miss them by one ulp, and ulp / (ulp + eps) is not small
    rewards_fp64 = rewards.double()  # [B*G]
    grouped_rewards = rewards_fp64.view(-1, num_generations)  # [B, G]
    mean_r = grouped_rewards.mean(dim=1).repeat_interleave(num_generations)  # [B*G]
    if scale_rewards == "none":
        return (rewards_fp64 - mean_r).to(rewards.dtype)  # [B*G]
    if scale_rewards == "batch":
        std_r = rewards_fp64.std(unbiased=False).expand_as(rewards_fp64)  # [B*G]
    else:
        std_r = grouped_rewards.std(dim=1, unbiased=False).repeat_interleave(num_generations)  # [B*G]
    return ((rewards_fp64 - mean_r) / (std_r + eps)).to(rewards.dtype)  # [B*G]


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


def masked_var(values, mask):
    """Population variance of ``values`` over positions where mask == 1 (chapter 8.4.2, the whitening's): the masked
    mean of the squared deviations from the masked mean, a scalar tensor; 0 for an all-zero mask. values, mask: same
    shape (mask 0/1)."""
    mean = masked_mean(values, mask)
    return masked_mean((values - mean) ** 2, mask)


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
