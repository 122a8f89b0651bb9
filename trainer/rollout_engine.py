"""Rollout engines (chapter 8.2): sample completions and record their per-token log-probs.

``RolloutEngine`` is a small abstract base with two methods, ``rollout`` and ``update_policy``;
``TorchRolloutEngine`` samples with the policy's own ``generate``; ``SGLangRolloutEngine`` sends the prompts
to an SGLang server over HTTP and syncs the policy's weights to it through a shared folder;
``create_rollout_engine`` picks one from the ``--rollout_engine`` flag.

Log-prob convention (one for old, new and reference log-probs): log pi(token | prefix) of the
temperature-scaled distribution, softmax(logits / temperature), without top-p / top-k truncation.
With temperature 1 this is the model's plain distribution. It is also SGLang's default for the log-probs it
returns; a server started with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` returns softmax(logits) instead.
"""
import os
import shutil
import time
import urllib.parse
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import requests
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from model.hf_qwen3 import save_qwen3_folder
from model.model_minimind import KVCache
from trainer.checkpoints import unwrap_model
from trainer.distributed import is_main_process
from trainer.trainer_utils import completion_mask_from_ids, masked_mean


class SelectiveLogSoftmax(torch.autograd.Function):
    """log_softmax(logits / T).gather(index) with a hand-written backward that keeps only the logits.

    Autograd of the plain formula saves an fp32 copy of every row (``logits.float() / T``): a second
    [B, n, V] tensor. This function saves the logits themselves (alive anyway as the model's output), the
    index and the per-position logsumexp [B, n], and recomputes one row's softmax at a time in backward:
    d logp / d logits = (onehot(index) - softmax(logits / T)) / T. Extra memory: one row's fp32 [n, V].
    """

    @staticmethod
    def forward(ctx, logits, index, temperature):
        """logits [B, n, V] any float dtype, index long [B, n], temperature float -> fp32 [B, n]."""
        per_token_logps, logsumexps = [], []
        for logits_row, index_row in zip(logits, index):  # [n, V], [n]
            row = logits_row.to(torch.promote_types(logits_row.dtype, torch.float32))  # bf16/fp16 -> fp32
            if temperature != 1.0:
                row = row / temperature
            logsumexp = torch.logsumexp(row, dim=-1)  # [n]
            per_token_logps.append(row.gather(-1, index_row.unsqueeze(-1)).squeeze(-1) - logsumexp)
            logsumexps.append(logsumexp)
        ctx.save_for_backward(logits, index, torch.stack(logsumexps))
        ctx.temperature = temperature
        return torch.stack(per_token_logps)  # [B, n] fp32

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        """grad_output fp32 [B, n] -> grad of the logits [B, n, V] in the logits' dtype (first order only)."""
        logits, index, logsumexps = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits)  # [B, n, V] in the logits' dtype
        for b in range(logits.size(0)):
            row = logits[b].to(logsumexps.dtype)
            if temperature != 1.0:
                row = row / temperature
            probs = torch.exp(row - logsumexps[b].unsqueeze(-1))  # [n, V] softmax
            grad_row = -probs * grad_output[b].unsqueeze(-1)
            grad_row.scatter_add_(-1, index[b].unsqueeze(-1), grad_output[b].unsqueeze(-1))
            grad_logits[b] = grad_row / temperature
        return grad_logits, None, None


def selective_log_softmax(logits, index, temperature=1.0):
    """log_softmax(logits / temperature, -1).gather(-1, index) without a [B, n, V] log-softmax tensor (chapter 8.2).

    logits: [B, n, V] any float dtype; index: long [B, n] -> fp32 [B, n] (fp64 for fp64 logits). Computed per
    row as logit[index] - logsumexp(logits), in fp32 (also under bf16 autocast), so the extra memory is one row's
    [n, V] at most, in forward and in backward (``SelectiveLogSoftmax``).
    """
    return SelectiveLogSoftmax.apply(logits, index, float(temperature))


