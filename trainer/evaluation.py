"""Held-out evaluation of a policy: does RL make the model answer prompts it has never seen better?

``evaluate`` answers the first ``num_prompts`` prompts of a dataset once each, sampled with a fixed seed
(or greedily), and scores every answer with the training rewards (chapter 8.3). ``HeldOutEvaluator`` is the
periodic evaluation of both RL scripts (``--eval_interval``): the same prompts and the same sampling seed
every time, sampled at the rollout's temperature and greedy, so that two evaluations of one run differ only
by the weights. It is TRL's ``eval_steps`` / verl's ``val_before_train`` for a verifiable task.
``AgentEvaluator`` is the same for agent RL: multi-turn conversations with tools, scored by the agent rewards.
"""

from dataclasses import dataclass, replace

import torch

from dataset.agent_dataset import AgentRLDataset
from dataset.lm_dataset import RLAIFDataset
from trainer.agent.rewards import calculate_agent_rewards
from trainer.agent.rollout import agent_rollout, template_kwargs
from trainer.agent.tools import conversation_tools
from trainer.infra.distributed import Logger, unwrap_model
from trainer.rollout_engine import TorchRolloutEngine, decode_completions, tokenize_prompts
from trainer.trainer_utils import calculate_rewards, completion_mask_from_ids


def distinct_n(texts, n=2):
    """Distinct-n: distinct word n-grams / all word n-grams over ``texts`` (Li et al. 2016); 0 if none."""
    ngrams = []
    for text in texts:
        words = text.split()
        ngrams.extend(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return len(set(ngrams)) / len(ngrams) if ngrams else 0.0


@torch.no_grad()
@dataclass(frozen=True)
class Decoding:
    """How ``evaluate`` answers: the first ``num_prompts`` prompts (each cut to its last ``max_seq_len`` tokens),
    ``batch_size`` at a time, answers of at most ``max_gen_len`` tokens, sampled at ``temperature`` with a generator
    seeded with ``seed``, or greedy."""

    num_prompts: int
    batch_size: int = 100
    max_gen_len: int = 96
    temperature: float = 1.0  # ignored when greedy
    greedy: bool = False
    seed: int = 1234
    max_seq_len: int = 256


def evaluate(model, tokenizer, dataset, decoding, reward_model=None, device="cpu", should_stop=None):
    """Answer the first ``decoding.num_prompts`` prompts of ``dataset`` once each and score the answers.

    Sampling uses its own ``torch.Generator`` seeded with ``decoding.seed``, so the global random state (and with it
    the training run that calls this) is left untouched, and the same weights give the same answers.
    The model is put in eval mode and back into the mode it was in.

    Args:
        model: a MiniMind causal LM (or its DDP wrapper).
        dataset: items {"prompt": str, "answer": str} (``RLAIFDataset``).
        decoding: a ``Decoding``.
        should_stop: a function of no argument, checked between batches: when it returns True the evaluation
            ends there and returns {} (a stop request does not wait for the whole evaluation).
    Returns:
        dict with accuracy (share of answers whose final number equals the reference, ``answer_reward``),
        reward (rule + reward model), rule_reward, reward_model_score, answer_reward, response_len (tokens),
        distinct_2, and "samples": one dict per prompt with prompt, completion, reference, rule_reward,
        reward_model_score, answer_reward; {} when ``should_stop`` ended it.
    Raises:
        ValueError: ``num_prompts`` or ``batch_size`` < 1.
    """
    num_prompts, batch_size, max_gen_len = decoding.num_prompts, decoding.batch_size, decoding.max_gen_len
    if num_prompts < 1 or batch_size < 1:
        raise ValueError(f"num_prompts and batch_size must be >= 1, got {num_prompts} and {batch_size}")
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=device).manual_seed(decoding.seed)
    engine = TorchRolloutEngine(model, tokenizer, generator=generator)
    totals = {"reward": 0.0, "rule_reward": 0.0, "reward_model_score": 0.0, "answer_reward": 0.0, "response_len": 0.0}
    samples, completions_all = [], []
    count = min(num_prompts, len(dataset))
    for start in range(0, count, batch_size):
        if should_stop is not None and should_stop():
            model.train(was_training)
            return {}
        rows = [dataset[i] for i in range(start, min(start + batch_size, count))]
        prompts = [r["prompt"] for r in rows]
        answers = [r["answer"] for r in rows]
        prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts, decoding.max_seq_len, device)
        if decoding.greedy:
            output_ids = model.generate(
                prompt_ids,
                attention_mask,
                max_new_tokens=max_gen_len,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            ).output_ids  # [b, P + R]
            completion_ids = output_ids[:, prompt_ids.size(1) :]  # [b, R]
            completion_mask = completion_mask_from_ids(completion_ids, tokenizer.eos_token_id)  # [b, R]
            completions = decode_completions(tokenizer, completion_ids, completion_mask, tokenizer.eos_token_id)
        else:
            rollout = engine.rollout(prompt_ids, attention_mask, 1, max_gen_len, decoding.temperature)
            completions, completion_mask = rollout.completions, rollout.completion_mask
        parts = calculate_rewards(prompts, completions, answers, reward_model, 1.0)
        totals["reward"] += (parts["rule_rewards"] + parts["reward_model_scores"]).sum().item()
        totals["rule_reward"] += parts["rule_rewards"].sum().item()
        totals["reward_model_score"] += parts["reward_model_scores"].sum().item()
        totals["answer_reward"] += parts["answer_rewards"].sum().item()
        totals["response_len"] += completion_mask.sum().item()
        for i, (prompt, completion, reference) in enumerate(zip(prompts, completions, answers)):
            samples.append(
                {
                    "prompt": prompt,
                    "completion": completion,
                    "reference": reference,
                    "rule_reward": parts["rule_rewards"][i].item(),
                    "reward_model_score": parts["reward_model_scores"][i].item(),
                    "answer_reward": parts["answer_rewards"][i].item(),
                }
            )
        completions_all.extend(completions)
    model.train(was_training)
    result = {k: v / count for k, v in totals.items()}
    result["accuracy"] = result["answer_reward"]
    result["distinct_2"] = distinct_n(completions_all, 2)
    result["samples"] = samples
    return result


