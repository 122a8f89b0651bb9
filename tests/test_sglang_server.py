"""--rollout_engine sglang against a real SGLang server on the CPU (docs/sglang.md, "On a CPU").

The server comes from the environment: SGLANG_URL (a running server launched on a model of the bundled
policy's architecture, hidden 256 x 4 layers, as .ci/run does) or SGLANG_PYTHON (the server venv's python,
from scripts/setup_sglang_env.sh: the module launches its own server with scripts/launch_sglang.sh). Without
either, every test here is skipped with that reason. The server-killing test always launches a server of its
own (it needs SGLANG_PYTHON). What a real server cannot be made to do (stray prompt tokens, aborts, HTTP 503)
is tested against the stand-in in tests/test_sglang.py.

Every expected value is computed here, by the project's torch code (``compute_per_token_logps``) on the same
weights, or by a second request to the same server.
"""

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
import torch

from conftest import ROOT
from model.hf_qwen3 import save_qwen3_folder
from scripts.sglang_cpu.server import launch_cpu_server, stop_server
from trainer import rollout_engine as rollout_module
from trainer.grpo_family import rollout_correction_weights
from trainer.rollout_engine import SGLangRolloutEngine, compute_per_token_logps, tokenize_prompts
from trainer.agent.rollout import agent_rollout, server_turn
from trainer.agent.tools import execute_call, parse_tool_calls
from trainer.train_agent import main as agent_main
from trainer.train_grpo import main as grpo_main
from trainer.train_ppo import main as ppo_main
from trainer.infra.weights import build_config, init_model

SGLANG_URL = os.environ.get("SGLANG_URL", "").rstrip("/")
SGLANG_PYTHON = os.environ.get("SGLANG_PYTHON", "")
NO_SERVER = (
    "needs a real SGLang server. To run: bash scripts/setup_sglang_env.sh (builds the 3 GB server venv, "
    "prints its python), then SGLANG_PYTHON=<that python> python -m pytest -q tests/test_sglang_server.py; "
    "or bash .ci/run, which also starts a server and sets SGLANG_URL (docs/sglang.md)"
)
pytestmark = pytest.mark.skipif(not (SGLANG_URL or SGLANG_PYTHON), reason=NO_SERVER)

HIDDEN, LAYERS = 256, 4  # the bundled policy out/full_sft_256.pth
BUNDLED = os.path.join(ROOT, "out", f"full_sft_{HIDDEN}.pth")
ENGINE = dict(backoff_s=0.2, health_retries=3, max_retries=2)
TOLERANCE = 1e-4  # per token: the server's float32 error beyond the trainer's own, and the mean |server - trainer|


def load_policy():
    """The bundled SFT policy in float32 (the server's dtype), eval mode."""
    model, tokenizer = init_model(build_config(HIDDEN, LAYERS, 0), BUNDLED)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """SGLANG_URL, or a server launched here with SGLANG_PYTHON on the bundled policy (stopped at the end)."""
    if SGLANG_URL:
        assert requests.get(SGLANG_URL + "/health", timeout=30).status_code == 200, f"{SGLANG_URL} is not up"
        yield SGLANG_URL
        return
    work_dir = tmp_path_factory.mktemp("sglang_server")
    model, tokenizer = load_policy()
    folder = save_qwen3_folder(model.state_dict(), model.config, str(work_dir / "launch"), tokenizer=tokenizer)
    url, pid = launch_cpu_server(folder, str(work_dir), SGLANG_PYTHON)
    yield url
    stop_server(pid)


@pytest.fixture(scope="module")
def prompts():
    """The first four prompts of the bundled validation split, chat-formatted as the training scripts do."""
    from dataset.lm_dataset import RLAIFDataset

    _, tokenizer = load_policy()
    dataset = RLAIFDataset(os.path.join(ROOT, "dataset", "rlaif_val.jsonl"), tokenizer, seed=0)
    return [dataset[i]["prompt"] for i in range(4)]