def compute_per_token_logps(model, input_ids, n_keep, attention_mask=None, temperature=1.0, return_aux_loss=False):
    """Log-probs of the last ``n_keep`` tokens of each row (chapter 8.2).

    One forward over the full sequence keeps the logits of the last n_keep + 1 positions; position t
    predicts token t + 1, so ``logits[:, :-1]`` scores ``input_ids[:, -n_keep:]``.

    Args:
        model: a MiniMind causal LM (or its DDP wrapper: the call goes through it, so DDP sees the forward).
        input_ids: long [B, P + R]; attention_mask: [B, P + R] (1 = real token) or None.
        n_keep: R, the number of completion tokens to score.
        temperature: the sampling temperature (see the module docstring).
        return_aux_loss: also return the MoE router loss of this forward (0 without MoE).
    Returns:
        per_token_logps fp32 [B, R]; or (per_token_logps, aux_loss scalar) with ``return_aux_loss``. Entries
        after a row's EOS are finite but meaningless; callers mask them with completion_mask.
    """
    if n_keep <= 0:
        empty = torch.zeros((input_ids.size(0), 0), dtype=torch.float32, device=input_ids.device)
        return (empty, torch.zeros((), device=input_ids.device)) if return_aux_loss else empty
    out = model(input_ids, attention_mask=attention_mask, logits_to_keep=n_keep + 1)
    logits = out.logits[:, :-1, :]  # [B, R, V]
    per_token_logps = selective_log_softmax(logits, input_ids[:, -n_keep:], temperature)  # [B, R]
    return (per_token_logps, out.aux_loss) if return_aux_loss else per_token_logps


def compute_group_per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, num_generations,
                                  temperature=1.0, return_aux_loss=False):
    """``compute_per_token_logps`` for a rollout's groups, with each prompt's forward done once (chapter 8.2, 8.5).

    The G answers of a prompt share its P tokens, and the keys and values of those tokens do not depend on the
    answers (causal attention). So the prompts run once, [B, P], their keys and values are repeated for the G
    answers of each (``KVCache.repeat_interleave``), and the answers run on top, [B*G, R - 1]: the same
    log-probs as the [B*G, P + R] forward, with the prompt tokens computed B times instead of B*G. The
    gradient of the repeated keys and values sums over the G answers, as it does when the rows are separate
    (the "shared-prefix forward" of Prefix Grouper, Liu et al. 2025).

    Args:
        model: a dense MiniMind causal LM (or its DDP wrapper; both forwards go through it). With MoE the
            router loss would differ from the padded batch's (each forward's loss is a mean over its own
            tokens), which is why ``train_grpo.py`` refuses ``--shared_prefix 1 --use_moe 1``.
        prompt_ids, prompt_mask: long [B, P], the left-padded prompts before repetition.
        completion_ids, completion_mask: long [B*G, R], each prompt's G answers adjacent (P0,P0,..,P1,..),
            the mask 1 through the first EOS (``RolloutResult``).
        num_generations: G.
        temperature, return_aux_loss: as in ``compute_per_token_logps``.
    Returns:
        per_token_logps fp32 [B*G, R] (entries after a row's EOS finite but meaningless); with
        ``return_aux_loss``, (per_token_logps, aux_loss scalar: the two forwards' router losses added).
    Raises:
        ValueError: if completion_ids does not have B * num_generations rows.
    """
    batch, num_completion_tokens = prompt_ids.size(0), completion_ids.size(1)
    if completion_ids.size(0) != batch * num_generations:
        raise ValueError(f"{completion_ids.size(0)} completions for {batch} prompts x {num_generations} generations")
    if num_completion_tokens == 0:
        return compute_per_token_logps(model, completion_ids, 0, return_aux_loss=return_aux_loss)
    cache = KVCache(unwrap_model(model).config.num_hidden_layers)
    prompt_out = model(prompt_ids, attention_mask=prompt_mask, past_key_values=cache,
                       logits_to_keep=1)  # logits [B, 1, V]: the prompt's last position predicts answer token 0
    first_logits = prompt_out.logits.repeat_interleave(num_generations, dim=0)  # [B*G, 1, V]
    first_logps = selective_log_softmax(first_logits, completion_ids[:, :1], temperature)  # [B*G, 1]
    aux_loss = prompt_out.aux_loss
    if num_completion_tokens == 1:  # nothing after answer token 0 to predict from
        return (first_logps, aux_loss) if return_aux_loss else first_logps
    cache = cache.repeat_interleave(num_generations, extra_capacity=num_completion_tokens - 1)
    repeated_prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # [B*G, P]
    full_mask = torch.cat([repeated_prompt_mask, completion_mask[:, :-1]], dim=1)  # [B*G, P + R - 1]
    completion_out = model(completion_ids[:, :-1], attention_mask=full_mask,
                           past_key_values=cache)  # logits [B*G, R - 1, V]: answer token t predicts t + 1
    rest_logps = selective_log_softmax(completion_out.logits, completion_ids[:, 1:], temperature)  # [B*G, R - 1]
    per_token_logps = torch.cat([first_logps, rest_logps], dim=1)  # [B*G, R]
    if return_aux_loss:
        return per_token_logps, aux_loss + completion_out.aux_loss
    return per_token_logps


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
    metrics: dict of floats the engine measured for this batch (logged with the step's metrics), e.g. the
        SGLang engine's ``logprob_gap``.
    """
    output_ids: torch.Tensor
    completion_ids: torch.Tensor
    per_token_logps: torch.Tensor
    completions: list
    prompt_lens: torch.Tensor
    completion_mask: torch.Tensor
    prompt_mask: torch.Tensor
    metrics: dict = field(default_factory=dict)

    @property
    def attention_mask(self):
        """long [N, P + R]: prompt mask then completion mask, for forwards over ``output_ids``."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


def tokenize_prompts(tokenizer, prompts, max_seq_len, device):
    """Left-padded prompt batch, each prompt cut to its last ``max_seq_len`` tokens.

    Returns (prompt_ids long [B, P], attention_mask long [B, P], number of prompts that were cut).
    Cutting from the left keeps the generation prompt at the end.
    """
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]  # one batched call
    truncated = sum(len(ids) > max_seq_len for ids in encoded)
    encoded = [ids[-max_seq_len:] for ids in encoded]
    width = max(len(ids) for ids in encoded)
    prompt_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)  # [B, P]
    for i, ids in enumerate(encoded):
        prompt_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, width - len(ids):] = 1
    return prompt_ids.to(device), attention_mask.to(device), truncated


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

    def resume_state(self):
        """What a resumed run needs to continue this engine's bookkeeping (a dict; empty when there is none)."""
        return {}

    def load_resume_state(self, state):
        """Restore ``resume_state()``'s result (resume)."""


