"""The learner's view: curves of a run, --debug_mode output, the eval table, the log line's ETA, the walkthrough."""

import json
import os
import re
import subprocess
import sys

import torch

from conftest import ROOT
from in_process import run_main

TINY = ["--hidden_size", "64", "--num_hidden_layers", "2"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_script(args, cwd=ROOT, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def drawn_panels(path, rows, columns):
    """How many cells of a ``rows`` x ``columns`` grid over the PNG (decoded by matplotlib) hold a drawing: more than
    2 % of their pixels differ from the white page."""
    from matplotlib import image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, f"{path} is not a PNG"
    pixels = image.imread(path)[..., :3]  # [H, W, 3] in [0, 1]
    height, width = pixels.shape[0] // rows, pixels.shape[1] // columns
    cells = [
        pixels[r * height : (r + 1) * height, c * width : (c + 1) * width] for r in range(rows) for c in range(columns)
    ]
    return sum(bool(((cell < 0.98).any(axis=-1)).mean() > 0.02) for cell in cells)


# ----------------------------------------------------------------------------- scripts/plot_metrics.py
def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_plot_metrics_overlays_runs_and_reports_curves(tmp_path):
    grpo_rows = [
        {
            "step": s,
            "reward": 1.0 + 0.1 * s,
            "reward_model_score": 0.0,
            "kl_ref": 0.01 * s,
            "policy_loss": -0.05,
            "response_len": 30 + s,
            "learning_rate": 5e-5,
        }
        for s in range(1, 6)
    ]
    ppo_rows = [
        {
            "step": s,
            "reward": 1.5,
            "reward_model_score": 0.0,
            "kl_ref": 0.02,
            "approx_kl": 1e-3,
            "clipfrac": 0.01,
            "value_loss": 1.0 / s,
            "learning_rate": 1e-5,
        }
        for s in range(1, 4)
    ]
    write_jsonl(tmp_path / "grpo" / "metrics.jsonl", grpo_rows)
    write_jsonl(tmp_path / "ppo" / "metrics.jsonl", ppo_rows)
    out = tmp_path / "plots" / "runs.png"
    result = run_script(
        [
            "scripts/plot_metrics.py",
            str(tmp_path / "grpo"),
            str(tmp_path / "ppo" / "metrics.jsonl"),
            "--labels",
            "GRPO",
            "PPO",
            "--smooth",
            "2",
            "--out",
            str(out),
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Keys logged by at least one run, in the script's panel order; reward_model_score is 0 everywhere.
    assert (
        "curves: reward, kl_ref, approx_kl, clipfrac, policy_loss, value_loss, response_len, learning_rate"
        in result.stdout
    )
    assert "skipped (0 at every step): reward_model_score" in result.stdout
    assert "run GRPO: 5 logged steps, last step 5" in result.stdout
    assert "run PPO: 3 logged steps, last step 3" in result.stdout
    assert out.stat().st_size > 1000
    assert drawn_panels(out, rows=3, columns=3) == 8  # 8 curves in 3 columns, the ninth cell left empty
    assert not [p for p in os.listdir(out.parent) if p != "runs.png"], "temporary file left behind"


def test_plot_metrics_default_out_and_one_key(tmp_path):
    write_jsonl(tmp_path / "run" / "metrics.jsonl", [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.7}])
    result = run_script(["scripts/plot_metrics.py", str(tmp_path / "run"), "--keys", "reward", "--columns", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "curves: reward\n" in result.stdout
    assert drawn_panels(tmp_path / "run" / "metrics.png", rows=1, columns=1) == 1


def test_plot_metrics_bad_input_names_file_and_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward": 1.0}\n{"step": 2, "reward": \n')
    result = run_script(["scripts/plot_metrics.py", str(run_dir)])
    assert result.returncode == 1
    assert f"{run_dir / 'metrics.jsonl'}:2: invalid JSON" in result.stderr
    result = run_script(["scripts/plot_metrics.py", str(tmp_path / "missing")])
    assert result.returncode == 1 and f"{tmp_path / 'missing'} does not exist" in result.stderr
    result = run_script(["scripts/plot_metrics.py", str(run_dir), "--labels", "a", "b"])
    assert result.returncode == 2 and "--labels has 2 labels for 1 RUN_DIRs" in result.stderr


def test_moving_average_by_hand():
    from scripts.plot_metrics import moving_average

    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([3.0, 6.0, 9.0], 5) == [3.0, 4.5, 6.0]


def test_docs_show_the_default_runs_plot():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "(docs/plots/default_runs.png)" in f.read()  # linked from the README
    with open(os.path.join(ROOT, "docs", "watching.md"), encoding="utf-8") as f:
        text = f.read()
    assert "![" in text and "(plots/default_runs.png)" in text  # shown in docs/watching.md, with its command
    assert "python scripts/plot_metrics.py" in text and "--out docs/plots/default_runs.png" in text
    assert drawn_panels(os.path.join(ROOT, "docs", "plots", "default_runs.png"), rows=1, columns=1) == 1


# ----------------------------------------------------------------------------- --debug_mode and the log line
DEBUG_ANSWER = re.compile(r"^\[debug\] answer (\d+): reward (\S+) \(rule (\S+), rm (\S+), answer (\S+)\)$", re.M)
LOG_LINE_ETA = re.compile(r"^step 1/1 \|.*\| (\d+:\d\d:\d\d) elapsed, (\d+:\d\d:\d\d) left$", re.M)


def check_debug_output(
    stdout, metrics_path, num_prompts, answers_per_prompt, answer_reward_weight=2.0, reward_model=True
):
    """The debug block of step 1: the prompts, every answer with its reward parts, consistent with metrics.jsonl.

    reward_model: the run used the default reward model (scores clipped to [-3, 3], chapter 8.3), else none (0).
    """
    assert stdout.count("[debug] step 1 prompt:\n") == num_prompts
    for block in stdout.split("[debug] step 1 prompt:\n")[1:]:
        assert block.startswith("<|im_start|>") and "<|im_start|>user" in block  # the chat-templated prompt
    answers = DEBUG_ANSWER.findall(stdout)
    assert [int(a[0]) for a in answers] == list(range(answers_per_prompt)) * num_prompts
    rewards = []
    for _, reward, rule, rm, answer in answers:
        # reward = rule reward + reward-model score + weight x answer reward (chapter 8.3), as printed (3 decimals)
        assert abs(float(reward) - (float(rule) + float(rm) + answer_reward_weight * float(answer))) < 2e-3
        assert float(answer) in (0.0, 1.0)
        assert -3.0 <= float(rm) <= 3.0 if reward_model else float(rm) == 0.0
        rewards.append(float(reward))
    if reward_model:
        assert any(float(a[3]) != 0.0 for a in answers)  # the reward model's scores are really in the sum
    # the first row is the held-out evaluation at step 0; the row of step 1 holds the step's metrics
    logged = next(row for row in map(json.loads, metrics_path.read_text().splitlines()) if row["step"] == 1)
    assert abs(sum(rewards) / len(rewards) - logged["reward"]) < 1e-3
    # The last step's log line: elapsed time and 0 s left (elapsed / 1 step x 0 steps to go).
    match = LOG_LINE_ETA.search(stdout)
    assert match, stdout[-2000:]
    assert match.group(2) == "0:00:00"


def test_grpo_debug_mode_prints_prompts_answers_and_reward_parts(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    run_dir = tmp_path / "run"
    result = run_main(
        "train_grpo",
        [
            "--max_steps",
            "1",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--batch_size",
            "2",
            "--num_generations",
            "3",
            "--max_gen_len",
            "8",
            "--run_dir",
            str(run_dir),
            "--debug_mode",
            "--debug_interval",
            "1",
        ]
        + TINY,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check_debug_output(result.stdout, run_dir / "metrics.jsonl", num_prompts=2, answers_per_prompt=3)


def test_ppo_debug_mode_prints_prompts_answers_and_reward_parts(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    run_dir = tmp_path / "run"
    result = run_main(
        "train_ppo",
        [
            "--max_steps",
            "1",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--batch_size",
            "2",
            "--mini_batch_size",
            "2",
            "--max_gen_len",
            "8",
            "--run_dir",
            str(run_dir),
            "--debug_mode",
            "--debug_interval",
            "1",
            "--reward_model_path",
            "none",
        ]
        + TINY,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check_debug_output(
        result.stdout, run_dir / "metrics.jsonl", num_prompts=2, answers_per_prompt=1, reward_model=False
    )


def test_debug_interval_skips_steps(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    result = run_main(
        "train_grpo",
        [
            "--max_steps",
            "2",
            "--save_dir",
            save_dir,
            "--from_weight",
            name,
            "--batch_size",
            "1",
            "--num_generations",
            "2",
            "--max_gen_len",
            "4",
            "--run_dir",
            str(tmp_path / "run"),
            "--debug_mode",
            "--debug_interval",
            "2",
        ]
        + TINY,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[debug] step 1 " not in result.stdout and result.stdout.count("[debug] step 2 prompt:") == 1


def test_step_timer_eta_by_hand(monkeypatch):
    import time

    from trainer.infra.metrics import StepTimer, format_duration

    clock = iter([1000.0, 1020.0])
    monkeypatch.setattr(time, "time", lambda: next(clock))
    timer = StepTimer(total_steps=10)
    # 20 s for 2 steps -> 10 s per step, 8 steps to go -> 80 s.
    assert timer.eta(2) == ("0:00:20", "0:01:20")
    clock = iter([500.0, 530.0])
    timer = StepTimer(total_steps=10, start_step=4)  # resumed at step 4: only steps 5 and 6 were timed
    assert timer.eta(6) == ("0:00:30", "0:01:00")
    assert format_duration(3725) == "1:02:05" and format_duration(-3) == "0:00:00"


# ----------------------------------------------------------------------------- scripts/eval_policy.py
def heldout_questions(count):
    """The user turns of the first ``count`` test-split rows (eval_policy.py's default), read straight from the file."""
    with open(os.path.join(ROOT, "dataset", "rlaif_test.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(count))]
    return [[t["content"] for t in row["conversations"] if t["role"] == "user"][-1] for row in rows]


def test_eval_compares_checkpoints_side_by_side(tiny_weights, tmp_path):
    save_dir, name = tiny_weights
    same_file = os.path.join(save_dir, "tiny_64.pth")
    table = tmp_path / "eval.json"
    result = run_script(
        [
            "scripts/eval_policy.py",
            "--weights",
            name,
            same_file,
            "--save_dir",
            save_dir,
            "--num_prompts",
            "4",
            "--batch_size",
            "2",
            "--max_gen_len",
            "6",
            "--show_samples",
            "2",
            "--json_out",
            str(table),
        ]
        + TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads(table.read_text())
    # The same weights under two names answer the same prompts with the same seed: identical rows and answers.
    assert scores[name] == scores[same_file]
    for key in [
        "accuracy",
        "reward",
        "rule_reward",
        "reward_model_score",
        "answer_reward",
        "response_len",
        "distinct_2",
    ]:
        assert key in scores[name]
    blocks = result.stdout.split("\n--- prompt ")[1:]
    assert len(blocks) == 2
    for i, (block, question) in enumerate(zip(blocks, heldout_questions(2))):
        assert block.startswith(f"{i}: {question}  (reference ")
        answers = [line for line in block.splitlines() if line.startswith("[")]
        assert [a.split("]")[0] for a in answers] == [f"[{name:<{len(same_file)}}", f"[{same_file}"]
        assert answers[0].split("] ", 1)[1] == answers[1].split("] ", 1)[1]


def test_side_by_side_marks_correct_answers():
    from scripts.eval_policy import side_by_side

    prompt = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"

    def sample(completion, correct, rule):
        return {
            "prompt": prompt,
            "completion": completion,
            "reference": "5",
            "rule_reward": rule,
            "reward_model_score": 0.0,
            "answer_reward": 1.0 if correct else 0.0,
        }

    results = {
        "sft": {"samples": [sample("It is 6.", False, -0.5)]},
        "grpo": {"samples": [sample("2+3=5\n</think>\nThe answer is 5.", True, 1.25)]},
    }
    assert side_by_side(results, 3) == [
        "--- prompt 0: What is 2 + 3?  (reference 5)\n"
        "[sft ] wrong   rule -0.50 | 'It is 6.'\n"
        "[grpo] correct rule +1.25 | '2+3=5\\n</think>\\nThe answer is 5.'"
    ]


# ----------------------------------------------------------------------------- scripts/walkthrough.py
def printed_vector(text, name):
    """The values printed under ``name: shape [N], float32`` (``format_tensor`` of a 1-D tensor)."""
    match = re.search(rf"^{re.escape(name)}: shape \[(\d+)\], float32\n  (.+)$", text, re.M)
    assert match, f"{name} not printed"
    values = [float(v) for v in match.group(2).split()]
    assert len(values) == int(match.group(1))
    return values


def printed_rows(text, name):
    """{row: first values} printed under ``name: shape [B, R], float32`` (``format_tensor`` of a 2-D tensor)."""
    header = re.search(rf"^{re.escape(name)}: shape \[\d+, \d+\], float32$", text, re.M)
    assert header, f"{name} not printed"
    rows = {}
    for line in text[header.end() + 1 :].splitlines():
        match = re.match(r"^  \[(\d+)\] ([-0-9. ]+?)(?: \.\.\. \(\+\d+ more\))?$", line)
        if not match:
            break
        rows[int(match.group(1))] = [float(v) for v in match.group(2).split()]
    return rows


def printed_window(text, name):
    """{row: (first position, values)} printed by ``format_window`` under ``name``."""
    header = re.search(rf"^{re.escape(name)}: shape \[.*\], \w+; around each row's last real token$", text, re.M)
    assert header, f"{name} window not printed"
    rows = {}
    for line in text[header.end() + 1 :].splitlines():
        match = re.match(r"^  \[(\d+)\] t=(\d+)\.\.(\d+): (.+)$", line)
        if not match:
            break
        rows[int(match.group(1))] = (int(match.group(2)), [float(v) for v in match.group(4).split()])
    return rows


def test_walkthrough_prints_every_stage_with_consistent_numbers(tiny_weights, tmp_path):
    from scripts.walkthrough import GRPO_STAGES, PPO_STAGES

    save_dir, name = tiny_weights
    out = tmp_path / "walkthrough.md"
    G = 4
    # 120 tokens: long enough that some answers of the random tiny model pass the rule reward's 20 characters.
    flags = ["--save_dir", save_dir, "--from_weight", name, "--max_gen_len", "120", "--num_generations", str(G)] + TINY
    result = run_script(["scripts/walkthrough.py", "--out", str(out)] + flags)
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text(encoding="utf-8")
    grpo_text, ppo_text = text.split("## PPO step (chapter 8.4)")
    positions = [grpo_text.index(f"### {stage}") for stage in GRPO_STAGES]
    assert positions == sorted(positions)
    positions = [ppo_text.index(f"### {stage}") for stage in PPO_STAGES]
    assert positions == sorted(positions)
    assert "## PPO vs GRPO on this batch (chapter 8.7)" in ppo_text
    for tensor in [
        "prompt_ids: shape [2, ",
        "completion_mask: shape [8, ",
        "old_per_token_logps: shape [8, ",
        "ref_per_token_logps: shape [8, ",
        "per_token_logps: shape [8, ",
        "ratio: shape [8, ",
    ]:
        assert tensor in grpo_text, tensor

    # GRPO: rewards = rule + rm + 2 x answer, and the group advantages (r - mean) / (std + 1e-4), by hand.
    rule, rm, answer = (printed_vector(grpo_text, n) for n in ("rule_rewards", "reward_model_scores", "answer_rewards"))
    rewards = printed_vector(grpo_text, "rewards")
    assert len(rewards) == 2 * G
    for r, a, b, c in zip(rewards, rule, rm, answer):
        assert abs(r - (a + b + 2.0 * c)) < 1e-5
    advantages = printed_vector(grpo_text, "advantages")
    stds = []
    for g in range(2):
        group = rewards[g * G : (g + 1) * G]
        mean = sum(group) / G
        std = (sum((x - mean) ** 2 for x in group) / G) ** 0.5
        stds.append(std)
        for x, adv in zip(group, advantages[g * G : (g + 1) * G]):
            assert abs(adv - (x - mean) / (std + 1e-4)) < 1e-4
    assert max(stds) > 0, "every group had equal rewards: the advantage check above would be vacuous"

    # PPO: the reward sits on the last real token, and GAE walks back from there with the printed gamma, lambda.
    ppo_rewards = printed_vector(ppo_text, "rewards")
    last = json.loads(re.search(r"^last real token per row: (\[.*\])$", ppo_text, re.M).group(1))
    token_rewards = printed_window(ppo_text, "token_rewards")
    values = printed_window(ppo_text, "old_resp_values")
    gae = printed_window(ppo_text, "advantages (GAE, before whitening)")
    returns = printed_window(ppo_text, "returns")
    flags_line = re.search(r"γ = ([0-9.]+), λ = ([0-9.]+),", ppo_text)
    gamma, lam = float(flags_line.group(1)), float(flags_line.group(2))
    from trainer.train_ppo import parse_args as ppo_parse_args

    ppo_defaults = ppo_parse_args(["--reward_model_path", "none"])
    assert (gamma, lam) == (ppo_defaults.gamma, ppo_defaults.lam), "the walkthrough shows train_ppo.py's defaults"
    for row in range(2):
        start, shown = token_rewards[row]
        for offset, value in enumerate(shown):
            assert value == (ppo_rewards[row] if start + offset == last[row] else 0.0)
        _, v = values[row]
        _, a = gae[row]
        _, ret = returns[row]
        expected, next_value, next_advantage = [], 0.0, 0.0
        for t in range(last[row], start - 1, -1):  # a plain backward loop over the shown real tokens
            r = ppo_rewards[row] if t == last[row] else 0.0
            delta = r + gamma * next_value - v[t - start]
            next_advantage = delta + gamma * lam * next_advantage
            next_value = v[t - start]
            expected.insert(0, next_advantage)
        assert all(abs(x - y) < 1e-4 for x, y in zip(a, expected)), (a, expected)
        assert all(abs(x - (y + z)) < 1e-5 for x, y, z in zip(ret, a, v))

    # Whitening over every real token of the batch, by hand. The critic's value head starts at 0, so V = 0 on every
    # position (checked where printed) and the plain backward loop covers whole answers.
    lengths = json.loads(re.search(r"^answer lengths: (\[.*\])$", ppo_text, re.M).group(1))
    assert lengths == [t + 1 for t in last]
    printed_values = printed_rows(ppo_text, "old_resp_values")
    assert all(x == 0.0 for row in range(2) for x in printed_values[row] + values[row][1]), "V is not 0"
    gae_by_hand = []
    for row in range(2):
        advantage, row_advantages = 0.0, []
        for t in range(lengths[row] - 1, -1, -1):
            advantage = (ppo_rewards[row] if t == lengths[row] - 1 else 0.0) + gamma * lam * advantage
            row_advantages.insert(0, advantage)
        gae_by_hand.append(row_advantages)
    real = [x for row_advantages in gae_by_hand for x in row_advantages]
    mean = sum(real) / len(real)
    variance = sum((x - mean) ** 2 for x in real) / len(real)
    whitened = printed_rows(ppo_text, "advantages (whitened)")
    for row in range(2):
        shown = whitened[row]
        expected = [(x - mean) / (variance + 1e-8) ** 0.5 for x in gae_by_hand[row][: len(shown)]]
        expected += [0.0] * (len(shown) - len(expected))  # 0 past the answer's end
        assert all(abs(x - y) < 2e-4 for x, y in zip(shown, expected)), (row, shown, expected)
    # the advantages ppo_rollout returned, which ppo_update trains on, are the ones printed (so checked above)
    difference = re.search(r"^max \|difference\| from the advantages ppo_rollout returned: (\S+)$", ppo_text, re.M)
    assert float(difference.group(1)) < 1e-6
    assert re.search(r"^\| answers sampled for 2 prompts \| 8 \| 2 \|$", ppo_text, re.M)

    # Fixed seeds: a second run writes the same document (but for the command line it quotes).
    from scripts.walkthrough import main

    again = tmp_path / "again.md"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess above (OMP_NUM_THREADS=1): the same float reduction order
    try:
        main(["--out", str(again)] + flags)
    finally:
        torch.set_num_threads(threads)
    assert again.read_text(encoding="utf-8").split("\n", 3)[3] == text.split("\n", 3)[3]


def test_read_metrics_keeps_the_last_row_of_a_step_logged_twice(tmp_path):
    # a run killed after logging step 3 and resumed from its step-2 checkpoint logs step 3 again
    rows = [
        {"step": 1, "reward": 0.1},
        {"step": 2, "reward": 0.2},
        {"step": 3, "reward": 0.9},
        {"step": 3, "reward": 0.3},
        {"step": 4, "reward": 0.4},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from plot_metrics import read_metrics

    assert [(r["step"], r["reward"]) for r in read_metrics(str(tmp_path))] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
