"""Rollout engines (chapter 8.2): sample completions and record their per-token log-probs.

``RolloutEngine`` is a small abstract base (``rollout``, ``update_policy``); ``TorchRolloutEngine`` samples with the
policy's own ``generate``, ``SGLangRolloutEngine`` from an SGLang server; ``create_rollout_engine`` picks one.

Log-prob convention (one for old, new and reference log-probs): log pi(token | prefix) of softmax(logits /
temperature), without top-p / top-k truncation; SGLang's default too (unless ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``).
"""

import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from dataset.lm_dataset import prompt_tail
from model.hf_qwen3 import save_qwen3_folder
from trainer.infra.distributed import is_main_process, run_on_rank0, unwrap_model
from trainer.infra.fsdp import whole_model
from trainer.infra.errors import ServerError
from trainer.infra.lora import merged_state_dict
from trainer.infra.sglang_client import (
    ROLLOUT_ENGINES,
    SGLANG_LOGPROB_MODES,
    SGLangClient,
    check_sglang_prompts,
    sglang_sampling_params,
)
from trainer.speed.selective_log_softmax import selective_log_softmax, token_entropies
from trainer.trainer_utils import completion_mask_from_ids, masked_mean


class PolicyForward(NamedTuple):
    """What ``compute_per_token_logps`` returns: the completion's log-probs, the MoE router loss, the entropies."""

    per_token_logps: torch.Tensor  # fp32 [B, R], log pi of each completion token (with grad when the model has it)
    aux_loss: torch.Tensor  # scalar, the MoE load-balancing loss (0 for a dense model)
    entropies: Optional[torch.Tensor]  # fp32 [B, R], each position's entropy (no grad); None unless asked for


def compute_per_token_logps(model, input_ids, n_keep, attention_mask=None, temperature=1.0, compute_entropy=False):
    """Log-probs of the last ``n_keep`` = R tokens of each row in one forward (chapter 8.2; TRL's
    ``_get_per_token_logps_and_entropies``): the logits of the last R + 1 positions, position t predicting t + 1.

    model: a MiniMind causal LM or its DDP wrapper (the call goes through it). input_ids: long [B, P + R];
    attention_mask: [B, P + R] (1 = real token) or None; temperature: the sampling temperature (module docstring).
    Returns ``PolicyForward``: per_token_logps fp32 [B, R] (finite but meaningless after a row's EOS: callers mask
    them), the forward's aux_loss, and the token entropies fp32 [B, R] with ``compute_entropy`` (else None).
    """
    if n_keep <= 0:
        empty = torch.zeros((input_ids.size(0), 0), dtype=torch.float32, device=input_ids.device)  # [B, 0]
        return PolicyForward(empty, torch.zeros((), device=input_ids.device), empty if compute_entropy else None)
    out = model(input_ids, attention_mask=attention_mask, logits_to_keep=n_keep + 1)
    logits = out.logits[:, :-1, :]  # [B, R, V]
    per_token_logps = selective_log_softmax(logits, input_ids[:, -n_keep:], temperature)  # [B, R]
    entropies = token_entropies(logits, temperature) if compute_entropy else None  # [B, R]
    return PolicyForward(per_token_logps, out.aux_loss, entropies)


@dataclass
class RolloutResult:
    """What a rollout returns: N = B * num_generations rows, R completion tokens."""

    output_ids: torch.Tensor  # long [N, P + R], prompts (left-padded) then completions (padded after EOS)
    completion_ids: torch.Tensor  # long [N, R]
    per_token_logps: torch.Tensor  # fp32 [N, R], log pi_old of each completion token at sampling time (no grad)
    completions: list  # N decoded completions up to (not including) the first EOS
    completion_mask: torch.Tensor  # long [N, R], 1 through the first EOS (``completion_mask_from_ids``)
    prompt_mask: torch.Tensor  # long [N, P], the prompts' attention mask
    metrics: dict = field(default_factory=dict)  # floats the engine measured (SGLang: ``logprob_gap``)
    sampling_per_token_logps: Optional[torch.Tensor] = None  # fp32 [N, R], the server's log-probs (SGLang), else None

    @property
    def attention_mask(self):
        """long [N, P + R]: prompt mask then completion mask, for forwards over ``output_ids``."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


@dataclass(frozen=True)
class RolloutRoles:
    """What a step's rollout uses besides its batch (chapter 8.1): the sampler and the frozen roles."""

    rollout_engine: object  # samples the answers (8.2); the agent script's SGLang engine, or None: its own generate
    tokenizer: object
    reward_fn: object  # calculate_rewards (8.3), or a function with its arguments and result
    reward_model: object = None  # the external reward model (LMForRewardModel), None with --reward_model_path none
    ref_model: object = None  # pi_ref, frozen; None without a KL (--beta 0)


