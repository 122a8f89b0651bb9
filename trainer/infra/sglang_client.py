"""The HTTP protocol of an SGLang server, as ``SGLangRolloutEngine`` (chapter 8.2) uses it, with its checks:
retries and /health, the ``/generate`` request and the checks on its answer, ``/update_weights_from_disk`` and the
weight version every answer must carry, and the prompts a server cannot take.

Field names and meanings follow SGLang 0.5.21 (``io_struct.py``, ``tokenizer_manager.py``; docs: "Sampling
Parameters"). Infrastructure, not RL: a learner can skip this file.
"""

import json
import math
import os
import threading
import time
import urllib.parse

import requests

from trainer.infra.distributed import broadcast_from_rank0
from trainer.infra.stopping import stop_received
from trainer.infra.errors import InputError, ServerError

ROLLOUT_ENGINES = ("torch", "sglang")  # --rollout_engine: the policy's own generate, or an SGLang server
SGLANG_LOGPROB_MODES = ("recompute", "server")  # --sglang_logprobs: old log-probs by the trainer, or the server's
RETRIED_HTTP_STATUSES = (502, 503, 504)
STOP_GRACE_S = 10.0  # seconds an answer is awaited after a stop request (a CPU server answers a batch in about 1 s)


def sglang_sampling_params(temperature, top_p, top_k, max_new_tokens, eos_token_id):
    """The ``sampling_params`` of a ``/generate`` request, every field explicit: a server fills missing fields from
    the model folder's generation config, so nothing is left to it. top_k = -1 means no top-k (this project's flag
    uses 0 for that); generation stops on ``stop_token_ids``."""
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


