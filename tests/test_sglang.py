"""--rollout_engine sglang against a stand-in SGLang server (tests/support/sglang_standin.py), no GPU needed."""

import json
import os
import socket
import sys

import pytest
import requests
import torch

from model.hf_qwen3 import load_qwen3_folder, save_qwen3_folder
from model.model_minimind import MiniMindForCausalLM
from sglang_standin import SGLangStandin
from trainer.rollout_engine import SGLangRolloutEngine, create_rollout_engine
from trainer.infra.sglang_client import parse_sglang_output
from trainer.train_grpo import main as grpo_main
from trainer.rollout_engine import tokenize_prompts
from trainer.train_ppo import main as ppo_main
from trainer.infra.weights import build_config

PROMPTS = [
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "<|im_start|>user\n5 加 7 是多少？<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
]
FAST = dict(backoff_s=0.01, health_retries=2, max_retries=2)


def make_policy(seed, std=0.3):
    """Tiny MiniMind (hidden 64, 2 layers) with large weights, so different seeds give visibly different log-probs."""
    torch.manual_seed(seed)
    config = build_config(64, 2, 0)
    config.initializer_range = std
    return MiniMindForCausalLM(config).eval()


@pytest.fixture
def start_standin(tmp_path, tokenizer):
    """start_standin(model, **options) -> a running SGLangStandin launched on ``model``'s exported folder;
    every server started is stopped at teardown."""
    servers = []

    def start(model, **options):
        folder = save_qwen3_folder(
            model.state_dict(), model.config, str(tmp_path / f"launch{len(servers)}"), tokenizer=tokenizer
        )
        server = SGLangStandin(folder, **options).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def plain_logps(model, prompt, completion, temperature):
    """log softmax(logits / T) of each completion token, one unpadded row, plain forward (no project code)."""
    sequence = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_batched_request_group_order_and_result(start_standin, tokenizer, tmp_path):
    policy = make_policy(0)
    server = start_standin(policy)
    engine = create_rollout_engine(
        "sglang", policy, tokenizer, url=server.url, shared_path=str(tmp_path / "shared"), top_k=50, **FAST
    )
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS, 256, "cpu")
    result = engine.rollout(prompt_ids, attention_mask, num_generations=3, max_new_tokens=10, temperature=0.7)

    path, payload = server.requests[-1]
    assert path == "/generate" and payload["return_logprob"] is True
    own_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert payload["input_ids"] == [own_ids[0]] * 3 + [own_ids[1]] * 3  # unpadded, P0,P0,P0,P1,P1,P1
    assert payload["sampling_params"] == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 50,
        "min_p": 0.0,
        "max_new_tokens": 10,
        "min_new_tokens": 0,
        "stop_token_ids": [tokenizer.eos_token_id],
        "ignore_eos": False,
        "skip_special_tokens": False,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
    }

    n, r = result.completion_ids.shape
    assert n == 6 and result.output_ids.shape == (6, prompt_ids.size(1) + r)
    assert result.prompt_mask.sum(dim=1).tolist() == [len(own_ids[0])] * 3 + [len(own_ids[1])] * 3
    for i in range(n):
        assert torch.equal(result.output_ids[i, : prompt_ids.size(1)], prompt_ids[i // 3])
        completion = result.completion_ids[i][result.completion_mask[i].bool()].tolist()
        first_eos = completion.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in completion else None
        assert first_eos in (None, len(completion) - 1)  # the mask runs through the first EOS
        expected = plain_logps(policy, own_ids[i // 3], completion, 0.7)
        assert (result.per_token_logps[i, : len(completion)] - expected).abs().max() <= 1e-4
        text_ids = [t for t in completion if t != tokenizer.eos_token_id]
        assert result.completions[i] == tokenizer.decode(text_ids)
    assert result.metrics["logprob_gap"] < 1e-3  # the server holds the trainer's weights (pushed at start-up)


def test_server_logps_match_after_each_sync_and_differ_before(start_standin, tokenizer, tmp_path):
    server = start_standin(make_policy(0))
    trainer_policy = make_policy(1)
    prompt = tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]

    def server_vs_trainer_gap():
        answer = requests.post(
            server.url + "/generate",
            json={
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {"temperature": 0.8, "max_new_tokens": 12, "stop_token_ids": [2]},
            },
        ).json()
        completion = answer["output_ids"]
        server_logps = torch.tensor([triple[0] for triple in answer["meta_info"]["output_token_logprobs"]])
        return (server_logps - plain_logps(trainer_policy, prompt, completion, 0.8)).abs().max().item()

    assert server_vs_trainer_gap() > 0.1  # the server was launched on another policy
    engine = SGLangRolloutEngine(trainer_policy, tokenizer, server.url, str(tmp_path / "shared"), **FAST)
    assert server_vs_trainer_gap() < 1e-3  # the start-up push
    assert engine.client.server_weight_version == f"{engine.client.version_label}-v0"
    trainer_policy.load_state_dict(make_policy(2).state_dict())  # the trainer's weights move on
    assert server_vs_trainer_gap() > 0.1
    engine.update_policy(trainer_policy)
    assert server_vs_trainer_gap() < 1e-3
    assert server.loaded_paths[-1] == os.path.join(str(tmp_path / "shared"), "policy_v1")
    assert server.requests[-2][1] == {
        "model_path": server.loaded_paths[-1],
        "flush_cache": True,
        "weight_version": engine.client.server_weight_version,
    }
    assert engine.client.server_weight_version == f"{engine.client.version_label}-v1"


def test_sync_interval_pushes_every_nth_update(start_standin, tokenizer, tmp_path):
    policy = make_policy(0)
    server = start_standin(policy)
    engine = SGLangRolloutEngine(policy, tokenizer, server.url, str(tmp_path / "shared"), sync_interval=3, **FAST)
    assert len(server.loaded_paths) == 2  # launch folder + the push at start-up
    for _ in range(5):
        engine.update_policy(policy)
    assert len(server.loaded_paths) == 3  # only the 3rd of 5 calls pushed
    assert os.listdir(tmp_path / "shared") == ["policy_v1"]  # older synced folders are removed


def test_sync_cadence_survives_a_resume(start_standin, tokenizer, tmp_path):
    # sync_interval 3: the uninterrupted engine pushes on calls 3 and 6. Saved after call 2, a new engine (the
    # resumed run's, which pushes the restored policy at start-up) must push on the next call, not 3 calls later.
    policy = make_policy(0)
    server = start_standin(policy)
    engine = SGLangRolloutEngine(policy, tokenizer, server.url, str(tmp_path / "shared"), sync_interval=3, **FAST)
    for _ in range(2):
        engine.update_policy(policy)
    state = engine.resume_state()
    assert state == {"num_update_calls": 2, "weight_version": 1}
    resumed = SGLangRolloutEngine(policy, tokenizer, server.url, str(tmp_path / "shared2"), sync_interval=3, **FAST)
    resumed.load_resume_state(state)
    pushes_before = len(server.loaded_paths)
    resumed.update_policy(policy)
    assert len(server.loaded_paths) == pushes_before + 1  # the 3rd call pushes, as in the uninterrupted run
    assert os.path.basename(server.loaded_paths[-1]) == "policy_v1"
    assert resumed.resume_state() == {"num_update_calls": 3, "weight_version": 2}


@pytest.mark.parametrize("temperature, refused", [(0.5, True), (1.0, False)])
@pytest.mark.parametrize("rollout_correction", [False, True])
def test_server_mode_refuses_other_logprob_convention_at_first_batch(
    start_standin, tokenizer, tmp_path, temperature, refused, rollout_correction
):
    """A server started with SGLANG_RETURN_ORIGINAL_LOGPROB=1 returns log softmax(logits), not the trainer's
    log softmax(logits / T): server mode stops at the first batch unless T = 1, where both are the same; with
    ``--rollout_correction`` too, and then the gap is measured on every batch."""
    policy = make_policy(0)
    server = start_standin(policy, return_original_logprob=True)
    engine = SGLangRolloutEngine(
        policy,
        tokenizer,
        server.url,
        str(tmp_path / "shared"),
        logprobs_mode="server",
        rollout_correction=rollout_correction,
        **FAST,
    )
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS, 256, "cpu")
    if refused:
        with pytest.raises(RuntimeError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
            engine.rollout(prompt_ids, attention_mask, 2, 8, temperature=temperature)
    else:
        result = engine.rollout(prompt_ids, attention_mask, 2, 8, temperature=temperature)
        assert result.metrics["logprob_gap"] < 1e-3
        second = engine.rollout(prompt_ids, attention_mask, 2, 8, temperature).metrics
        assert list(second) == (["logprob_gap"] if rollout_correction else [])  # checked once; measured each time


def test_server_mode_uses_the_servers_logps(start_standin, tokenizer, tmp_path):
    policy = make_policy(0)
    server = start_standin(policy)
    engine = SGLangRolloutEngine(
        policy, tokenizer, server.url, str(tmp_path / "shared"), logprobs_mode="server", **FAST
    )
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS[:1], 256, "cpu")
    result = engine.rollout(prompt_ids, attention_mask, 2, 8, temperature=0.6)
    answers = server.requests[-1]
    assert answers[0] == "/generate"
    for i in range(2):
        completion = result.completion_ids[i][result.completion_mask[i].bool()].tolist()
        prompt = prompt_ids[0][attention_mask[0].bool()].tolist()
        expected = plain_logps(policy, prompt, completion, 0.6)
        assert (result.per_token_logps[i, : len(completion)] - expected).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "fault, message",
    [
        ({"stray_prompt_tokens": 2}, "stray prompt tokens"),
        ({"abort": True}, "aborted"),
    ],
)
def test_inconsistent_or_aborted_answers_are_refused(start_standin, tokenizer, tmp_path, fault, message):
    policy = make_policy(0)
    server = start_standin(policy)
    engine = SGLangRolloutEngine(policy, tokenizer, server.url, str(tmp_path / "shared"), **FAST)
    server.faults.update(fault)
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS, 256, "cpu")
    with pytest.raises(RuntimeError, match=message):
        engine.rollout(prompt_ids, attention_mask, 2, 6)