TORCH_LOGPROB_MODES = ("sampler", "recompute")


class TorchRolloutEngine(RolloutEngine):
    """Rollouts with the policy's own ``generate`` (KV cache allocated once per rollout) (chapter 8.2).

    ``logprobs_mode`` says where ``per_token_logps`` (log pi_old) come from:
      * "sampler" (default): recorded at sampling time from the logits the sampler already computed, as the
        chapter describes; no second forward. Equal to the recomputation within 1e-5 in fp32
        (``tests/test_rollout.py``); under bf16 autocast the two differ by bf16 rounding.
      * "recompute": one more no-grad forward over prompt + completion (the reference path).
    ``ignore_eos`` keeps sampling past EOS (for benchmarks that need full-length work; the completion
    mask still ends at the first EOS).
    """

    def __init__(self, policy_model, tokenizer, top_p=1.0, top_k=0, generator=None, logprobs_mode="sampler",
                 ignore_eos=False):
        if logprobs_mode not in TORCH_LOGPROB_MODES:
            raise ValueError(f"unknown --torch_logprobs {logprobs_mode!r}; valid: {', '.join(TORCH_LOGPROB_MODES)}")
        self.policy_model = policy_model
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.top_p = top_p
        self.top_k = top_k
        self.generator = generator
        self.logprobs_mode = logprobs_mode
        self.ignore_eos = ignore_eos

    @torch.no_grad()
    def rollout(self, prompt_ids, attention_mask, num_generations, max_new_tokens, temperature=1.0):
        model = unwrap_model(self.policy_model)
        was_training = model.training
        model.eval()
        prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [N, P]
        prompt_mask = attention_mask.repeat_interleave(num_generations, dim=0)  # [N, P]
        record_logps = self.logprobs_mode == "sampler"
        generated = model.generate(
            prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens, do_sample=True,
            temperature=temperature, top_p=self.top_p, top_k=self.top_k, eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id, generator=self.generator, ignore_eos=self.ignore_eos,
            return_logps=record_logps,
        )
        output_ids = generated[0] if record_logps else generated  # [N, P + R]
        completion_ids = output_ids[:, prompt_ids.size(1):]  # [N, R]
        completion_mask = completion_mask_from_ids(completion_ids, self.eos_token_id)  # [N, R]
        if record_logps:
            per_token_logps = generated[1]  # [N, R], recorded while sampling
        else:
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