def before_after_lines(title, history, rows, width):
    """The end-of-run table of a held-out evaluation: ``title`` (the same prompts and seed each time), then one line
    per (metric key, label) of ``rows`` with its value at the first and the last (step, metrics) of ``history`` and
    the change; ``width``: the labels' column. [] for an empty history."""
    if not history:
        return []
    (first_step, first), (last_step, last) = history[0], history[-1]
    lines = [
        f"{title} (same prompts and seed each time):",
        f"  {'':<{width}} {'step ' + str(first_step):>10} {'step ' + str(last_step):>10} {'change':>8}",
    ]
    for key, label in rows:
        lines.append(f"  {label:<{width}} {first[key]:>10.3f} {last[key]:>10.3f} {last[key] - first[key]:>+8.3f}")
    return lines


class HeldOutEvaluator:
    """The periodic held-out evaluation of a training run (``--eval_interval``, ``--eval_num_prompts``).

    Every call answers the same ``decoding.num_prompts`` prompts (at most the dataset's) twice, sampled as
    ``decoding`` says (a ``Decoding``; generator seeded with its ``seed``) and greedy, and returns
    ``eval/accuracy_sampled``, ``eval/accuracy_greedy`` (shares in [0, 1]) and ``eval/response_len`` (mean tokens of
    the sampled answers). Every rank computes the same numbers on the same prompts (no collective), so the result
    does not depend on the number of processes. ``history`` keeps (step, metrics) of every call, for the
    before/after lines at the end of a run.
    """

    def __init__(self, dataset, tokenizer, decoding, device):
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.decoding = replace(decoding, num_prompts=min(decoding.num_prompts, len(dataset)), greedy=False)
        self.device = device
        self.history = []

    @property
    def num_prompts(self):
        """The prompts each evaluation answers (at most the dataset's)."""
        return self.decoding.num_prompts

    def __call__(self, model, step, should_stop=None):
        """Evaluate ``model`` at training step ``step``; returns the ``eval/...`` metrics (floats), or {} when
        ``should_stop`` (see ``evaluate``) ended the evaluation early (nothing is recorded then)."""
        common = dict(device=self.device, should_stop=should_stop)
        sampled = evaluate(model, self.tokenizer, self.dataset, self.decoding, **common)
        greedy = (
            evaluate(model, self.tokenizer, self.dataset, replace(self.decoding, greedy=True), **common)
            if sampled
            else {}
        )
        if not sampled or not greedy:  # a stop request ended the evaluation
            return {}
        metrics = {
            "eval/accuracy_sampled": sampled["accuracy"],
            "eval/accuracy_greedy": greedy["accuracy"],
            "eval/response_len": sampled["response_len"],
        }
        self.history.append((step, metrics))
        return metrics

    def summary_lines(self):
        """Lines comparing the first and the last evaluation (the start policy and the trained one)."""
        rows = (
            ("eval/accuracy_sampled", f"sampled (T = {self.decoding.temperature:g})"),
            ("eval/accuracy_greedy", "greedy"),
        )
        return before_after_lines(f"held-out accuracy on {self.decoding.num_prompts} prompts", self.history, rows, 22)