def server_vs_trainer(engine, model, prompt_ids, attention_mask, temperature, max_new_tokens=24):
    """One rollout in ``--sglang_logprobs server`` mode -> (max |server - exact|, max |trainer - exact|, the
    rollout), over completion tokens. "exact" is ``compute_per_token_logps`` of a float64 copy of ``model`` on the
    returned ids; "trainer" the same function in float32, the numbers the training scripts use."""
    result = engine.rollout(prompt_ids, attention_mask, 2, max_new_tokens, temperature)
    gen_len = result.completion_ids.size(1)
    with torch.no_grad():
        ours = compute_per_token_logps(
            model, result.output_ids, gen_len, result.attention_mask, temperature
        ).per_token_logps  # [N, R] float32
        exact = compute_per_token_logps(
            copy.deepcopy(model).double(), result.output_ids, gen_len, result.attention_mask, temperature
        ).per_token_logps  # [N, R] float64
    mask = result.completion_mask.bool()
    assert mask.sum() > 0
    server_error = (result.per_token_logps.double() - exact)[mask].abs().max().item()
    trainer_error = (ours.double() - exact)[mask].abs().max().item()
    return server_error, trainer_error, result


def test_server_logps_are_float32_exact_at_t1_and_t07_before_and_after_updates(server_url, prompts, tmp_path):
    model, tokenizer = load_policy()
    frozen = copy.deepcopy(model)
    engine = SGLangRolloutEngine(
        model,
        tokenizer,
        server_url,
        str(tmp_path / "shared"),
        logprobs_mode="server",
        logprob_tolerance=TOLERANCE,
        **ENGINE,
    )
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts, 256, "cpu")
    for temperature in (1.0, 0.7):
        server_error, trainer_error, _ = server_vs_trainer(engine, model, prompt_ids, attention_mask, temperature)
        assert server_error <= TOLERANCE + trainer_error, (temperature, server_error, trainer_error)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for update in range(3):
        result = engine.rollout(prompt_ids, attention_mask, 2, 16, 1.0)
        model.train()
        logps = compute_per_token_logps(
            model, result.output_ids, result.completion_ids.size(1), result.attention_mask
        ).per_token_logps  # [N, R]
        loss = -(logps * result.completion_mask).sum() / result.completion_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.eval()
        engine.update_policy(model)
        for temperature in (1.0, 0.7):
            server_error, trainer_error, result = server_vs_trainer(
                engine, model, prompt_ids, attention_mask, temperature
            )
            assert server_error <= TOLERANCE + trainer_error, (update, temperature, server_error, trainer_error)
    with torch.no_grad():  # the updates took effect: the server's numbers are no longer the starting policy's
        old = compute_per_token_logps(
            frozen, result.output_ids, result.completion_ids.size(1), result.attention_mask, 0.7
        ).per_token_logps
    assert (result.per_token_logps - old)[result.completion_mask.bool()].abs().max().item() > 100 * TOLERANCE


def test_a_server_holding_other_weights_is_caught_by_weight_version(server_url, prompts, tmp_path):
    model, tokenizer = load_policy()
    engine = SGLangRolloutEngine(model, tokenizer, server_url, str(tmp_path / "a"), **ENGINE)
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts[:2], 256, "cpu")
    assert engine.rollout(prompt_ids, attention_mask, 2, 8).metrics["logprob_gap"] <= TOLERANCE

    # a restarted server labels its answers "default" (its --weight-version) again
    synced_folder = os.path.join(engine.shared_path, f"policy_v{engine.client.weight_pushes - 1}")
    reload = requests.post(
        server_url + "/update_weights_from_disk",
        json={"model_path": synced_folder, "weight_version": "default"},
        timeout=120,
    )
    assert reload.json()["success"] is True
    with pytest.raises(
        RuntimeError,
        match=rf"came from weights 'default', but the trainer synced "
        rf"'{engine.client.server_weight_version}'",
    ):
        engine.rollout(prompt_ids, attention_mask, 2, 8)

    # a second trainer on the same server loads its own weights
    engine.update_policy(model)
    assert engine.rollout(prompt_ids, attention_mask, 2, 8).metrics["logprob_gap"] <= TOLERANCE
    other = SGLangRolloutEngine(copy.deepcopy(model), tokenizer, server_url, str(tmp_path / "b"), **ENGINE)
    assert other.client.version_label != engine.client.version_label
    with pytest.raises(RuntimeError, match=rf"came from weights '{other.client.server_weight_version}'"):
        engine.rollout(prompt_ids, attention_mask, 2, 8)