@pytest.mark.parametrize(
    "row, value, message",
    [
        (1, None, r"prompt rows \[1\] have no token"),
        (0, 6400, r"outside the vocabulary \[0, 6400\) as \(row, id\): \[\(0, 6400\)\]"),
        (1, -1, r"outside the vocabulary \[0, 6400\) as \(row, id\): \[\(1, -1\)\]"),
    ],
)
def test_prompts_that_crash_a_server_are_never_sent(start_standin, tokenizer, tmp_path, row, value, message):
    """An empty prompt or an id outside the vocabulary stops a real SGLang server: refused before the request."""
    policy = make_policy(0)
    server = start_standin(policy)
    engine = SGLangRolloutEngine(policy, tokenizer, server.url, str(tmp_path / "shared"), **FAST)
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS, 256, "cpu")
    if value is None:
        attention_mask[row] = 0
    else:
        prompt_ids[row, -1] = value  # the last position is a prompt token (left padding)
    requests_before = len(server.requests)
    with pytest.raises(ValueError, match=message):
        engine.rollout(prompt_ids, attention_mask, 2, 4)
    assert len(server.requests) == requests_before


def test_answers_from_other_weights_stop_the_rollout(start_standin, tokenizer, tmp_path):
    """Another client reloads the server (as a restart would, the label back to "default"): the next rollout
    is refused because its answers no longer carry the label of the trainer's last sync."""
    policy = make_policy(0)
    server = start_standin(policy)
    engine = SGLangRolloutEngine(policy, tokenizer, server.url, str(tmp_path / "shared"), **FAST)
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS[:1], 256, "cpu")
    assert engine.rollout(prompt_ids, attention_mask, 2, 4).completion_ids.size(0) == 2
    other = save_qwen3_folder(make_policy(7).state_dict(), policy.config, str(tmp_path / "other"), tokenizer=tokenizer)
    answer = requests.post(
        server.url + "/update_weights_from_disk", json={"model_path": other, "weight_version": "default"}
    )
    assert answer.json()["success"] is True
    with pytest.raises(RuntimeError, match=r"came from weights 'default', but the trainer synced '[0-9a-f]{8}-v0'"):
        engine.rollout(prompt_ids, attention_mask, 2, 4)
    engine.update_policy(policy)  # a new sync labels the server's answers again
    assert engine.rollout(prompt_ids, attention_mask, 2, 4).metrics["logprob_gap"] < 1e-3


