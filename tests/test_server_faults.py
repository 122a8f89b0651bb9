"""A server that misbehaves (tests/support/misbehaving_server.py, a real HTTP server process on 127.0.0.1): its
replies are checked like any input, and one that never answers stops the run within --sglang_timeout or on SIGTERM
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
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "support", "misbehaving_server.py")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield f"http://127.0.0.1:{int(process.stdout.readline())}"
    finally:
        process.kill()
        process.wait()


def client(url, **options):
    return SGLangClient(url, max_retries=0, vocab_size=6400, **options)


def test_a_well_formed_reply_of_the_stand_in_passes(server_url):
    assert client(server_url + "/good").generate([[1, 2, 3]], SAMPLING) == [([5, 2], [-0.25, -0.5])]


@pytest.mark.parametrize(
    "mode, message",
    [
        (
            "id_outside_vocab",
            r"answer 0: output_ids: ids that are not integers in \[0, 6400\) as \(position, id\): "
            r"\[\(0, 6400\)\]",
        ),
        ("negative_id", r"answer 0: output_ids: ids that are not integers in \[0, 6400\) .*\[\(0, -3\)\]"),
        ("float_id", r"answer 0: output_ids: ids that are not integers .*\[\(0, 5\.9\)\]"),
        ("string_id", r"answer 0: output_ids: ids that are not integers .*\[\(0, '5'\)\]"),
        ("html", r"answered HTTP 200 with a body that is not JSON \(Content-Type 'text/html', starting '<html>"),
        ("meta_info_list", r"answer 0: meta_info is a JSON list, expected an object"),
        (
            "short_logprob_entry",
            r"answer 0: output_token_logprobs entries \[1\] are not \[logprob, token_id, \.\.\.\] "
            r"\(first: \[-0\.5\]\)",
        ),
        ("nan_logprob", r"answer 0: log-probs at completion positions \[1\] are not finite numbers \(first: nan\)"),
        ("empty", r"answer 0: no token; a server generates at least one \(the EOS\) for max_new_tokens 4"),
    ],
)
def test_server_replies_are_checked_like_any_input(server_url, mode, message):
    with pytest.raises(RuntimeError, match=message):
        client(f"{server_url}/{mode}").generate([[1, 2, 3], [4, 5]], SAMPLING)


def test_a_server_that_never_answers_stops_the_run_within_the_timeout_and_on_sigterm(
    server_url, tiny_weights, small_data, tmp_path
):
    flags = [
        "trainer/train_grpo.py",
        "--hidden_size",
        "64",
        "--num_hidden_layers",
        "2",
        "--from_weight",
        "tiny",
        "--max_gen_len",
        "4",
        "--eval_interval",
        "0",
        "--reward_model_path",
        "none",
        "--batch_size",
        "2",
        "--num_generations",
        "2",
        "--max_steps",
        "2",
        "--save_dir",
        tiny_weights[0],
        "--data_path",
        small_data,
        "--rollout_engine",
        "sglang",
        "--sglang_url",
        server_url + "/hang",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    timed_out = subprocess.run(
        [sys.executable] + flags + ["--sglang_timeout", "2", "--run_dir", str(tmp_path / "a")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert timed_out.returncode == 1
    assert (
        f"SGLang server {server_url}/hang/generate took the request but did not answer within --sglang_timeout 2 s"
    ) in timed_out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in timed_out.stderr
    assert "step 1/" not in timed_out.stdout

    process = subprocess.Popen(
        [sys.executable] + flags + ["--run_dir", str(tmp_path / "b")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in process.stdout:  # the loop starts after this line; its first rollout waits on the server
        if line.startswith("GRPO: 2 steps"):
            break
    time.sleep(1)
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, stderr = process.communicate(timeout=120)
    assert time.monotonic() - sent < 10 + 5  # the 10 s grace, not --sglang_timeout's 120 s x retries
    assert process.returncode == 1
    assert f"SIGTERM received while SGLang server {server_url}/hang/generate had not answered (10 s more" in stderr
    assert "rerun the same command with --from_resume 1" in stderr
    assert "Traceback" not in stderr


def test_a_reply_from_other_weights_ends_the_script_in_one_line_naming_it(
    server_url, tiny_weights, small_data, tmp_path
):
    """The stand-in ignores the trainer's weight sync: its answer comes from weights the trainer never pushed."""
    flags = [
        "trainer/train_grpo.py",
        "--hidden_size",
        "64",
        "--num_hidden_layers",
        "2",
        "--from_weight",
        "tiny",
        "--max_gen_len",
        "4",
        "--eval_interval",
        "0",
        "--reward_model_path",
        "none",
        "--batch_size",
        "2",
        "--num_generations",
        "2",
        "--max_steps",
        "2",
        "--save_dir",
        tiny_weights[0],
        "--data_path",
        small_data,
        "--rollout_engine",
        "sglang",
        "--sglang_url",
        server_url + "/float_id",
        "--run_dir",
        str(tmp_path / "run"),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable] + flags, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"train_grpo.py: error: SGLang {server_url}/float_id/generate answer 0 came from weights "
        f"'default', but the trainer synced '"
    ), last
    assert last.endswith(
        "Give each run its own server, then resume the run (the resumed run pushes its weights at start-up)."
    )