def build_evaluator(args, tokenizer, device):
    """The run's ``HeldOutEvaluator`` (``--eval_data_path``, ``--eval_num_prompts``, the rollout's temperature and
    lengths), or None with ``--eval_interval 0`` or when ``--data_path`` is not the bundled training data and no
    ``--eval_data_path`` was given (the log says so: the bundled validation prompts fit the bundled task only)."""
    if args.eval_interval and not args.eval_data_path:
        Logger(
            f"held-out evaluation off: --data_path {args.data_path} is not the bundled training data, whose "
            f"validation prompts the evaluation would use; pass --eval_data_path FILE to evaluate"
        )
    if not (args.eval_interval and args.eval_data_path):
        return None
    eval_dataset = RLAIFDataset(args.eval_data_path, tokenizer, thinking_ratio=1.0, seed=args.seed)
    decoding = Decoding(args.eval_num_prompts, 100, args.max_gen_len, args.temperature, max_seq_len=args.max_seq_len)
    return HeldOutEvaluator(eval_dataset, tokenizer, decoding, device)


class GreedyPolicy(torch.nn.Module):
    """The policy with ``generate`` always greedy: ``agent_rollout`` of the greedy evaluation."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def generate(self, input_ids, **kwargs):
        return self.policy.generate(input_ids, **dict(kwargs, do_sample=False))


class AgentEvaluator:
    """The run's held-out evaluation (step 0, every --eval_interval steps, the end): the first ``num_prompts`` rows
    answered once each, sampled (own generator, ``seed``) and greedy, reporting ``eval/accuracy_*`` (all gt values
    in the final answer), ``eval/tool_call_share_*`` (answers with a call), ``eval/answers_with_valid_call_*``
    (answers with at least one valid call), ``eval/valid_call_share_*`` (valid calls / calls), ``eval/turns_*`` and
    ``eval/response_len``; ``history`` keeps every call for the before/after lines."""

    def __init__(self, dataset, tokenizer, args, device, seed=1234, batch_size=32):
        self.rows = [dataset[i] for i in range(min(args.eval_num_prompts, len(dataset)))]
        self.num_prompts = len(self.rows)
        self.tokenizer, self.args, self.device, self.seed, self.batch_size = tokenizer, args, device, seed, batch_size
        self.history = []

    @torch.no_grad()
    def evaluate(self, model, greedy, should_stop=None):
        """{accuracy, tool_call_share, answers_with_valid_call, valid_call_share, turns, response_len}, or None when
        stopped."""
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        totals = dict.fromkeys(
            ("accuracy", "tool_call_share", "answers_with_valid_call", "turns", "response_len", "calls", "valid"), 0.0
        )
        policy = GreedyPolicy(unwrap_model(model)) if greedy else unwrap_model(model)
        for start in range(0, self.num_prompts, self.batch_size):
            if should_stop is not None and should_stop():
                return None
            rows = self.rows[start : start + self.batch_size]
            rollout = agent_rollout(
                policy,
                self.tokenizer,
                [r["messages"] for r in rows],
                1,
                max_new_tokens=self.args.max_gen_len,
                max_total_len=self.args.max_total_len,
                temperature=self.args.temperature,
                max_turns=self.args.max_turns,
                generator=generator,
                chat_template_kwargs=template_kwargs([r["open_thinking"] for r in rows]),
            )
            parts = calculate_agent_rewards([r["messages"] for r in rows], rollout, [r["gt"] for r in rows], None, 1.0)
            totals["accuracy"] += parts["accuracy"].sum().item()
            totals["tool_call_share"] += (rollout.num_tool_calls > 0).sum().item()
            totals["answers_with_valid_call"] += (rollout.num_valid_calls > 0).sum().item()
            totals["turns"] += rollout.num_turns.sum().item()
            totals["response_len"] += rollout.completion_mask.sum().item()
            totals["calls"] += rollout.num_tool_calls.sum().item()
            totals["valid"] += rollout.num_valid_calls.sum().item()
        calls, valid = totals.pop("calls"), totals.pop("valid")
        return dict(
            {key: value / self.num_prompts for key, value in totals.items()},
            valid_call_share=valid / calls if calls else 0.0,
        )

    def __call__(self, model, step, should_stop=None):
        sampled = self.evaluate(model, False, should_stop)
        greedy = self.evaluate(model, True, should_stop) if sampled else None
        if sampled is None or greedy is None:
            return {}
        metrics = {
            f"eval/{key}_{kind}": result[key]
            for kind, result in (("sampled", sampled), ("greedy", greedy))
            for key in ("accuracy", "tool_call_share", "answers_with_valid_call", "valid_call_share", "turns")
        }
        metrics["eval/response_len"] = sampled["response_len"]
        self.history.append((step, metrics))
        return metrics

    def summary_lines(self):
        """The first and the last evaluation side by side (the start policy and the trained one)."""
        keys = [key for key in self.history[0][1] if key != "eval/response_len"] if self.history else []
        return before_after_lines(
            f"held-out agent evaluation on {self.num_prompts} prompts",
            self.history,
            [(key, key[5:]) for key in keys],
            30,
        )


def build_agent_evaluator(args, tokenizer, device):
    """The ``AgentEvaluator`` of --eval_data_path, or None with --eval_interval 0 or no held-out file."""
    if args.eval_interval and not args.eval_data_path:
        Logger("held-out evaluation off: pass --eval_data_path FILE (agent rows) to evaluate")
    if not (args.eval_interval and args.eval_data_path):
        return None
    dataset = AgentRLDataset(
        args.eval_data_path, tokenizer, args.thinking_ratio, args.seed, check_tools=conversation_tools
    )
    return AgentEvaluator(dataset, tokenizer, args, device)


def evaluation_due(evaluator, step, total_steps, eval_interval):
    """Whether the held-out evaluation runs at ``step``: there is an evaluator and it is step 0, a multiple of
    ``eval_interval`` or the last step."""
    return evaluator is not None and (step == 0 or step % eval_interval == 0 or step == total_steps)


def evaluate_if_due(evaluator, model, step, total_steps, eval_interval, should_stop=None):
    """The ``eval/...`` metrics of the held-out evaluation when it is due (``evaluation_due``), with one log line; {}
    otherwise, without an evaluator, or when ``should_stop`` ended it (a stop request: the line says so)."""
    if not evaluation_due(evaluator, step, total_steps, eval_interval):
        return {}
    metrics = evaluator(model, step, should_stop)
    if not metrics:
        Logger(f"eval step {step} | stopped by a stop request before its end; no result recorded")
        return {}
    Logger(
        f"eval step {step} | held-out accuracy sampled {metrics['eval/accuracy_sampled']:.3f} "
        f"greedy {metrics['eval/accuracy_greedy']:.3f} | len {metrics['eval/response_len']:.1f} "
        f"({evaluator.num_prompts} prompts)"
    )
    return metrics