# ----------------------------------------------------------------------------- SGLang over HTTP (chapter 8.2)
SGLANG_LOGPROB_MODES = ("recompute", "server")
RETRIED_HTTP_STATUSES = (502, 503, 504)


def sglang_sampling_params(temperature, top_p, top_k, max_new_tokens, eos_token_id):
    """The ``sampling_params`` of an SGLang ``/generate`` request, every field explicit.

    A server fills missing fields from the model folder's generation config, so nothing is left to it.
    Field names and meanings follow SGLang's ``SamplingParams`` (docs: "Sampling Parameters"): top_k = -1
    means no top-k (this project's flag uses 0 for that); generation stops on ``stop_token_ids``.
    """
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k if top_k > 0 else -1,
        "min_p": 0.0,
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": 0,
        "stop_token_ids": [eos_token_id],
        "ignore_eos": False,
        "skip_special_tokens": False,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
    }


def parse_sglang_output(output, index, max_new_tokens, eos_token_id, weight_version=None):
    """Completion token ids and their log-probs from one element of SGLang's ``/generate`` answer.

    SGLang answers a batched request with a JSON list in input order; each element holds ``output_ids``
    (the generated ids, ending with the EOS id when generation stopped on it; ``text`` leaves it out) and
    ``meta_info`` with ``output_token_logprobs`` ([logprob, token_id, text or null] per generated token),
    ``finish_reason`` ({"type": "stop" | "length" | "abort", ...}), ``completion_tokens`` and
    ``weight_version`` (the label of the weights that generated it: the server's ``--weight-version``,
    "default", until an ``/update_weights_from_disk`` request sets another) (SGLang ``io_struct.py`` /
    ``tokenizer_manager.py``).

    Args:
        output: one decoded JSON element; index: its position in the batch (for messages).
        weight_version: the label of the weights the trainer synced last; None skips the check (nothing
            synced yet, so the trainer does not know what the server holds).
    Returns:
        (token_ids list[int], logps list[float]) of equal length.
    Raises:
        RuntimeError: for an aborted request, an answer from other weights than ``weight_version`` (a server
            that was restarted, or that another client loaded other weights into: its rollouts would be
            trained on as if they came from the policy), missing log-probs (never padded), token ids in the
            log-prob triples that differ from ``output_ids`` (older servers put prompt tokens into
            ``output_ids``), counts that disagree, or more than ``max_new_tokens`` tokens.
    """
    where = f"SGLang /generate answer {index}"
    if not isinstance(output, dict) or "output_ids" not in output or "meta_info" not in output:
        keys = sorted(output) if isinstance(output, dict) else type(output).__name__
        raise RuntimeError(f"{where}: expected a dict with output_ids and meta_info, got {keys}")
    meta_info = output["meta_info"]
    finish_reason = meta_info.get("finish_reason") or {}
    if finish_reason.get("type") == "abort":
        raise RuntimeError(f"{where}: the server aborted the request ({finish_reason.get('message', finish_reason)});"
                           " an aborted rollout is not an empty answer, so the step stops here")
    if weight_version is not None and meta_info.get("weight_version") != weight_version:
        if "weight_version" not in meta_info:
            raise RuntimeError(f"{where}: no meta_info.weight_version, so the trainer cannot tell which weights "
                               "generated it; use an SGLang server that reports it (0.5.21 does)")
        raise RuntimeError(f"{where} came from weights {meta_info['weight_version']!r}, but the trainer synced "
                           f"{weight_version!r}: the server was restarted or another client loaded other weights "
                           "into it, so its rollouts are not the policy's. Give each run its own server, then "
                           "resume the run (the resumed run pushes its weights at start-up).")
    triples = meta_info.get("output_token_logprobs")
    if triples is None:
        raise RuntimeError(f"{where}: no meta_info.output_token_logprobs (the request sets return_logprob: true; "
                           "is this an SGLang /generate endpoint?)")
    token_ids = [int(t) for t in output["output_ids"]]
    triple_ids = [int(triple[1]) for triple in triples]
    if triple_ids != token_ids:
        raise RuntimeError(f"{where}: output_ids ({len(token_ids)} ids, starting {token_ids[:8]}) differ from the "
                           f"token ids of output_token_logprobs ({len(triple_ids)} ids, starting {triple_ids[:8]}); "
                           "older SGLang servers return stray prompt tokens in output_ids: upgrade SGLang")
    logps = [triple[0] for triple in triples]
    if any(logp is None for logp in logps):
        missing = [i for i, logp in enumerate(logps) if logp is None]
        raise RuntimeError(f"{where}: log-probs missing at completion positions {missing[:8]}; they are never "
                           "filled with zeros")
    if meta_info.get("completion_tokens", len(token_ids)) != len(token_ids):
        raise RuntimeError(f"{where}: completion_tokens {meta_info['completion_tokens']} != {len(token_ids)} "
                           "output_ids")
    if len(token_ids) > max_new_tokens:
        raise RuntimeError(f"{where}: {len(token_ids)} tokens for max_new_tokens {max_new_tokens}")
    if finish_reason.get("type") == "stop" and finish_reason.get("matched") == eos_token_id \
            and token_ids[-1:] != [eos_token_id]:
        raise RuntimeError(f"{where}: stopped on EOS {eos_token_id} but output_ids do not end with it")
    return token_ids, [float(logp) for logp in logps]