def test_requests_that_would_crash_the_server_are_refused_and_it_keeps_serving(
    server_url, prompts, tmp_path, monkeypatch
):
    model, tokenizer = load_policy()
    engine = SGLangRolloutEngine(model, tokenizer, server_url, str(tmp_path / "shared"), **ENGINE)
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts[:2], 256, "cpu")
    empty_mask = attention_mask.clone()
    empty_mask[1] = 0
    with pytest.raises(ValueError, match=r"prompt rows \[1\] have no token"):
        engine.rollout(prompt_ids, empty_mask, 2, 8)
    outside = prompt_ids.clone()
    outside[0, -1] = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {model.config.vocab_size}\)"):
        engine.rollout(outside, attention_mask, 2, 8)

    # a sampling parameter the server does not know: an HTTP error that names the keys sent, not a crash
    known = rollout_module.sglang_sampling_params
    monkeypatch.setattr(
        rollout_module, "sglang_sampling_params", lambda *args: dict(known(*args), not_a_sampling_param=1)
    )
    with pytest.raises(RuntimeError, match=r"answered HTTP [45]\d\d.*'not_a_sampling_param'"):
        engine.rollout(prompt_ids, attention_mask, 2, 8)
    monkeypatch.setattr(rollout_module, "sglang_sampling_params", known)

    assert requests.get(server_url + "/health", timeout=30).status_code == 200
    assert engine.rollout(prompt_ids, attention_mask, 2, 8).metrics["logprob_gap"] <= TOLERANCE


def generate(url, ids, **params):
    """One raw /generate request for one prompt, greedy unless told; returns the answer dict."""
    sampling = dict({"temperature": 0.0, "max_new_tokens": 16, "skip_special_tokens": False}, **params)
    answer = requests.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": sampling, "return_logprob": True}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_servers_answer_format_that_the_engine_relies_on(server_url, prompts, tmp_path):
    model, tokenizer = load_policy()
    engine = SGLangRolloutEngine(model, tokenizer, server_url, str(tmp_path / "shared"), **ENGINE)
    ids = tokenizer(prompts[0], add_special_tokens=False)["input_ids"]

    free = generate(server_url, ids, max_new_tokens=12)["output_ids"]
    stop = free[4]
    stopped = generate(server_url, ids, max_new_tokens=12, stop_token_ids=[stop])
    first = free.index(stop)
    assert stopped["output_ids"] == free[: first + 1]  # output_ids end with the stop token ...
    assert stopped["text"] == tokenizer.decode(free[:first])  # ... the text leaves it out
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["meta_info"]["weight_version"] == engine.client.server_weight_version

    nothing = generate(server_url, ids, max_new_tokens=0)
    assert nothing["output_ids"] == [] and nothing["meta_info"]["completion_tokens"] == 0

    # a failed update answers 400 and leaves the server on the weights it had
    failed = requests.post(
        server_url + "/update_weights_from_disk",
        json={"model_path": str(tmp_path / "missing"), "weight_version": "never"},
        timeout=120,
    )
    assert failed.status_code == 400 and failed.json()["success"] is False
    with pytest.raises(RuntimeError, match=r"update_weights_from_disk failed .*HTTP 400"):
        engine.push_weights(model, folder=str(tmp_path / "missing"))
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts[:2], 256, "cpu")
    assert engine.rollout(prompt_ids, attention_mask, 2, 8, 0.7).metrics["logprob_gap"] <= TOLERANCE


@pytest.mark.parametrize(
    "script, levers",
    [
        ("grpo", []),
        ("ppo", []),
        ("grpo", ["--gradient_checkpointing", "1", "--micro_batch_size", "1", "--logprob_chunk_size", "8"]),
    ],
)
def test_three_training_steps_against_the_server(script, levers, server_url, tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        "--max_steps",
        "3",
        "--save_dir",
        str(tmp_path),
        "--from_weight",
        BUNDLED,
        "--batch_size",
        "2",
        "--max_gen_len",
        "16",
        "--run_dir",
        str(run_dir),
        "--rollout_engine",
        "sglang",
        "--sglang_url",
        server_url,
        "--sglang_shared_path",
        str(tmp_path / "shared"),
        "--temperature",
        "0.8",
        "--eval_interval",
        "0",
        "--hidden_size",
        str(HIDDEN),
        "--num_hidden_layers",
        str(LAYERS),
    ]
    if script == "grpo":
        grpo_main(argv + ["--num_generations", "2"] + levers)
    else:
        ppo_main(argv + ["--mini_batch_size", "1"] + levers)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["logprob_gap"] <= TOLERANCE for row in rows)  # the server sampled from the trainer's weights
    assert os.listdir(tmp_path / "shared") == ["policy_v3"]  # start-up push + one per step, older ones removed
    assert os.path.isfile(tmp_path / f"{script}_{HIDDEN}.pth")