def test_server_down_gives_the_startup_error(tokenizer, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError) as error:
        SGLangRolloutEngine(make_policy(0), tokenizer, url, str(tmp_path / "shared"), **FAST)
    message = str(error.value)
    launch_folder = os.path.join(str(tmp_path / "shared"), "policy_v0")
    assert f"no SGLang server answers at {url}/health" in message
    assert f"python -m sglang.launch_server --model-path {launch_folder} --port {url.rsplit(':', 1)[1]}" in message
    assert os.path.isfile(os.path.join(launch_folder, "config.json"))  # the folder the command names exists


def test_failed_weight_update_raises_with_the_servers_message(start_standin, tokenizer, tmp_path):
    policy = make_policy(0)
    server = start_standin(policy)
    answer = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert answer.status_code == 400 and answer.json()["success"] is False
    engine = SGLangRolloutEngine(policy, tokenizer, server.url, str(tmp_path / "shared"), **FAST)
    with pytest.raises(RuntimeError, match=r"update_weights_from_disk failed .*HTTP 400.*no config.json"):
        engine.push_weights(policy, folder=str(tmp_path / "nope"))


def test_network_errors_are_retried_then_fail(start_standin, tokenizer, tmp_path):
    policy = make_policy(0)
    server = start_standin(policy)
    engine = SGLangRolloutEngine(
        policy, tokenizer, server.url, str(tmp_path / "shared"), resume_hint="RESUME-HINT", **FAST
    )
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS[:1], 256, "cpu")
    server.faults["unavailable"] = 2  # two 503 answers, then the request goes through
    assert engine.rollout(prompt_ids, attention_mask, 2, 4).completion_ids.size(0) == 2
    server.faults["unavailable"] = 3  # more than max_retries = 2
    with pytest.raises(RuntimeError, match=r"failed 3 times \(HTTP 503.*RESUME-HINT"):
        engine.rollout(prompt_ids, attention_mask, 2, 4)