def check_sglang_prompts(prompt_ids, attention_mask, vocab_size):
    """Refuse prompts an SGLang server cannot take, before they are sent (one bad request stops the server).

    An SGLang server's scheduler crashes, and every process of the server exits, on a prompt with no token
    (``{"input_ids": [[]]}``) or with an id outside the model's vocabulary (SGLang 0.5.21); the engine would then
    retry a dead server. So both are refused here, with the rows and ids that are wrong.

    Args:
        prompt_ids: long [B, P]; attention_mask: [B, P] (1 = prompt token); vocab_size: the model's.
    Raises:
        ValueError: naming the rows with no prompt token, or the first ids outside [0, vocab_size).
    """
    mask = attention_mask.bool()  # [B, P]
    empty_rows = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty_rows:
        raise ValueError(f"SGLang rollout: prompt rows {empty_rows[:8]} have no token (attention_mask all 0); "
                         "an empty prompt crashes the SGLang server, so it is not sent")
    outside = mask & ((prompt_ids < 0) | (prompt_ids >= vocab_size))  # [B, P]
    if outside.any():
        rows, cols = outside.nonzero(as_tuple=True)
        found = [(int(r), int(prompt_ids[r, c])) for r, c in zip(rows[:8], cols[:8])]
        raise ValueError(f"SGLang rollout: prompt token ids outside the vocabulary [0, {vocab_size}) as (row, id): "
                         f"{found}; such an id crashes the SGLang server, so it is not sent (tokenizer and model "
                         "disagree?)")