def test_the_correction_weighs_the_servers_samples_of_bfloat16_weights(server_url, prompts, tmp_path):
    """``--sglang_export_dtype bfloat16 --sglang_logprobs server --rollout_correction ...``: the old log-probs are the
    trainer's forward of its float32 weights, the server's equal a forward of the bfloat16-rounded weights, and the
    correction's weights are exp of the difference of those two forwards, truncated at the cap."""
    model, tokenizer = load_policy()
    engine = SGLangRolloutEngine(
        model,
        tokenizer,
        server_url,
        str(tmp_path / "shared"),
        logprobs_mode="server",
        rollout_correction=True,
        export_dtype=torch.bfloat16,
        **ENGINE,
    )
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts, 256, "cpu")
    result = engine.rollout(prompt_ids, attention_mask, 2, 32, 1.0)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    forward = (result.output_ids, result.completion_ids.size(1), result.attention_mask, 1.0)
    trainer = compute_per_token_logps(model, *forward).per_token_logps  # [N, R]
    served = compute_per_token_logps(rounded, *forward).per_token_logps  # [N, R], what the server holds
    mask = result.completion_mask.bool()
    assert (result.per_token_logps - trainer)[mask].abs().max().item() <= 1e-6
    server_error = (result.sampling_per_token_logps - served)[mask].abs().mean().item()
    assert server_error <= TOLERANCE
    assert (served - trainer)[mask].abs().mean().item() > 10 * server_error  # a mismatch to correct
    cap = 1 + 0.5 * (torch.exp(trainer - served)[mask].max().item() - 1)  # half-way to the largest weight
    weights = rollout_correction_weights(
        result.per_token_logps, result.sampling_per_token_logps, result.completion_mask, "token_truncate", cap
    )
    expected = torch.exp(trainer - served).clamp(max=cap)  # [N, R]
    assert (weights - expected)[mask].abs().max().item() <= 1e-3
    assert (weights[mask] == cap).any() and (weights[mask] < 1).any()