def parse_sglang_output(output, index, max_new_tokens, eos_token_id, weight_version=None, vocab_size=None, url=""):
    """Completion token ids and their log-probs from one element of SGLang's ``/generate`` answer, every field checked
    as any input is.

    SGLang answers a batched request with a JSON list in input order; each element holds ``output_ids`` (the
    generated ids, ending with the EOS id when generation stopped on it) and ``meta_info`` with
    ``output_token_logprobs`` ([logprob, token_id, text or null] per generated token), ``finish_reason``
    ({"type": "stop" | "length" | "abort", ...}), ``completion_tokens`` and ``weight_version`` (the label of the
    weights that generated it: "default" until an ``/update_weights_from_disk`` request sets another).

    Args:
        output: one decoded JSON element; index: its position in the batch (for messages).
        weight_version: the label of the weights the trainer synced last; None skips the check (nothing
            synced yet, so the trainer does not know what the server holds).
        vocab_size: ids must lie in [0, vocab_size) (None: not checked).
        url: the server's address, named in the messages.
    Returns:
        (token_ids list[int], logps list[float]) of equal length, at least one token, finite log-probs.
    Raises:
        ServerError (a RuntimeError): for an aborted request, an answer from other weights than
            ``weight_version`` (a server that was restarted, or that another client loaded other weights into: its
            rollouts would be trained on as if they came from the policy), a field of the wrong type, ids that are
            not integers in [0, vocab_size), missing or non-finite log-probs (never padded), token ids in the
            log-prob triples that differ from ``output_ids`` (older servers put prompt tokens into
            ``output_ids``), counts that disagree, no token at all, or more than ``max_new_tokens`` tokens.
    """
    where = f"SGLang {url}/generate answer {index}"
    if not isinstance(output, dict) or "output_ids" not in output or "meta_info" not in output:
        keys = sorted(output) if isinstance(output, dict) else type(output).__name__
        raise ServerError(f"{where}: expected a dict with output_ids and meta_info, got {keys}")
    meta_info = output["meta_info"]
    if not isinstance(meta_info, dict):
        raise ServerError(f"{where}: meta_info is a JSON {type(meta_info).__name__}, expected an object")
    finish_reason = meta_info.get("finish_reason") or {}
    if not isinstance(finish_reason, dict):
        raise ServerError(f"{where}: meta_info.finish_reason is {finish_reason!r}, expected an object or null")
    if finish_reason.get("type") == "abort":
        raise ServerError(
            f"{where}: the server aborted the request ({finish_reason.get('message', finish_reason)});"
            " an aborted rollout is not an empty answer, so the step stops here"
        )
    if weight_version is not None and meta_info.get("weight_version") != weight_version:
        if "weight_version" not in meta_info:
            raise ServerError(
                f"{where}: no meta_info.weight_version, so the trainer cannot tell which weights "
                "generated it; use an SGLang server that reports it (0.5.21 does)"
            )
        raise ServerError(
            f"{where} came from weights {meta_info['weight_version']!r}, but the trainer synced "
            f"{weight_version!r}: the server was restarted or another client loaded other weights "
            "into it, so its rollouts are not the policy's. Give each run its own server, then "
            "resume the run (the resumed run pushes its weights at start-up)."
        )
    triples = meta_info.get("output_token_logprobs")
    if triples is None:
        raise ServerError(
            f"{where}: no meta_info.output_token_logprobs (the request sets return_logprob: true; "
            "is this an SGLang /generate endpoint?)"
        )
    token_ids = output["output_ids"]
    if not isinstance(token_ids, list) or not isinstance(triples, list):
        raise ServerError(
            f"{where}: output_ids and meta_info.output_token_logprobs must be JSON lists, got "
            f"{type(token_ids).__name__} and {type(triples).__name__}"
        )
    short = [i for i, triple in enumerate(triples) if not isinstance(triple, list) or len(triple) < 2]
    if short:
        raise ServerError(
            f"{where}: output_token_logprobs entries {short[:8]} are not [logprob, token_id, ...] "
            f"(first: {triples[short[0]]!r})"
        )
    check_token_ids(f"{where}: output_ids", token_ids, vocab_size)
    triple_ids = [triple[1] for triple in triples]
    check_token_ids(f"{where}: the token ids of output_token_logprobs", triple_ids, vocab_size)
    if triple_ids != token_ids:
        raise ServerError(
            f"{where}: output_ids ({len(token_ids)} ids, starting {token_ids[:8]}) differ from the "
            f"token ids of output_token_logprobs ({len(triple_ids)} ids, starting {triple_ids[:8]}); "
            "older SGLang servers return stray prompt tokens in output_ids: upgrade SGLang"
        )
    logps = [triple[0] for triple in triples]
    if any(logp is None for logp in logps):
        missing = [i for i, logp in enumerate(logps) if logp is None]
        raise ServerError(
            f"{where}: log-probs missing at completion positions {missing[:8]}; they are never filled with zeros"
        )
    bad = [i for i, logp in enumerate(logps) if type(logp) not in (int, float) or not math.isfinite(logp)]
    if bad:
        raise ServerError(
            f"{where}: log-probs at completion positions {bad[:8]} are not finite numbers "
            f"(first: {logps[bad[0]]!r}); the server's numbers cannot be trained on"
        )
    completion_tokens = meta_info.get("completion_tokens", len(token_ids))
    if completion_tokens != len(token_ids) or type(completion_tokens) is not int:
        raise ServerError(f"{where}: completion_tokens {completion_tokens!r} != {len(token_ids)} output_ids")
    if not token_ids and max_new_tokens >= 1:
        raise ServerError(
            f"{where}: no token; a server generates at least one (the EOS) for max_new_tokens "
            f"{max_new_tokens}, so this answer cannot be trained on"
        )
    if len(token_ids) > max_new_tokens:
        raise ServerError(f"{where}: {len(token_ids)} tokens for max_new_tokens {max_new_tokens}")
    if (
        finish_reason.get("type") == "stop"
        and finish_reason.get("matched") == eos_token_id
        and token_ids[-1:] != [eos_token_id]
    ):
        raise ServerError(f"{where}: stopped on EOS {eos_token_id} but output_ids do not end with it")
    return list(token_ids), [float(logp) for logp in logps]


def check_token_ids(what, token_ids, vocab_size):
    """Raise RuntimeError naming ``what`` unless every id is a JSON integer in [0, vocab_size) (None: >= 0)."""
    bad = [
        (i, t)
        for i, t in enumerate(token_ids)
        if type(t) is not int or t < 0 or (vocab_size is not None and t >= vocab_size)
    ]
    if bad:
        limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ServerError(
            f"{what}: ids that are not integers in {limit} as (position, id): {bad[:8]}; the server "
            "and the trainer disagree on the model (or the reply is not SGLang's)"
        )