class SGLangRolloutEngine(RolloutEngine):
    """Rollouts from an SGLang server over its HTTP API; weights synced through a shared folder (chapter 8.2).

    ``rollout`` refuses prompts that would crash the server (``check_sglang_prompts``: an empty prompt, an id
    outside the vocabulary), sends one batched ``/generate`` request (each prompt's unpadded ids, repeated in
    place, P0,P0,..,P1,..; every sampling parameter explicit; ``return_logprob: true``) and checks the answer
    (``parse_sglang_output``), including that every answer carries the ``weight_version`` label of the last
    sync, so a server that serves other weights stops the run. The old log-probs follow ``logprobs_mode``:
      * "recompute" (default): recomputed by the local policy with ``compute_per_token_logps``, the
        project's convention, whatever the server's settings;
      * "server": the server's own; on the first batch they are checked against a local recomputation and
        the run stops with instructions when the masked mean |gap| exceeds ``logprob_tolerance``.
    ``metrics["logprob_gap"]`` (masked mean |server - local|) is measured on every batch in recompute mode and
    on the checked batch in server mode.

    ``update_policy`` counts its calls and on every ``sync_interval``-th one: rank 0 writes the policy as a
    Qwen3ForCausalLM folder ``{shared_path}/policy_v{n}`` (n = weights pushed before; ``model/hf_qwen3.py``,
    written then renamed) and
    POSTs ``/update_weights_from_disk`` {model_path, flush_cache: true, weight_version: a label unique to this
    engine and push}; a reply without ``success`` raises
    with the server's ``message``; the other ranks learn the outcome by a broadcast. The previous folder is
    removed after a successful update. With ``sync_at_start`` the starting policy is pushed at construction,
    so the server never samples from other weights than the trainer's.

    Network errors (and HTTP 502/503/504) are retried ``max_retries`` times with exponential backoff
    (``backoff_s``, 2 x backoff_s, ...); then a RuntimeError names the URL and ``resume_hint``.

    Args:
        policy_model: the policy (or its DDP wrapper); tokenizer: its tokenizer (eos / pad ids, decoding).
        url: the server, e.g. "http://127.0.0.1:30000"; shared_path: a folder both trainer and server read.
        export_dtype: storage dtype of the synced weights.
        health_retries: /health attempts at start-up before the error with the launch command.
        session: a ``requests.Session`` (default: a new one).
    Raises:
        ValueError: for an unknown ``logprobs_mode`` or ``sync_interval`` < 1; from ``rollout``, for prompts
            the server cannot take.
        RuntimeError: at start-up when no server answers /health (naming the URL and the launch command); from
            ``rollout``, for an answer that fails the checks above.
    """

    def __init__(self, policy_model, tokenizer, url, shared_path, logprobs_mode="recompute", sync_interval=1,
                 top_p=1.0, top_k=0, export_dtype=torch.float32, logprob_tolerance=0.05, max_retries=5,
                 backoff_s=1.0, timeout_s=600.0, health_retries=5, sync_at_start=True, resume_hint="",
                 session=None):
        if logprobs_mode not in SGLANG_LOGPROB_MODES:
            raise ValueError(f"unknown SGLang log-prob mode {logprobs_mode!r}; "
                             f"valid: {', '.join(SGLANG_LOGPROB_MODES)}")
        if sync_interval < 1:
            raise ValueError(f"sync_interval must be >= 1, got {sync_interval}")
        self.policy_model = policy_model
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.url = url.rstrip("/")
        self.shared_path = os.path.abspath(shared_path)
        self.logprobs_mode = logprobs_mode
        self.sync_interval = sync_interval
        self.top_p = top_p
        self.top_k = top_k
        self.export_dtype = export_dtype
        self.logprob_tolerance = logprob_tolerance
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.resume_hint = resume_hint
        self.session = session or requests.Session()
        self.num_update_calls = 0
        self.weight_version = 0
        self.version_label = os.urandom(4).hex()  # tells this engine's weight versions from any other client's
        self.server_weight_version = None  # label of the weights synced last; None until the first push
        self.synced_folder = None
        self.server_logps_checked = False
        launch_folder = os.path.join(self.shared_path, "policy_v0")
        if sync_at_start and is_main_process():
            self.export_policy(policy_model, launch_folder)
        self.wait_for_server(health_retries, launch_folder)
        if sync_at_start:
            self.push_weights(policy_model, launch_folder)

    # -- HTTP
    def request(self, method, path, payload=None):
        """One HTTP call with bounded retries on network errors and 502/503/504; returns the ``Response``.

        Raises:
            RuntimeError: after ``max_retries`` retries, naming the URL, the last error and ``resume_hint``.
        """
        last_error = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.session.request(method, self.url + path, json=payload, timeout=self.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as err:
                last_error = f"{type(err).__name__}: {err}"
                continue
            if response.status_code not in RETRIED_HTTP_STATUSES:
                return response
            last_error = f"HTTP {response.status_code}: {response.text[:200]}"
        raise RuntimeError(f"SGLang server {self.url}{path} failed {self.max_retries + 1} times ({last_error}). "
                           f"Start the server again, then resume the run. {self.resume_hint}".rstrip())

    def wait_for_server(self, health_retries, launch_folder):
        """GET /health up to ``health_retries`` times with backoff (a starting server answers 503).

        Raises:
            RuntimeError: naming the URL and the command that starts a server on ``launch_folder``.
        """
        last_error = None
        for attempt in range(health_retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.session.get(self.url + "/health", timeout=10)
            except (requests.ConnectionError, requests.Timeout) as err:
                last_error = f"{type(err).__name__}: {err}"
                continue
            if response.status_code == 200:
                return
            last_error = f"HTTP {response.status_code}"
        port = urllib.parse.urlparse(self.url).port or 30000
        raise RuntimeError(
            f"no SGLang server answers at {self.url}/health after {health_retries} attempts ({last_error}). "
            f"Start one on the policy's weights, e.g. on a GPU (pip install sglang)\n"
            f"  python -m sglang.launch_server --model-path {launch_folder} --port {port} --host 127.0.0.1\n"
            f"or on a CPU (docs/sglang.md): bash scripts/setup_sglang_env.sh, then\n"
            f"  bash scripts/launch_sglang.sh {launch_folder} {port}\n"
            f"(the folder is written by the trainer at start-up; for other weights use "
            f"python scripts/convert_model.py to_hf --weight ... --out FOLDER), or pass --sglang_url.")

    # -- rollout
    @torch.no_grad()
    def rollout(self, prompt_ids, attention_mask, num_generations, max_new_tokens, temperature=1.0):
        model = unwrap_model(self.policy_model)
        device = prompt_ids.device
        check_sglang_prompts(prompt_ids, attention_mask, model.config.vocab_size)
        prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [N, P]
        prompt_mask = attention_mask.repeat_interleave(num_generations, dim=0)  # [N, P]
        input_ids = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]  # N unpadded lists
        payload = {
            "input_ids": input_ids,
            "sampling_params": sglang_sampling_params(temperature, self.top_p, self.top_k, max_new_tokens,
                                                      self.eos_token_id),
            "return_logprob": True,
        }
        response = self.request("POST", "/generate", payload)
        if response.status_code != 200:
            raise RuntimeError(f"SGLang {self.url}/generate answered HTTP {response.status_code}: "
                               f"{response.text[:500]!r} to a request with sampling_params "
                               f"{sorted(payload['sampling_params'])}. SGLang answers a sampling parameter it does "
                               "not know, or a value it cannot take, with HTTP 400 or a bare HTTP 500 (0.5.21); the "
                               "server's log names the cause.")
        outputs = response.json()
        if not isinstance(outputs, list) or len(outputs) != len(input_ids):
            got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
            raise RuntimeError(f"SGLang {self.url}/generate: expected a list of {len(input_ids)} answers, got {got}")
        parsed = [parse_sglang_output(output, i, max_new_tokens, self.eos_token_id, self.server_weight_version)
                  for i, output in enumerate(outputs)]

        gen_len = max(len(token_ids) for token_ids, _ in parsed)  # R
        completion_ids = torch.full((len(parsed), gen_len), self.pad_token_id, dtype=torch.long)  # [N, R]
        server_per_token_logps = torch.zeros((len(parsed), gen_len), dtype=torch.float32)  # [N, R], 0 = no token
        length_mask = torch.zeros((len(parsed), gen_len), dtype=torch.long)  # [N, R]
        for i, (token_ids, logps) in enumerate(parsed):
            completion_ids[i, :len(token_ids)] = torch.tensor(token_ids, dtype=torch.long)
            server_per_token_logps[i, :len(logps)] = torch.tensor(logps, dtype=torch.float32)
            length_mask[i, :len(token_ids)] = 1
        completion_ids = completion_ids.to(device)
        server_per_token_logps = server_per_token_logps.to(device)
        completion_mask = completion_mask_from_ids(completion_ids, self.eos_token_id) * length_mask.to(device)
        output_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P + R]
        full_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P + R]

        metrics = {}
        per_token_logps = server_per_token_logps
        if self.logprobs_mode == "recompute" or not self.server_logps_checked:
            was_training = model.training
            model.eval()
            local_per_token_logps = compute_per_token_logps(model, output_ids, gen_len, full_mask,
                                                            temperature)  # [N, R]
            model.train(was_training)
            gap = masked_mean((server_per_token_logps - local_per_token_logps).abs(), completion_mask).item()
            metrics["logprob_gap"] = gap
            if self.logprobs_mode == "recompute":
                per_token_logps = local_per_token_logps
            else:
                self.check_server_logps(gap, temperature)
        return RolloutResult(
            output_ids=output_ids,
            completion_ids=completion_ids,
            per_token_logps=per_token_logps,
            completions=decode_completions(self.tokenizer, completion_ids, completion_mask, self.eos_token_id),
            prompt_lens=prompt_mask.sum(dim=1),
            completion_mask=completion_mask,
            prompt_mask=prompt_mask,
            metrics=metrics,
        )

    def check_server_logps(self, gap, temperature):
        """First batch of ``--sglang_logprobs server``: stop unless the server's log-probs are the trainer's.

        Raises:
            RuntimeError: when ``gap`` (masked mean |server - local|) exceeds ``logprob_tolerance``.
        """
        if gap > self.logprob_tolerance:
            raise RuntimeError(
                f"--sglang_logprobs server: the server's log-probs differ from the trainer's by a mean of {gap:.4f} "
                f"per token (tolerance {self.logprob_tolerance}) at temperature {temperature}. The trainer uses "
                f"log softmax(logits / temperature), SGLang's default: start the server WITHOUT "
                f"SGLANG_RETURN_ORIGINAL_LOGPROB=1, sync the same weights in full precision (--sglang_export_dtype "
                f"float32, server --dtype float32), or run with --sglang_logprobs recompute (the default).")
        self.server_logps_checked = True

    # -- weight sync
    def export_policy(self, model, folder):
        """Write ``model``'s weights (and the tokenizer) as a Qwen3ForCausalLM folder (rank 0 only)."""
        raw = unwrap_model(model)
        return save_qwen3_folder(raw.state_dict(), raw.config, folder, tokenizer=self.tokenizer,
                                 dtype=self.export_dtype)

    def post_update(self, folder, weight_version):
        """POST /update_weights_from_disk {model_path, flush_cache: true, weight_version}.

        The server labels every later answer with ``weight_version`` (``meta_info.weight_version``); ``rollout``
        checks the label. A failed update (HTTP 400, ``success: false``) leaves the server on its old weights.

        Raises:
            RuntimeError: with the server's ``message`` unless the JSON answer says ``success``.
        """
        response = self.request("POST", "/update_weights_from_disk",
                                {"model_path": folder, "flush_cache": True, "weight_version": weight_version})
        try:
            body = response.json()
        except ValueError:
            body = {"success": False, "message": response.text[:500]}
        if response.status_code != 200 or not body.get("success"):
            raise RuntimeError(f"SGLang {self.url}/update_weights_from_disk failed for {folder} "
                               f"(HTTP {response.status_code}): {body.get('message')}")

    def push_weights(self, model, folder=None):
        """Rank 0 exports (unless ``folder`` is already written) and asks the server to load it under the label
        ``{version_label}-v{n}``; every rank raises on failure and learns the label (both broadcast from rank 0)."""
        error, caught = None, None
        version = f"{self.version_label}-v{self.weight_version}"
        if is_main_process():
            try:
                if folder is None:
                    folder = self.export_policy(model, os.path.join(self.shared_path,
                                                                    f"policy_v{self.weight_version}"))
                self.post_update(folder, version)
                if self.synced_folder and self.synced_folder != folder:
                    shutil.rmtree(self.synced_folder, ignore_errors=True)
                self.synced_folder = folder
            except (RuntimeError, OSError, ValueError) as err:
                error, caught = f"{type(err).__name__}: {err}", err
        if dist.is_initialized():
            outcome = [error, version]
            dist.broadcast_object_list(outcome, src=0)
            error, version = outcome
        if caught is not None:
            raise caught
        if error is not None:
            raise RuntimeError(f"rank 0 could not sync the policy to SGLang: {error}")
        self.server_weight_version = version
        self.weight_version += 1

    def resume_state(self):
        """The sync cadence and the folder counter: without them a resume with ``sync_interval`` > 1 would push
        on other steps than the run it continues."""
        return {"num_update_calls": self.num_update_calls, "weight_version": self.weight_version}

    def load_resume_state(self, state):
        """Continue the cadence of ``resume_state()``: the next push happens on the call the saved run would have
        made it (the start-up push of the restored policy already happened). An empty state (a resume file of
        ``--rollout_engine torch``) starts the cadence afresh."""
        self.num_update_calls = int(state.get("num_update_calls", 0))
        self.weight_version = max(self.weight_version, int(state.get("weight_version", 0)))

    def update_policy(self, model):
        """Every ``sync_interval``-th call, push ``model``'s weights to the server (see the class docstring)."""
        self.policy_model = model
        self.num_update_calls += 1
        if self.num_update_calls % self.sync_interval == 0:
            self.push_weights(model)


ROLLOUT_ENGINES = ("torch", "sglang")


def create_rollout_engine(engine_type, policy_model, tokenizer, **kwargs):
    """Factory for ``--rollout_engine`` (chapter 8.2); ``kwargs`` go to the engine's constructor.

    Raises:
        ValueError: for an unknown engine type, naming the valid ones.
    """
    if engine_type == "torch":
        return TorchRolloutEngine(policy_model, tokenizer, **kwargs)
    if engine_type == "sglang":
        return SGLangRolloutEngine(policy_model, tokenizer, **kwargs)
    raise ValueError(f"unknown --rollout_engine {engine_type!r}; valid: {', '.join(ROLLOUT_ENGINES)}")