@pytest.mark.parametrize(
    "script, mode", [("grpo", "token_truncate"), ("ppo", "sequence_mask"), ("agent", "token_mask")]
)
def test_corrected_training_steps_against_the_server(script, mode, server_url, tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        "--max_steps",
        "2",
        "--save_dir",
        str(tmp_path),
        "--batch_size",
        "2",
        "--run_dir",
        str(run_dir),
        "--rollout_engine",
        "sglang",
        "--sglang_url",
        server_url,
        "--sglang_shared_path",
        str(tmp_path / "shared"),
        "--eval_interval",
        "0",
        "--hidden_size",
        str(HIDDEN),
        "--num_hidden_layers",
        str(LAYERS),
        "--sglang_logprobs",
        "server",
        "--sglang_export_dtype",
        "bfloat16",
        "--rollout_correction",
        mode,
    ]
    if script == "grpo":
        grpo_main(argv + ["--from_weight", BUNDLED, "--num_generations", "2", "--max_gen_len", "16"])
    elif script == "ppo":
        ppo_main(argv + ["--from_weight", BUNDLED, "--mini_batch_size", "1", "--max_gen_len", "16"])
    else:
        agent_main(
            argv
            + [
                "--from_weight",
                AGENT_SFT,
                "--num_generations",
                "2",
                "--max_gen_len",
                "48",
                "--reward_model_path",
                "none",
            ]
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:  # bfloat16 weights on the server, float32 in the trainer: a real mismatch, measured
        assert row["sampling/sampling_logp_difference/mean"] == pytest.approx(row["logprob_gap"], rel=1e-5)
        assert row["sampling/sampling_logp_difference/mean"] > 3e-5  # float32 weights: 3.4e-6 to 4e-6 (docs)
        low, mean, high = (row[f"sampling/importance_sampling_ratio/{key}"] for key in ("min", "mean", "max"))
        assert 0 <= low <= mean <= high <= 3 and high > low  # a masked weight is 0
        assert 0 <= row["sampling/corrected_share"] < 0.5 and row["sampling/kl_server_trainer"] > 0
    assert os.path.isfile(tmp_path / f"{script}_{HIDDEN}.pth")


def test_the_agents_weights_reach_its_loss(server_url, tmp_path):
    """Every weight above a tiny cap, token_mask zeroes each token's policy term: with --beta 0 the agent's policy
    loss is 0 at every step (tests/test_sglang.py checks GRPO and PPO the same way against the stand-in)."""
    run_dir = tmp_path / "run"
    agent_main(
        [
            "--max_steps",
            "2",
            "--save_dir",
            str(tmp_path),
            "--from_weight",
            AGENT_SFT,
            "--batch_size",
            "2",
            "--num_generations",
            "2",
            "--max_gen_len",
            "48",
            "--run_dir",
            str(run_dir),
            "--rollout_engine",
            "sglang",
            "--sglang_url",
            server_url,
            "--sglang_shared_path",
            str(tmp_path / "shared"),
            "--eval_interval",
            "0",
            "--hidden_size",
            str(HIDDEN),
            "--num_hidden_layers",
            str(LAYERS),
            "--reward_model_path",
            "none",
            "--sglang_logprobs",
            "server",
            "--rollout_correction",
            "token_mask",
            "--rollout_correction_cap",
            "1e-30",
            "--beta",
            "0",
        ]
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["sampling/corrected_share"] == 1.0 and row["policy_loss"] == 0.0 for row in rows)


AGENT_SFT = os.path.join(ROOT, "out", f"agent_sft_{HIDDEN}.pth")  # the agent SFT start: calls the calculator


def test_agent_turns_generated_by_the_server_carry_the_trainers_log_probs_and_the_tools_replies(server_url, tmp_path):
    """``agent_rollout`` with the server generating every turn (train_agent.py --rollout_engine sglang): the server's
    log-probs of the model's tokens equal a forward of the whole conversation by the trainer, tool replies and
    template tokens included in that forward's context; between turns stand ``execute_call``'s replies (mask 0)."""
    model, tokenizer = init_model(build_config(HIDDEN, LAYERS, 0), AGENT_SFT)
    model.eval()
    engine = SGLangRolloutEngine(
        model, tokenizer, server_url, str(tmp_path / "shared"), logprobs_mode="server", **ENGINE
    )  # pushes the agent SFT weights to the server
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "dataset", "agent_rl_val.jsonl"))][:8]
    result = agent_rollout(
        model,
        tokenizer,
        [row["conversations"][:-1] for row in rows],
        4,
        max_new_tokens=96,
        max_total_len=1024,
        temperature=1.0,
        server=engine,
    )
    exact = compute_per_token_logps(
        model, result.output_ids, result.completion_ids.size(1), result.attention_mask, 1.0
    ).per_token_logps  # [N, R]
    mask = result.completion_mask.bool()  # [N, R]
    assert (result.old_per_token_logps - exact)[mask].abs().mean().item() <= TOLERANCE
    assert result.metrics["logprob_gap"] <= TOLERANCE
    assert (result.old_per_token_logps[~mask] == 0).all()
    multi_turn = (result.num_turns > 1).nonzero().flatten().tolist()
    assert multi_turn, "no conversation of 32 called the calculator"
    for n in multi_turn:
        observation = result.completion_ids[n][~mask[n] & result.attention_mask[n, -mask.size(1) :].bool()]
        text = tokenizer.decode(observation)
        replies = [execute_call(call, allowed=["calculate_math"]) for call in parse_tool_calls(result.turn_texts[n][0])]
        assert replies and all(reply in text for reply in replies), (text, replies)