def tokenize_prompts(tokenizer, prompts, max_seq_len, device):
    """Left-padded prompt batch, each prompt cut to its last ``max_seq_len`` tokens (the generation prompt stays):
    (prompt_ids long [B, P], attention_mask long [B, P], number of prompts that were cut)."""
    prompts = [prompt_tail(prompt, max_seq_len, tokenizer) for prompt in prompts]  # a huge prompt: its end only
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]  # one batched call
    truncated = sum(len(ids) > max_seq_len for ids in encoded)
    encoded = [ids[-max_seq_len:] for ids in encoded]
    width = max(len(ids) for ids in encoded)
    prompt_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)  # [B, P]
    for i, ids in enumerate(encoded):
        prompt_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, width - len(ids) :] = 1
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


class TorchRolloutEngine(RolloutEngine):
    """Rollouts with the policy's own ``generate`` (KV cache allocated once per rollout) (chapter 8.2): log pi_old
    is recorded while sampling, as the chapter describes (equal to a recomputation within 1e-5 in fp32,
    ``tests/test_rollout.py``)."""

    def __init__(self, policy_model, tokenizer, top_p=1.0, top_k=0, generator=None):
        self.policy_model = policy_model
        self.tokenizer = tokenizer
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
        output_ids, per_token_logps = model.generate(
            prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            generator=self.generator,
        )  # [N, P + R], [N, R] recorded while sampling
        completion_ids = output_ids[:, prompt_ids.size(1) :]  # [N, R]
        completion_mask = completion_mask_from_ids(completion_ids, self.tokenizer.eos_token_id)  # [N, R]
        model.train(was_training)
        return RolloutResult(
            output_ids=output_ids,
            completion_ids=completion_ids,
            per_token_logps=per_token_logps,
            completions=decode_completions(
                self.tokenizer, completion_ids, completion_mask, self.tokenizer.eos_token_id
            ),
            completion_mask=completion_mask,
            prompt_mask=prompt_mask,
        )

    def update_policy(self, model):
        # The engine samples from the training model itself: its weights are always current.
        self.policy_model = model