def check_sglang_prompts(prompt_ids, attention_mask, vocab_size):
    """Refuse prompts an SGLang server cannot take, before they are sent: its scheduler crashes, and every process
    of the server exits, on a prompt with no token or with an id outside the model's vocabulary (SGLang 0.5.21).

    Args:
        prompt_ids: long [B, P]; attention_mask: [B, P] (1 = prompt token); vocab_size: the model's.
    Raises:
        ValueError: naming the rows with no prompt token, or the first ids outside [0, vocab_size).
    """
    mask = attention_mask.bool()  # [B, P]
    empty_rows = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty_rows:
        raise InputError(
            f"SGLang rollout: prompt rows {empty_rows[:8]} have no token (attention_mask all 0); "
            "an empty prompt crashes the SGLang server, so it is not sent"
        )
    outside = mask & ((prompt_ids < 0) | (prompt_ids >= vocab_size))  # [B, P]
    if outside.any():
        rows, cols = outside.nonzero(as_tuple=True)
        found = [(int(r), int(prompt_ids[r, c])) for r, c in zip(rows[:8], cols[:8])]
        raise InputError(
            f"SGLang rollout: prompt token ids outside the vocabulary [0, {vocab_size}) as (row, id): "
            f"{found}; such an id crashes the SGLang server, so it is not sent (tokenizer and model "
            "disagree?)"
        )