def test_each_row_of_a_turn_is_sent_its_own_budget(server_url, prompts, tmp_path):
    """``server_turn``: a conversation that nearly fills the server's context (2048, scripts/launch_sglang.sh's
    --context-length) is served in the same request as a short one with a larger budget; a single max_new_tokens
    for both would pass the context length and the server would refuse the request."""
    model, tokenizer = load_policy()
    engine = SGLangRolloutEngine(model, tokenizer, server_url, str(tmp_path / "shared"), **ENGINE)
    prompt_ids = tokenizer(prompts[0], add_special_tokens=False)["input_ids"]
    long_context = (prompt_ids * (2048 // len(prompt_ids) + 1))[-2030:]  # ending in a prompt; the server takes
    turns = server_turn(engine, [long_context, prompt_ids], [4, 64], 1.0)  # at most 2042 input tokens
    assert 1 <= len(turns[0][0]) <= 4 and 1 <= len(turns[1][0]) <= 64
    assert len(long_context) + 64 > 2048  # the request one budget for both would have made


@pytest.mark.parametrize("data", ["bundled", "upstream_rows"])
def test_three_agent_training_steps_against_the_server(data, server_url, tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        "--max_steps",
        "3",
        "--save_dir",
        str(tmp_path),
        "--from_weight",
        AGENT_SFT,
        "--batch_size",
        "2",
        "--num_generations",
        "2",
        "--max_gen_len",
        "48",
        "--run_dir",
        str(run_dir),
        "--rollout_engine",
        "sglang",
        "--sglang_url",
        server_url,
        "--sglang_shared_path",
        str(tmp_path / "shared"),
        "--eval_interval",
        "0",
        "--hidden_size",
        str(HIDDEN),
        "--num_hidden_layers",
        str(LAYERS),
        "--reward_model_path",
        "none",
    ]
    if data == "upstream_rows":  # upstream MiniMind's agent_rl.jsonl format, six tools, with the bundled tokenizer
        argv += [
            "--data_path",
            os.path.join(ROOT, "tests", "fixtures", "minimind-agent-format", "agent_rl_format_example.jsonl"),
            "--batch_size",
            "1",
        ]
    agent_main(argv)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["logprob_gap"] <= TOLERANCE for row in rows)  # the server sampled from the trainer's weights
    assert os.listdir(tmp_path / "shared") == ["policy_v3"]  # start-up push + one per step, older ones removed
    assert os.path.isfile(tmp_path / f"agent_{HIDDEN}.pth")


def test_a_server_killed_mid_run_stops_the_run_with_a_clear_error(prompts, tmp_path):
    if not SGLANG_PYTHON:
        pytest.skip(
            "the server-killing test launches its own server: set SGLANG_PYTHON to the python that "
            "bash scripts/setup_sglang_env.sh prints (docs/sglang.md)"
        )
    model, tokenizer = load_policy()
    folder = save_qwen3_folder(model.state_dict(), model.config, str(tmp_path / "launch"), tokenizer=tokenizer)
    url, pid = launch_cpu_server(folder, str(tmp_path), SGLANG_PYTHON)
    run_dir, save_dir = tmp_path / "run", tmp_path / "save"
    command = [
        sys.executable,
        os.path.join(ROOT, "trainer", "train_grpo.py"),
        "--max_steps",
        "500",
        "--save_interval",
        "1",
        "--save_dir",
        str(save_dir),
        "--from_weight",
        BUNDLED,
        "--batch_size",
        "2",
        "--num_generations",
        "2",
        "--max_gen_len",
        "16",
        "--run_dir",
        str(run_dir),
        "--eval_interval",
        "0",
        "--rollout_engine",
        "sglang",
        "--sglang_url",
        url,
        "--sglang_shared_path",
        str(tmp_path / "shared"),
    ]
    trainer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        metrics = run_dir / "metrics.jsonl"
        while time.time() < deadline and trainer.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert trainer.poll() is None, trainer.stdout.read()[-3000:]
        os.killpg(pid, signal.SIGKILL)  # the whole server: launcher, scheduler, detokenizer
        output, _ = trainer.communicate(timeout=300)
    finally:
        stop_server(pid)
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode != 0
    assert f"SGLang server {url}" in output and "Start the server again, then resume the run" in output
    assert "--from_resume 1" in output

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line complete
    steps = [row["step"] for row in rows]
    assert steps == list(range(1, len(rows) + 1)) and len(rows) >= 2
    leftovers = [os.path.join(d, f) for d, dirs, files in os.walk(tmp_path) for f in dirs + files if ".tmp" in f]
    assert leftovers == []
    resume = torch.load(save_dir / f"grpo_{HIDDEN}_resume.pth", map_location="cpu", weights_only=False)
    assert resume["progress"]["step"] >= steps[-1] - 1  # whole, and at most one step behind the log
    weights = torch.load(save_dir / f"grpo_{HIDDEN}.pth", map_location="cpu")
    assert set(weights) == set(model.state_dict())
    for name in os.listdir(tmp_path / "shared"):  # synced folders are whole (written, then renamed)
        assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "shared" / name))