ARCH = ["--hidden_size", "64", "--num_hidden_layers", "2"]
TINY = ARCH + ["--eval_interval", "0"]  # the training scripts' held-out evaluation is tested in test_evaluation.py


@pytest.mark.parametrize(
    "script, lora", [("grpo", []), ("ppo", []), ("grpo", ["--lora_rank", "4"])]
)  # LoRA: the merged weights are synced
def test_two_steps_with_rollout_engine_sglang(script, lora, start_standin, tokenizer, tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    server = start_standin(make_policy(5))  # launched on other weights: the engine pushes the policy at start-up
    run_dir = tmp_path / "run"
    shared = tmp_path / "shared"
    argv = (
        [
            "--max_steps",
            "2",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--batch_size",
            "2",
            "--max_gen_len",
            "8",
            "--run_dir",
            str(run_dir),
            "--rollout_engine",
            "sglang",
            "--sglang_url",
            server.url,
            "--sglang_shared_path",
            str(shared),
            "--temperature",
            "0.8",
        ]
        + TINY
        + lora
    )
    if script == "grpo":
        grpo_main(argv + ["--num_generations", "3"])
        expected_rows = 6
    else:
        ppo_main(argv + ["--mini_batch_size", "1"])
        expected_rows = 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["logprob_gap"] < 1e-3 for r in rows)  # synced before each rollout
    generate_calls = [payload for path, payload in server.requests if path == "/generate"]
    assert len(generate_calls) == 2 and all(len(p["input_ids"]) == expected_rows for p in generate_calls)
    assert len(server.loaded_paths) == 1 + 1 + 2  # launch, start-up push, one push per step
    assert os.listdir(shared) == ["policy_v2"]
    assert os.path.isfile(os.path.join(save_dir, f"{script}_64.pth"))