class SGLangClient:
    """One SGLang server over HTTP: ``generate`` and ``update_weights_from_disk``, with bounded retries and the
    weight versions.

    Network errors and HTTP 502/503/504 are retried ``max_retries`` times with exponential backoff (``backoff_s``,
    2 x backoff_s, ...); then a RuntimeError names the URL and ``resume_hint``. Every weight push gets a label
    ``{version_label}-v{n}`` (n = pushes so far; the label is drawn on rank 0 and shared, so it is unique to this
    run), and every answer of ``generate`` must carry the label of the last push.
    """

    def __init__(
        self,
        url,
        max_retries=5,
        backoff_s=1.0,
        timeout_s=120.0,
        resume_hint="",
        session=None,
        vocab_size=None,
        stop_grace_s=STOP_GRACE_S,
    ):
        self.url = url.rstrip("/")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size
        self.stop_grace_s = stop_grace_s
        self.resume_hint = resume_hint
        self.session = session or requests.Session()
        self.version_label = broadcast_from_rank0(os.urandom(4).hex())
        self.weight_pushes = 0  # pushes made; the next one is labelled with this number
        self.server_weight_version = None  # label of the last push; None until the first

    def request(self, method, path, payload=None):
        """One HTTP call with the retries above; returns the ``Response``. A server that takes the request and does
        not answer within ``timeout_s`` (``--sglang_timeout``) is not asked again.

        Raises:
            RuntimeError: after ``max_retries`` retries, or at once after ``timeout_s`` without an answer, or
                ``stop_grace_s`` after a SIGTERM / Ctrl-C that arrived while waiting, naming the URL, the cause and
                ``resume_hint``.
        """
        last_error = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self.send(method, path, payload)
            except requests.ReadTimeout:
                raise ServerError(
                    f"SGLang server {self.url}{path} took the request but did not answer within "
                    f"--sglang_timeout {self.timeout_s:g} s: restart it (its log names the cause), "
                    f"then resume the run, or pass a larger --sglang_timeout if its steps are that "
                    f"slow. {self.resume_hint}".rstrip()
                ) from None
            except (requests.ConnectionError, requests.Timeout) as err:
                last_error = f"{type(err).__name__}: {err}"
                continue
            if response.status_code not in RETRIED_HTTP_STATUSES:
                return response
            last_error = f"HTTP {response.status_code}: {response.text[:200]}"
        raise ServerError(
            f"SGLang server {self.url}{path} failed {self.max_retries + 1} times ({last_error}). "
            f"Start the server again, then resume the run. {self.resume_hint}".rstrip()
        )

    def send(self, method, path, payload):
        """``session.request`` in a worker thread, so that a stop request is acted on while a server does not answer:
        once SIGTERM / Ctrl-C arrived (``stop_received``), the answer is awaited ``stop_grace_s`` more seconds.
        Raises what the request raises, or RuntimeError for the stop."""
        outcome = {}

        def call():
            try:
                outcome["response"] = self.session.request(
                    method, self.url + path, json=payload, timeout=self.timeout_s
                )
            except BaseException as err:  # handed to the waiting thread
                outcome["error"] = err

        worker = threading.Thread(target=call, daemon=True)  # a hung request does not hold the process at exit
        worker.start()
        stop_seen = None
        while worker.is_alive():
            worker.join(0.1)
            if stop_seen is None and stop_received():
                stop_seen = time.monotonic()
            if stop_seen is not None and worker.is_alive() and time.monotonic() - stop_seen > self.stop_grace_s:
                raise ServerError(
                    f"{stop_received()} received while SGLang server {self.url}{path} had not "
                    f"answered ({self.stop_grace_s:g} s more were given): the run stops without "
                    f"this step. {self.resume_hint}".rstrip()
                )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["response"]

    def wait_for_server(self, health_retries, launch_folder):
        """GET /health up to ``health_retries`` times with backoff (a starting server answers 503).

        Raises:
            RuntimeError: naming the URL and the commands that start a server on ``launch_folder``.
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
        raise ServerError(
            f"no SGLang server answers at {self.url}/health after {health_retries} attempts ({last_error}). "
            f"Start one on the policy's weights, e.g. on a GPU (pip install sglang)\n"
            f"  python -m sglang.launch_server --model-path {launch_folder} --port {port} --host 127.0.0.1\n"
            f"or on a CPU (docs/sglang.md): bash scripts/setup_sglang_env.sh, then\n"
            f"  bash scripts/launch_sglang.sh {launch_folder} {port}\n"
            f"(the folder is written by the trainer at start-up; for other weights use "
            f"python scripts/convert_model.py to_hf --weight ... --out FOLDER), or pass --sglang_url."
        )

    def generate(self, input_ids, sampling_params):
        """POST /generate for N unpadded prompts (``return_logprob: true``); every answer checked
        (``parse_sglang_output``). ``sampling_params``: one dict for all prompts, or a list of N (SGLang takes one
        per input: each row its own ``max_new_tokens``). Returns N (token_ids, logps) pairs.

        Raises:
            RuntimeError: an HTTP error (SGLang answers a sampling parameter it does not know, or a value it cannot
                take, with HTTP 400 or a bare 500), an answer that is not a list of N, or one that fails the checks.
        """
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}
        response = self.request("POST", "/generate", payload)
        if response.status_code != 200:
            raise ServerError(
                f"SGLang {self.url}/generate answered HTTP {response.status_code}: "
                f"{response.text[:500]!r} to a request with sampling_params "
                f"{sorted(sampling_params[0] if isinstance(sampling_params, list) else sampling_params)}"
                "; the server's log names the cause"
            )
        try:
            outputs = json.loads(response.content)  # NaN and Infinity parse, so the checks below name them
        except ValueError:
            raise ServerError(
                f"SGLang {self.url}/generate answered HTTP 200 with a body that is not JSON "
                f"(Content-Type {response.headers.get('Content-Type')!r}, starting "
                f"{response.text[:200]!r}): is --sglang_url an SGLang server?"
            ) from None
        if not isinstance(outputs, list) or len(outputs) != len(input_ids):
            got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
            raise ServerError(f"SGLang {self.url}/generate: expected a list of {len(input_ids)} answers, got {got}")
        per_row = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(outputs)
        return [
            parse_sglang_output(
                output,
                i,
                params["max_new_tokens"],
                params["stop_token_ids"][0],
                self.server_weight_version,
                self.vocab_size,
                self.url,
            )
            for i, (output, params) in enumerate(zip(outputs, per_row))
        ]

    def next_weight_version(self):
        """The label the next push gives its weights."""
        return f"{self.version_label}-v{self.weight_pushes}"

    def update_weights_from_disk(self, folder):
        """POST /update_weights_from_disk {model_path, flush_cache: true, weight_version: ``next_weight_version()``}
        (rank 0 only; every rank then calls ``weights_pushed``). A failed update (HTTP 400, ``success: false``)
        leaves the server on its old weights.

        Raises:
            RuntimeError: with the server's ``message`` unless the JSON answer says ``success``.
        """
        response = self.request(
            "POST",
            "/update_weights_from_disk",
            {"model_path": folder, "flush_cache": True, "weight_version": self.next_weight_version()},
        )
        try:
            body = response.json()
        except ValueError:
            body = {"success": False, "message": response.text[:500]}
        if response.status_code != 200 or not body.get("success"):
            raise ServerError(
                f"SGLang {self.url}/update_weights_from_disk failed for {folder} "
                f"(HTTP {response.status_code}): {body.get('message')}"
            )

    def weights_pushed(self):
        """Record a successful push on every rank: later answers must carry its label."""
        self.server_weight_version = self.next_weight_version()
        self.weight_pushes += 1
