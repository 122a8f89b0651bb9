"""Rollout engines (chapter 8.2): sample completions and record their per-token log-probs.

``RolloutEngine`` is a small abstract base with two methods, ``rollout`` and ``update_policy``;
``TorchRolloutEngine`` samples with the policy's own ``generate``; ``create_rollout_engine`` picks one
from the ``--rollout_engine`` flag.

Log-prob convention (one for old, new and reference log-probs): log pi(token | prefix) of the
temperature-scaled distribution, softmax(logits / temperature), without top-p / top-k truncation.
With temperature 1 this is the model's plain distribution.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from trainer.trainer_utils import completion_mask_from_ids, unwrap_model


def selective_log_softmax(logits, index, temperature=1.0):
    """log_softmax(logits / temperature, -1).gather(-1, index) without a [B, n, V] log-softmax tensor (chapter 8.2).

    logits: [B, n, V] any float dtype; index: long [B, n] -> fp32 [B, n]. Computed per row as
    logit[index] - logsumexp(logits), in fp32, so the extra memory is one row's [n, V] at most.
    """
    per_token_logps = []
    for logits_row, index_row in zip(logits, index):  # [n, V], [n]
        row = logits_row.float() / temperature
        picked = row.gather(-1, index_row.unsqueeze(-1)).squeeze(-1)  # [n]
        per_token_logps.append(picked - torch.logsumexp(row, dim=-1))
    return torch.stack(per_token_logps)  # [B, n]


def compute_per_token_logps(model, input_ids, n_keep, attention_mask=None, temperature=1.0, return_aux_loss=False):
    """Log-probs of the last ``n_keep`` tokens of each row (chapter 8.2).

    One forward over the full sequence keeps the logits of the last n_keep + 1 positions; position t
    predicts token t + 1, so ``logits[:, :-1]`` scores ``input_ids[:, -n_keep:]``.

    Args:
        model: a causal LM (or its DDP wrapper: the call goes through it, so DDP sees the forward).
        input_ids: long [B, P + R]; attention_mask: [B, P + R] (1 = real token) or None.
        n_keep: R, the number of completion tokens to score.
        temperature: the sampling temperature (see the module docstring).
        return_aux_loss: also return the MoE router loss of this forward (0 without MoE).
    Returns:
        per_token_logps fp32 [B, R]; or (per_token_logps, aux_loss scalar) with ``return_aux_loss``.
    """
    if n_keep <= 0:
        empty = torch.zeros((input_ids.size(0), 0), dtype=torch.float32, device=input_ids.device)
        return (empty, torch.zeros((), device=input_ids.device)) if return_aux_loss else empty
    out = model(input_ids, attention_mask=attention_mask, logits_to_keep=n_keep + 1)
    logits = out.logits[:, :-1, :]  # [B, R, V]
    per_token_logps = selective_log_softmax(logits, input_ids[:, -n_keep:], temperature)  # [B, R]
    return (per_token_logps, out.aux_loss) if return_aux_loss else per_token_logps


@dataclass
class RolloutResult:
    """What a rollout returns (N = B * num_generations rows, R completion tokens).

    output_ids: long [N, P + R], prompts (left-padded) then completions (padded after EOS).
    completion_ids: long [N, R].
    per_token_logps: fp32 [N, R], log pi_old of each completion token at sampling time (no grad).
    completions: list[str] of length N, decoded completions up to (not including) the first EOS.
    prompt_lens: long [N], real (unpadded) prompt lengths.
    completion_mask: long [N, R], 1 through the first EOS (see ``completion_mask_from_ids``).
    prompt_mask: long [N, P], the prompts' attention mask.
    """
    output_ids: torch.Tensor
    completion_ids: torch.Tensor
    per_token_logps: torch.Tensor
    completions: list
    prompt_lens: torch.Tensor
    completion_mask: torch.Tensor
    prompt_mask: torch.Tensor

    @property
    def attention_mask(self):
        """long [N, P + R]: prompt mask then completion mask, for forwards over ``output_ids``."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


def decode_completions(tokenizer, completion_ids, completion_mask, eos_token_id):
    """Decode each row's tokens up to (not including) its first EOS, keeping '<think>' tags."""
    texts = []
    for ids, mask in zip(completion_ids.tolist(), completion_mask.tolist()):
        tokens = [t for t, m in zip(ids, mask) if m]
        if tokens and tokens[-1] == eos_token_id:
            tokens = tokens[:-1]
        texts.append(tokenizer.decode(tokens, skip_special_tokens=False))
    return texts


class RolloutEngine(ABC):
    """Samples completions for a batch of prompts (chapter 8.2)."""

    @abstractmethod
    def rollout(self, prompt_ids, attention_mask, num_generations, max_new_tokens, temperature=1.0):
        """prompt_ids, attention_mask: long [B, P], left-padded -> ``RolloutResult`` with N = B * num_generations
        rows ordered P0, P0, ..., P1, P1, ... (each prompt's answers adjacent)."""

    @abstractmethod
    def update_policy(self, model):
        """Make later rollouts sample from ``model``'s current weights."""


class TorchRolloutEngine(RolloutEngine):
    """Rollouts with the policy's own ``generate`` (KV cache), then one forward for the old log-probs (chapter 8.2)."""

    def __init__(self, policy_model, tokenizer, top_p=1.0, top_k=0, generator=None):
        self.policy_model = policy_model
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.top_p = top_p
        self.top_k = top_k
        self.generator = generator

    @torch.no_grad()
    def rollout(self, prompt_ids, attention_mask, num_generations, max_new_tokens, temperature=1.0):
        model = unwrap_model(self.policy_model)
        was_training = model.training
        model.eval()
        prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [N, P]
        prompt_mask = attention_mask.repeat_interleave(num_generations, dim=0)  # [N, P]
        output_ids = model.generate(
            prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens, do_sample=True,
            temperature=temperature, top_p=self.top_p, top_k=self.top_k,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, generator=self.generator,
        )  # [N, P + R]
        completion_ids = output_ids[:, prompt_ids.size(1):]  # [N, R]
        completion_mask = completion_mask_from_ids(completion_ids, self.eos_token_id)  # [N, R]
        full_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P + R]
        per_token_logps = compute_per_token_logps(model, output_ids, completion_ids.size(1), full_mask,
                                                  temperature)  # [N, R]
        model.train(was_training)
        return RolloutResult(
            output_ids=output_ids,
            completion_ids=completion_ids,
            per_token_logps=per_token_logps,
            completions=decode_completions(self.tokenizer, completion_ids, completion_mask, self.eos_token_id),
            prompt_lens=prompt_mask.sum(dim=1),
            completion_mask=completion_mask,
            prompt_mask=prompt_mask,
        )

    def update_policy(self, model):
        # The engine samples from the training model itself: its weights are always current.
        self.policy_model = model


ROLLOUT_ENGINES = ("torch",)


def create_rollout_engine(engine_type, policy_model, tokenizer, **kwargs):
    """Factory for ``--rollout_engine`` (chapter 8.2).

    Raises:
        ValueError: for an unknown engine type, naming the valid ones.
    """
    if engine_type == "torch":
        return TorchRolloutEngine(policy_model, tokenizer, **kwargs)
    raise ValueError(f"unknown --rollout_engine {engine_type!r}; valid: {', '.join(ROLLOUT_ENGINES)}")