def test_two_fsdp_ranks_with_rollout_engine_sglang(start_standin, tiny_weights, tmp_path):
    """torchrun, 2 ranks, --fsdp 1: the sharded policy reaches the server whole at start-up and after each step (the
    server's log-probs then match the trainer's to 1e-3), and both ranks sample from it."""
    from test_distributed import torchrun

    save_dir, name = tiny_weights
    server = start_standin(make_policy(5))  # launched on other weights: the engine pushes the policy at start-up
    run_dir, shared = tmp_path / "run", tmp_path / "shared"
    result = torchrun(
        ["trainer/train_grpo.py", "--max_steps", "2", "--save_dir", save_dir, "--from_weight", name]
        + ["--batch_size", "2", "--num_generations", "3", "--max_gen_len", "8", "--run_dir", str(run_dir)]
        + ["--rollout_engine", "sglang", "--sglang_url", server.url, "--sglang_shared_path", str(shared)]
        + ["--temperature", "0.8", "--fsdp", "1"]
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["logprob_gap"] < 1e-3 for r in rows)  # the whole, current policy was synced before each rollout
    generate_calls = [payload for path, payload in server.requests if path == "/generate"]
    assert len(generate_calls) == 4 and all(len(p["input_ids"]) == 6 for p in generate_calls)  # 2 ranks x 2 steps
    assert len(server.loaded_paths) == 1 + 1 + 2  # launch, start-up push, one push per step
    assert os.listdir(shared) == ["policy_v2"]


def test_check_sglang_script_against_the_standin(start_standin, tiny_weights, tmp_path):
    """scripts/check_sglang.py (meant for a GPU + SGLang machine) runs its comparison and GRPO steps end to end."""
    from scripts.check_sglang import main as check_main

    save_dir, name = tiny_weights
    server = start_standin(make_policy(3))
    summary = check_main(
        [
            "--sglang_url",
            server.url,
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--work_dir",
            str(tmp_path / "check"),
            "--num_prompts",
            "2",
            "--num_generations",
            "2",
            "--max_gen_len",
            "6",
            "--grpo_steps",
            "2",
        ]
        + ARCH
    )
    assert summary["sglang_tokens_per_s"] > 0 and summary["torch_tokens_per_s"] > 0
    assert summary["sglang_logprob_gap"] < 1e-3 and len(summary["grpo_logprob_gap"]) == 2
    assert max(summary["grpo_logprob_gap"]) < 1e-3


FAKE_LAUNCH_SERVER = """
import argparse
from sglang_standin import SGLangStandin
parser = argparse.ArgumentParser()
parser.add_argument("--model-path")
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()
SGLangStandin(args.model_path, port=args.port).httpd.serve_forever()
"""


@pytest.mark.parametrize("server_device", ["cuda", "cpu"])
def test_check_sglang_launches_and_stops_the_server(server_device, tiny_weights, tmp_path, monkeypatch):
    """Without --sglang_url the script launches `--sglang_python -m sglang.launch_server` (cuda) or
    scripts/launch_sglang.sh with that python (cpu), here with a fake package that serves the stand-in, on the
    exported folder, and stops it at the end."""
    from conftest import ROOT
    from scripts.check_sglang import main as check_main

    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    tests_dir = os.path.join(ROOT, "tests", "support")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), tests_dir, ROOT]))
    save_dir, name = tiny_weights
    port = free_port()
    summary = check_main(
        [
            "--port",
            str(port),
            "--server_args",
            "",
            "--launch_timeout",
            "300",
            "--save_dir",
            save_dir,
            "--server_device",
            server_device,
            "--sglang_python",
            sys.executable,
            "--from_weight",
            name,
            "--work_dir",
            str(tmp_path / "check"),
            "--num_prompts",
            "1",
            "--num_generations",
            "2",
            "--max_gen_len",
            "4",
            "--grpo_steps",
            "1",
        ]
        + ARCH
    )
    assert summary["sglang_logprob_gap"] < 1e-3
    assert os.path.isfile(tmp_path / "check" / "launch" / "config.json")
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/health", timeout=5)


