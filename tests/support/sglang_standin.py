"""A stand-in for an SGLang server, for tests on machines without a GPU (a test fixture, not a product).

It serves the four endpoints ``SGLangRolloutEngine`` uses, with SGLang's request and response formats and
behaviour as documented (``python/sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``,
``sampling_params.py``, the "Sampling Parameters" and "SGLang for RL" docs):
  * GET /health -> 200 with an empty body;
  * POST /generate {input_ids: list[int] | list[list[int]], sampling_params, return_logprob} -> one JSON
    object, or a list in input order for a batch: ``text``, ``output_ids`` (with the EOS id when generation
    stopped on it), ``meta_info`` {id, finish_reason {"type": "stop", "matched": id} | {"type": "length",
    "length": n}, prompt_tokens, completion_tokens, cached_tokens, weight_version, output_token_logprobs
    [[logprob, id, null]]};
    log-probs are those of softmax(logits / temperature), or of softmax(logits) when the server was started
    with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (``return_original_logprob=True`` here);
    missing sampling parameters take SGLang's defaults (max_new_tokens 128, temperature 1, top_p 1, top_k -1);
  * POST /update_weights_from_disk {model_path, weight_version, ...} -> 200 {success: true, message,
    num_paused_requests} after really loading the folder's weights (and taking ``weight_version`` as the label
    of later answers, "default" at launch), or 400 {success: false, message} when it cannot be loaded;
  * GET or POST /flush_cache -> 200 with a text body.
It generates with the project's own ``MiniMindForCausalLM`` (one full forward per token, no cache).

``faults`` switches on behaviours real servers are known to show, so the engine's checks can be tested:
"stray_prompt_tokens": k (prepend the last k prompt ids to ``output_ids``, as older SGLang versions did),
"abort": True (finish_reason abort), "unavailable": n (answer the next n requests with HTTP 503).
"""

import json
import os
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoTokenizer

from model.hf_qwen3 import load_qwen3_folder
from model.model_minimind import MiniMindForCausalLM

SGLANG_DEFAULTS = {
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "stop_token_ids": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
}


def filter_top_k_top_p(probs, top_k, top_p):
    """probs fp32 [V] -> renormalised probs keeping the top_k largest (top_k > 0) and the smallest set whose mass
    reaches top_p (the order of SGLang's sampler: top-k, then top-p)."""
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep &= mass_before < top_p
    kept = torch.zeros_like(probs)
    kept[order[keep]] = sorted_probs[keep]
    return kept / kept.sum()


class SGLangStandin:
    """The stand-in server on 127.0.0.1 at a free port (``url``); ``start()`` / ``stop()`` run it in a thread.

    Args:
        model_path: a Qwen3ForCausalLM folder (``model/hf_qwen3.py``), as ``--model-path``.
        return_original_logprob: None reads SGLANG_RETURN_ORIGINAL_LOGPROB from the environment.
        seed: seed of the sampling generator; port: 0 picks a free one.
    ``requests`` records (path, payload) of every POST; ``loaded_paths`` every folder loaded.
    """

    def __init__(self, model_path, return_original_logprob=None, seed=0, port=0):
        if return_original_logprob is None:
            return_original_logprob = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "0").lower() in ("1", "true")
        self.return_original_logprob = return_original_logprob
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()
        self.requests = []
        self.loaded_paths = []
        self.faults = {}
        self.weight_version = "default"  # SGLang's --weight-version default
        config, state_dict = load_qwen3_folder(model_path)
        self.model = MiniMindForCausalLM(config).eval()
        self.model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
        self.loaded_paths.append(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self.handler_class())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = None

    def start(self):
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    # -- endpoints
    @torch.no_grad()
    def generate_one(self, input_ids, params):
        """One request: sample up to max_new_tokens, stopping on stop_token_ids or the model's EOS."""
        stop_ids = set(params["stop_token_ids"] or [])
        if not params["ignore_eos"]:
            stop_ids.add(self.model.config.eos_token_id)
        temperature = params["temperature"]
        sequence = list(input_ids)
        output_ids, triples, finish_reason = [], [], None
        for _ in range(params["max_new_tokens"]):
            logits = self.model(torch.tensor([sequence])).logits[0, -1].float()  # [V]
            if temperature < 1e-5:  # SGLang: temperature 0 is greedy
                token = int(logits.argmax())
                logp = torch.log_softmax(logits, dim=-1)[token]
            else:
                scaled_logps = torch.log_softmax(logits / temperature, dim=-1)  # [V]
                probs = filter_top_k_top_p(scaled_logps.exp(), params["top_k"], params["top_p"])
                token = int(torch.multinomial(probs, 1, generator=self.generator))
                raw_logps = torch.log_softmax(logits, dim=-1)
                logp = (raw_logps if self.return_original_logprob else scaled_logps)[token]
            sequence.append(token)
            output_ids.append(token)
            triples.append([float(logp), token, None])
            if token in stop_ids:
                finish_reason = {"type": "stop", "matched": token}
                break
        if finish_reason is None:
            finish_reason = {"type": "length", "length": params["max_new_tokens"]}
        if self.faults.get("abort"):
            finish_reason = {"type": "abort", "message": "Abort before prefill", "status_code": 500}
        stray = self.faults.get("stray_prompt_tokens", 0)
        reported_ids = list(input_ids[-stray:]) + output_ids if stray else output_ids
        return {
            "text": self.tokenizer.decode(output_ids, skip_special_tokens=params["skip_special_tokens"]),
            "output_ids": reported_ids,
            "meta_info": {
                "id": uuid.uuid4().hex,
                "finish_reason": finish_reason,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(output_ids),
                "cached_tokens": 0,
                "weight_version": self.weight_version,
                "output_token_logprobs": triples,
            },
        }

    def generate(self, payload):
        params = dict(SGLANG_DEFAULTS, **(payload.get("sampling_params") or {}))
        input_ids = payload["input_ids"]
        with self.lock:
            if input_ids and isinstance(input_ids[0], list):
                return [self.generate_one(ids, params) for ids in input_ids]
            return self.generate_one(input_ids, params)

    def update_weights_from_disk(self, payload):
        """(status, body): the folder's weights replace the model's, or 400 with success false."""
        path = payload.get("model_path", "")
        try:
            _, state_dict = load_qwen3_folder(path)
            with self.lock:
                self.model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
                if payload.get("weight_version") is not None:
                    self.weight_version = payload["weight_version"]
        except (OSError, ValueError, RuntimeError) as err:
            return 400, {
                "success": False,
                "message": f"Failed to update weights: {err}.\nRolling back to original weights.",
                "num_paused_requests": 0,
            }
        self.loaded_paths.append(path)
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet test output
                pass

            def reply(self, status, body, content_type="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def unavailable(self):
                if server.faults.get("unavailable", 0) > 0:
                    server.faults["unavailable"] -= 1
                    self.reply(503, "")
                    return True
                return False

            def do_GET(self):
                if self.unavailable():
                    return
                if self.path == "/health":
                    self.reply(200, "", "text/plain")
                elif self.path == "/flush_cache":
                    self.reply(200, "Cache flushed.\n", "text/plain")
                else:
                    self.reply(404, {"detail": "Not Found"})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                server.requests.append((self.path, payload))
                if self.unavailable():
                    return
                if self.path == "/generate":
                    self.reply(200, server.generate(payload))
                elif self.path == "/update_weights_from_disk":
                    self.reply(*server.update_weights_from_disk(payload))
                elif self.path == "/flush_cache":
                    self.reply(200, "Cache flushed.\n", "text/plain")
                else:
                    self.reply(404, {"detail": "Not Found"})

        return Handler