class SGLangRolloutEngine(RolloutEngine):
    """Rollouts from an SGLang server over HTTP; the policy's weights synced to it through a shared folder (8.2).

    ``rollout`` sends the prompts in one ``/generate`` request and pads the answers into tensors; ``SGLangClient``
    checks every answer, including its ``weight_version`` (a server serving other weights stops the run). Old
    log-probs: "recompute" (default) takes the local policy's; "server" the server's, checked on the first batch
    against the local ones (masked mean |gap| <= ``logprob_tolerance``, reported as ``metrics["logprob_gap"]``);
    with ``rollout_correction`` the local ones on every batch, the server's beside them (``sampling_per_token_logps``,
    for ``grpo_family.rollout_correction``: TRL's construction).
    The constructor pushes the starting policy; ``update_policy`` saves it as a Qwen3ForCausalLM folder
    ``{shared_path}/policy_v{n}`` (rank 0) and asks the server to load it, every ``sync_interval``-th call.
    ``client_options`` (url, retries, timeouts, ``resume_hint``, session) go to ``SGLangClient``.
    Raises ValueError (an unknown ``logprobs_mode``, ``sync_interval`` < 1, prompts the server cannot take) and
    RuntimeError (no server answers /health at start-up, or an answer fails the checks).
    """

    def __init__(
        self,
        policy_model,
        tokenizer,
        url,
        shared_path,
        logprobs_mode="recompute",
        sync_interval=1,
        top_p=1.0,
        top_k=0,
        export_dtype=torch.float32,
        logprob_tolerance=0.05,
        health_retries=5,
        rollout_correction=False,
        **client_options,
    ):
        if logprobs_mode not in SGLANG_LOGPROB_MODES:
            raise ValueError(
                f"unknown SGLang log-prob mode {logprobs_mode!r}; valid: {', '.join(SGLANG_LOGPROB_MODES)}"
            )
        if sync_interval < 1:
            raise ValueError(f"sync_interval must be >= 1, got {sync_interval}")
        self.policy_model = policy_model
        self.tokenizer = tokenizer
        self.client = SGLangClient(url, **client_options)
        self.shared_path = os.path.abspath(shared_path)
        self.sampling = {"top_p": top_p, "top_k": top_k}
        self.logprobs_mode = logprobs_mode
        self.rollout_correction = rollout_correction  # the old log-probs stay the trainer's; the server's weigh them
        self.logprob_tolerance = logprob_tolerance  # None once the server's log-probs passed the check
        self.export_dtype = export_dtype
        self.sync_interval = sync_interval
        self.num_update_calls = 0
        launch_folder = os.path.join(self.shared_path, "policy_v0")
        whole = whole_model(policy_model)  # --fsdp 1: gathered on rank 0 (a collective), the model itself otherwise
        if is_main_process():
            self.export_policy(whole, launch_folder)
        del whole
        self.client.wait_for_server(health_retries, launch_folder)
        self.push_weights(policy_model, launch_folder)

    @torch.no_grad()
    def rollout(self, prompt_ids, attention_mask, num_generations, max_new_tokens, temperature=1.0):
        model = unwrap_model(self.policy_model)
        check_sglang_prompts(prompt_ids, attention_mask, model.config.vocab_size)
        prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [N, P]
        prompt_mask = attention_mask.repeat_interleave(num_generations, dim=0)  # [N, P]
        input_ids = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]  # N unpadded lists
        sampling_params = sglang_sampling_params(
            temperature, self.sampling["top_p"], self.sampling["top_k"], max_new_tokens, self.tokenizer.eos_token_id
        )
        answers = self.client.generate(input_ids, sampling_params)  # N (token ids, log-probs), checked

        gen_len = max(len(token_ids) for token_ids, _ in answers)  # R
        completion_ids = torch.full((len(answers), gen_len), self.tokenizer.pad_token_id, dtype=torch.long)  # [N, R]
        server_per_token_logps = torch.zeros((len(answers), gen_len), dtype=torch.float32)  # [N, R]
        length_mask = torch.zeros((len(answers), gen_len), dtype=torch.long)  # [N, R], 1 = a returned token
        for i, (token_ids, logps) in enumerate(answers):
            completion_ids[i, : len(token_ids)] = torch.tensor(token_ids, dtype=torch.long)
            server_per_token_logps[i, : len(logps)] = torch.tensor(logps, dtype=torch.float32)
            length_mask[i, : len(token_ids)] = 1
        completion_ids = completion_ids.to(prompt_ids.device)
        completion_mask = completion_mask_from_ids(completion_ids, self.tokenizer.eos_token_id) * length_mask.to(
            prompt_ids.device
        )  # [N, R]
        output_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P + R]
        per_token_logps, metrics = self.old_per_token_logps(
            model,
            output_ids,
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_mask,
            server_per_token_logps.to(prompt_ids.device),
            temperature,
        )
        return RolloutResult(
            output_ids=output_ids,
            completion_ids=completion_ids,
            per_token_logps=per_token_logps,
            completions=decode_completions(
                self.tokenizer, completion_ids, completion_mask, self.tokenizer.eos_token_id
            ),
            completion_mask=completion_mask,
            prompt_mask=prompt_mask,
            metrics=metrics,
            sampling_per_token_logps=server_per_token_logps.to(prompt_ids.device) * completion_mask,
        )

    def old_per_token_logps(self, model, output_ids, full_mask, completion_mask, server_per_token_logps, temperature):
        """(log pi_old [N, R], metrics) by ``logprobs_mode`` (and ``rollout_correction``); raises RuntimeError when
        the server's log-probs fail the first-batch check (naming the temperature convention and the fixes)."""
        if self.logprobs_mode == "server" and self.logprob_tolerance is None and not self.rollout_correction:
            return server_per_token_logps, {}
        was_training = model.training
        model.eval()
        local_per_token_logps = compute_per_token_logps(
            model, output_ids, completion_mask.size(1), full_mask, temperature
        ).per_token_logps  # [N, R]
        model.train(was_training)
        gap = masked_mean((server_per_token_logps - local_per_token_logps).abs(), completion_mask).item()
        if self.logprobs_mode == "recompute" or (self.rollout_correction and self.logprob_tolerance is None):
            return local_per_token_logps, {"logprob_gap": gap}
        if gap > self.logprob_tolerance:
            raise ServerError(
                f"--sglang_logprobs server: the server's log-probs differ from the trainer's by a mean of {gap:.4f} "
                f"per token (tolerance {self.logprob_tolerance}) at temperature {temperature}. The trainer uses "
                f"log softmax(logits / temperature), SGLang's default: start the server WITHOUT "
                f"SGLANG_RETURN_ORIGINAL_LOGPROB=1, sync the same weights in full precision (--sglang_export_dtype "
                f"float32, server --dtype float32), or run with --sglang_logprobs recompute (the default)."
            )
        self.logprob_tolerance = None
        return (local_per_token_logps if self.rollout_correction else server_per_token_logps), {"logprob_gap": gap}

    def update_policy(self, model):
        """Every ``sync_interval``-th call: save ``model``'s weights and ask the server to load them."""
        self.policy_model = model
        self.num_update_calls += 1
        if self.num_update_calls % self.sync_interval == 0:
            self.push_weights(model)

    def export_policy(self, model, folder):
        """Write ``model``'s weights (and the tokenizer) as a Qwen3ForCausalLM folder (``model/hf_qwen3.py``)."""
        raw = unwrap_model(model)
        return save_qwen3_folder(
            merged_state_dict(raw), raw.config, folder, tokenizer=self.tokenizer, dtype=self.export_dtype
        )

    def push_weights(self, model, folder=None):
        """Rank 0 saves ``model`` to ``policy_v{n}`` (unless ``folder`` is given, already written), asks the server
        to load it and removes the previous folder; every rank raises when that failed, and records the version.
        A collective: under ``--fsdp 1`` every rank gathers the whole weights onto rank 0 first."""
        previous = os.path.join(self.shared_path, f"policy_v{self.client.weight_pushes - 1}")
        whole = model if folder else whole_model(model)  # --fsdp 1: gathered once per sync, on rank 0

        def save_and_load():
            target = folder or self.export_policy(
                whole, os.path.join(self.shared_path, f"policy_v{self.client.weight_pushes}")
            )
            self.client.update_weights_from_disk(target)
            if previous != target:
                shutil.rmtree(previous, ignore_errors=True)

        run_on_rank0(save_and_load, "syncing the policy to SGLang")
        self.client.weights_pushed()

    def resume_state(self):
        """The sync cadence and the folder counter: without them a resume with ``sync_interval`` > 1 would push
        on other steps than the run it continues."""
        return {"num_update_calls": self.num_update_calls, "weight_version": self.client.weight_pushes}

    def load_resume_state(self, state):
        """Continue the cadence of ``resume_state()``: the next push happens on the call the saved run would have
        made it (the start-up push of the restored policy already happened). An empty state (a resume file of
        ``--rollout_engine torch``) starts the cadence afresh."""
        self.num_update_calls = int(state.get("num_update_calls", 0))
        self.client.weight_pushes = max(self.client.weight_pushes, int(state.get("weight_version", 0)))


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