def push_on_two_ranks(rank, init_file, url, shared_path, bad_folder, out_dir):
    """torch.multiprocessing worker: a 2-rank gloo group syncs once, then tries a folder the server rejects."""
    import torch.distributed as dist
    from transformers import AutoTokenizer
    from conftest import ROOT

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    policy = make_policy(1)
    engine = SGLangRolloutEngine(policy, tokenizer, url, shared_path, **FAST)  # rank 0 pushes policy_v0
    engine.update_policy(policy)  # and policy_v1
    try:
        engine.push_weights(policy, folder=bad_folder)
        outcome = "no error"
    except RuntimeError as err:
        outcome = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)
    dist.destroy_process_group()


def test_two_ranks_rank0_syncs_and_every_rank_learns_a_failure(start_standin, tmp_path):
    server = start_standin(make_policy(0))
    shared, bad = str(tmp_path / "shared"), str(tmp_path / "missing")
    torch.multiprocessing.spawn(
        push_on_two_ranks, args=(str(tmp_path / "init"), server.url, shared, bad, str(tmp_path)), nprocs=2
    )
    updates = [payload["model_path"] for path, payload in server.requests if path == "/update_weights_from_disk"]
    # rank 0 alone talks to /update_weights_from_disk
    assert updates == [os.path.join(shared, "policy_v0"), os.path.join(shared, "policy_v1"), bad]
    rank0 = (tmp_path / "rank0.txt").read_text()
    rank1 = (tmp_path / "rank1.txt").read_text()
    assert "update_weights_from_disk failed" in rank0 and "no config.json" in rank0
    assert rank1.startswith("syncing the policy to SGLang failed on rank 0") and "no config.json" in rank1


