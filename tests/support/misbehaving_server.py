"""An HTTP server on 127.0.0.1 that answers ``/generate`` the way a broken or foreign server would (a test fixture).

    python tests/support/misbehaving_server.py   # prints its port on the first line, serves until killed

The first part of the request path picks the reply, e.g. ``POST /id_outside_vocab/generate``; every batch element
gets the same reply, built from one well-formed SGLang answer (output_ids [5, 2], log-probs -0.25 and -0.5,
stopped on EOS 2). ``/hang/generate`` takes the request and never answers; ``/html/generate`` answers an HTML page
with 200. ``/health`` and ``/update_weights_from_disk`` answer as a healthy server does, in every mode.
"""

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def good_answer():
    return {
        "text": "",
        "output_ids": [5, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "output_token_logprobs": [[-0.25, 5, None], [-0.5, 2, None]],
            "weight_version": "default",
        },
    }


def broken_answer(mode):
    """The well-formed answer with one field broken as ``mode`` names it (the body is JSON text, so NaN is
    written as Python's json writes it)."""
    answer = good_answer()
    meta = answer["meta_info"]
    if mode == "id_outside_vocab":
        answer["output_ids"][0] = meta["output_token_logprobs"][0][1] = 6400
    elif mode == "negative_id":
        answer["output_ids"][0] = meta["output_token_logprobs"][0][1] = -3
    elif mode == "float_id":
        answer["output_ids"][0] = meta["output_token_logprobs"][0][1] = 5.9
    elif mode == "string_id":
        answer["output_ids"][0] = meta["output_token_logprobs"][0][1] = "5"
    elif mode == "meta_info_list":
        answer["meta_info"] = [meta]
    elif mode == "short_logprob_entry":
        meta["output_token_logprobs"][1] = [-0.5]
    elif mode == "nan_logprob":
        meta["output_token_logprobs"][1][0] = float("nan")
    elif mode == "empty":
        answer["output_ids"], meta["output_token_logprobs"], meta["completion_tokens"] = [], [], 0
        meta["finish_reason"] = {"type": "length", "length": 0}
    return answer


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):  # /health: a server that is up
        self.reply(b"", "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        mode = self.path.strip("/").split("/")[0]
        if self.path.endswith("/update_weights_from_disk"):  # every mode takes weights; only /generate misbehaves
            self.reply(json.dumps({"success": True, "message": "loaded"}).encode(), "application/json")
            return
        if mode == "hang":
            time.sleep(3600)
            return
        if mode == "html":
            self.reply(b"<html><body>Bad gateway page of a proxy</body></html>", "text/html")
            return
        count = len(body.get("input_ids", [[0]]))
        self.reply(json.dumps([broken_answer(mode) for _ in range(count)]).encode(), "application/json")

    def reply(self, data, content_type):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()
