"""A server that misbehaves (tests/misbehaving_server.py, a real HTTP server process on 127.0.0.1): its replies are
checked like any input, and one that never answers stops the run within --sglang_timeout or on SIGTERM
(docs/troubleshooting.md, "the SGLang server")."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from trainer.infra.sglang_client import SGLangClient, sglang_sampling_params

SAMPLING = sglang_sampling_params(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, eos_token_id=2)


@pytest.fixture(scope="module")
def server_url():
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "misbehaving_server.py")],
                               stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(process.stdout.readline())}"
    finally:
        process.kill()
        process.wait()


def client(url, **options):
    return SGLangClient(url, max_retries=0, vocab_size=6400, **options)


def test_a_well_formed_reply_of_the_stand_in_passes(server_url):
    assert client(server_url + "/good").generate([[1, 2, 3]], SAMPLING) == [([5, 2], [-0.25, -0.5])]


@pytest.mark.parametrize("mode, message", [
    ("id_outside_vocab", r"answer 0: output_ids: ids that are not integers in \[0, 6400\) as \(position, id\): "
                         r"\[\(0, 6400\)\]"),
    ("negative_id", r"answer 0: output_ids: ids that are not integers in \[0, 6400\) .*\[\(0, -3\)\]"),
    ("float_id", r"answer 0: output_ids: ids that are not integers .*\[\(0, 5\.9\)\]"),
    ("string_id", r"answer 0: output_ids: ids that are not integers .*\[\(0, '5'\)\]"),
    ("html", r"answered HTTP 200 with a body that is not JSON \(Content-Type 'text/html', starting '<html>"),
    ("meta_info_list", r"answer 0: meta_info is a JSON list, expected an object"),
    ("short_logprob_entry", r"answer 0: output_token_logprobs entries \[1\] are not \[logprob, token_id, \.\.\.\] "
                            r"\(first: \[-0\.5\]\)"),
    ("nan_logprob", r"answer 0: log-probs at completion positions \[1\] are not finite numbers \(first: nan\)"),
    ("empty", r"answer 0: no token; a server generates at least one \(the EOS\) for max_new_tokens 4"),
])
def test_server_replies_are_checked_like_any_input(server_url, mode, message):
    with pytest.raises(RuntimeError, match=message):
        client(f"{server_url}/{mode}").generate([[1, 2, 3], [4, 5]], SAMPLING)


def test_a_server_that_never_answers_stops_within_the_timeout_and_on_sigterm(server_url):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"/hang/generate took the request but did not answer within "
                                           r"--sglang_timeout 1 s"):
        client(server_url + "/hang", timeout_s=1.0).generate([[1, 2, 3]], SAMPLING)
    assert time.monotonic() - start < 5  # not retried

    waiting = ("from trainer.infra.sglang_client import SGLangClient\n"
               "from trainer.infra.stopping import StopSignal\n"
               "StopSignal()\n"
               "print('waiting', flush=True)\n"
               f"SGLangClient({server_url + '/hang'!r}, max_retries=0, timeout_s=600, stop_grace_s=1, "
               f"resume_hint='RESUME-HINT').generate([[1, 2, 3]], {SAMPLING!r})\n")
    process = subprocess.Popen([sys.executable, "-c", waiting], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "waiting\n"
    time.sleep(0.5)  # inside the request
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, stderr = process.communicate(timeout=30)
    assert time.monotonic() - sent < 5  # 1 s of grace, not --sglang_timeout's 600 s
    assert process.returncode == 1
    assert (f"SIGTERM received while SGLang server {server_url}/hang/generate had not answered (1 s more were "
            f"given): the run stops without this step. RESUME-HINT") in stderr