def push_sharded_on_two_ranks(rank, init_file, url, shared_path):
    """torch.multiprocessing worker: a 2-rank gloo group shards ``make_policy(1)`` (``--fsdp 1``'s layout) and the
    engine syncs it to the server twice: at start (policy_v0) and after one update call (policy_v1)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer
    from conftest import ROOT
    from trainer.infra.fsdp import shard_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    policy = shard_model(make_policy(1), "cpu")  # every rank now holds half of each weight
    engine = SGLangRolloutEngine(policy, tokenizer, url, shared_path, **FAST)
    engine.update_policy(policy)
    dist.destroy_process_group()


def test_a_sharded_policy_reaches_the_server_whole(start_standin, tokenizer, tmp_path):
    server = start_standin(make_policy(0))
    shared = str(tmp_path / "shared")
    torch.multiprocessing.spawn(push_sharded_on_two_ranks, args=(str(tmp_path / "init"), server.url, shared), nprocs=2)
    updates = [payload["model_path"] for path, payload in server.requests if path == "/update_weights_from_disk"]
    assert updates == [os.path.join(shared, "policy_v0"), os.path.join(shared, "policy_v1")]
    plain = make_policy(1)  # what a process that holds the whole policy exports
    expected = save_qwen3_folder(plain.state_dict(), plain.config, str(tmp_path / "plain"), tokenizer=tokenizer)
    _, expected_state = load_qwen3_folder(expected)
    _, synced = load_qwen3_folder(os.path.join(shared, "policy_v1"))
    assert synced.keys() == expected_state.keys()
    assert all(torch.equal(synced[k], expected_state[k]) for k in synced)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sglang_sync_interval", "0"], "--sglang_sync_interval must be >= 1"),
        (["--sglang_url", "127.0.0.1:30000"], "--sglang_url must start with http://"),
        (["--rollout_engine", "sglang", "--use_moe", "1"], "needs a dense model"),
        (["--sglang_logprobs", "both"], "invalid choice: 'both'"),
    ],
)
def test_bad_sglang_flags_fail_at_start(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        grpo_main(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def answer(output_ids, triples, finish_reason, completion_tokens=None):
    """An SGLang /generate answer element as documented (io_struct.py / tokenizer_manager.py)."""
    meta_info = {
        "finish_reason": finish_reason,
        "output_token_logprobs": triples,
        "prompt_tokens": 5,
        "completion_tokens": len(output_ids) if completion_tokens is None else completion_tokens,
    }
    return {"text": "", "output_ids": output_ids, "meta_info": meta_info}


def test_parse_a_well_formed_answer():
    good = answer([7, 9, 2], [[-0.5, 7, None], [-1.25, 9, None], [-0.125, 2, None]], {"type": "stop", "matched": 2})
    assert parse_sglang_output(good, 0, max_new_tokens=4, eos_token_id=2) == ([7, 9, 2], [-0.5, -1.25, -0.125])
    cut = answer([7, 9], [[-0.5, 7, None], [-1.0, 9, None]], {"type": "length", "length": 2})
    assert parse_sglang_output(cut, 0, max_new_tokens=2, eos_token_id=2) == ([7, 9], [-0.5, -1.0])


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            answer([7, 9], [[-0.5, 7, None], [None, 9, None]], {"type": "length", "length": 2}),
            r"log-probs missing at completion positions \[1\]",
        ),
        (answer([7, 9], [[-0.5, 7, None], [-1.0, 9, None]], {"type": "length", "length": 2}, 3), "completion_tokens 3"),
        (answer([7, 9], [[-0.5, 7, None]], {"type": "length", "length": 2}), "differ from the token ids"),
        (answer([7, 9], [[-0.5, 7, None], [-1.0, 9, None]], {"type": "stop", "matched": 2}), "do not end with it"),
        (answer([], [], {"type": "abort", "message": "Abort before prefill"}), "aborted.*Abort before prefill"),
        (answer([7, 9, 8], [[-0.5, 7, None], [-1.0, 9, None], [-1.0, 8, None]], {"type": "length"}), "3 tokens for"),
        ({"text": "hi", "meta_info": {}}, "expected a dict with output_ids and meta_info"),
    ],
)
def test_parse_refuses_bad_answers(bad, message):
    with pytest.raises(RuntimeError, match=message):
        parse_sglang_output(bad, 3, max_new_tokens=2, eos_token_id=2)


def test_parse_checks_the_weight_version_label():
    good = answer([7], [[-0.5, 7, None]], {"type": "length", "length": 1})
    good["meta_info"]["weight_version"] = "ab12-v3"
    assert parse_sglang_output(good, 0, 1, 2, weight_version="ab12-v3") == ([7], [-0.5])
    assert parse_sglang_output(good, 0, 1, 2, weight_version=None) == ([7], [-0.5])  # nothing synced yet
    with pytest.raises(RuntimeError, match="answer 0 came from weights 'ab12-v3', but the trainer synced 'ab12-v4'"):
        parse_sglang_output(good, 0, 1, 2, weight_version="ab12-v4")
    del good["meta_info"]["weight_version"]
    with pytest.raises(RuntimeError, match="no meta_info.weight_version"):
        parse_sglang_output(good, 0, 1, 2, weight_version="ab12-v3")


# ----------------------------------------------------------------------------- --rollout_correction
def test_the_engine_keeps_the_trainers_old_log_probs_and_the_servers_beside_them(start_standin, tokenizer, tmp_path):
    """``--sglang_logprobs server --rollout_correction ...``: old = the trainer's forward on every batch (TRL's),
    the server's in ``sampling_per_token_logps``; the server here holds other weights, so the two differ."""
    trainer_policy = make_policy(0)
    server = start_standin(make_policy(1))
    engine = SGLangRolloutEngine(
        trainer_policy,
        tokenizer,
        server.url,
        str(tmp_path / "shared"),
        logprobs_mode="server",
        rollout_correction=True,
        logprob_tolerance=10.0,
        **FAST,
    )
    trainer_policy.load_state_dict(make_policy(2).state_dict())  # the trainer moves on; the server keeps the push
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, PROMPTS[:1], 256, "cpu")
    prompt = prompt_ids[0][attention_mask[0].bool()].tolist()
    for _ in range(2):  # the first batch (checked against the tolerance) and the next
        result = engine.rollout(prompt_ids, attention_mask, 2, 8, temperature=0.7)
        for i in range(2):
            completion = result.completion_ids[i][result.completion_mask[i].bool()].tolist()
            n = len(completion)
            trainer = plain_logps(trainer_policy, prompt, completion, 0.7)
            torch.testing.assert_close(result.per_token_logps[i, :n], trainer, rtol=0, atol=1e-5)
            served = plain_logps(make_policy(0), prompt, completion, 0.7)  # the weights the server holds
            torch.testing.assert_close(result.sampling_per_token_logps[i, :n], served, rtol=0, atol=1e-4)
            assert (served - trainer).abs().max() > 1e-2
            assert (result.sampling_per_token_logps[i, n:] == 0).all()


def corrected_run(script, server, tiny_weights, tmp_path, correction, grpo_flags=(), ppo_flags=()):
    """Two steps of ``script`` against ``server`` with ``--sglang_logprobs server`` and the ``correction`` flags;
    returns the rows of metrics.jsonl."""
    save_dir, name = tiny_weights
    run_dir = tmp_path / "run"
    argv = (
        [
            "--max_steps",
            "2",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--batch_size",
            "2",
            "--max_gen_len",
            "8",
            "--run_dir",
            str(run_dir),
            "--rollout_engine",
            "sglang",
            "--sglang_url",
            server.url,
            "--sglang_shared_path",
            str(tmp_path / "shared"),
            "--temperature",
            "0.8",
            "--sglang_logprobs",
            "server",
            "--eval_interval",
            "0",
        ]
        + correction
        + TINY
    )
    if script == "grpo":
        grpo_main(argv + ["--num_generations", "3", *grpo_flags])
    else:
        ppo_main(argv + ["--mini_batch_size", "1", *ppo_flags])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    return rows


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_two_corrected_steps_log_the_mismatch(script, start_standin, tiny_weights, tmp_path):
    rows = corrected_run(
        script, start_standin(make_policy(5)), tiny_weights, tmp_path, ["--rollout_correction", "token_truncate"]
    )
    for row in rows:  # the stand-in scores with the trainer's own code on the synced weights: weights near 1
        assert row["sampling/sampling_logp_difference/mean"] == pytest.approx(row["logprob_gap"], abs=1e-7)
        assert row["sampling/importance_sampling_ratio/max"] <= 3.0
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3
        assert row["sampling/corrected_share"] == 0.0 and row["sampling/kl_server_trainer"] < 1e-6


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_weights_masked_at_a_tiny_cap_leave_no_policy_loss(script, start_standin, tiny_weights, tmp_path):
    """The weights reach the loss: with every weight above the cap, token_mask zeroes each token's policy term, so
    without a KL term the policy loss is 0 at every step (GRPO: the objective times 0; PPO: advantages times 0)."""
    rows = corrected_run(
        script,
        start_standin(make_policy(5)),
        tiny_weights,
        tmp_path,
        ["--rollout_correction", "token_mask", "--rollout_correction_cap", "1e-30"],
        grpo_flags=["--beta", "0"],
        ppo_flags=["--kl_coef", "0"],
    )
    assert all(row["sampling/corrected_share"] == 1.0 and row["policy_loss"] == 0.0 for row in rows)
