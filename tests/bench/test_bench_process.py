"""scripts/bench/bench_process.py --tiny end to end: its per-step figures against its raw times, each run's wall time
against the run's own record of its steps, the prompts against the data loader, the table's rows (no timing
asserted)."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, require_trl


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One ``--tiny`` run (float32, ours and TRL): (report, stdout, work_dir)."""
    require_trl()
    folder = tmp_path_factory.mktemp("bench_process")
    out, work_dir = folder / "process.json", folder / "runs"
    result = subprocess.run(
        [sys.executable, "scripts/bench/bench_process.py", "--tiny", "--work_dir", str(work_dir), "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8")), result.stdout, str(work_dir)


def contestant_runs(report, contestant):
    """Every raw run record of ``contestant`` in the report."""
    return [
        run
        for workload in report["workloads"]
        for repeat in workload["repeats"]
        for run in repeat["runs"]
        if run["contestant"] == contestant
    ]


def flag_value(command, flag):
    """The value that follows ``flag`` in a recorded command line."""
    words = shlex.split(command)
    return words[words.index(flag) + 1]


def test_per_step_times_are_the_difference_of_the_fastest_runs(tiny_run):
    report, _, _ = tiny_run
    args = report["args"]
    assert (args["short_steps"], args["long_steps"], args["runs"], args["repeats"]) == (1, 2, 1, 1)
    contestants = ["ours", "trl"]
    for workload in report["workloads"]:
        for repeat in workload["repeats"]:
            assert [(r["contestant"], r["steps"]) for r in repeat["runs"]] == [
                (c, s) for s in (1, 2) for c in contestants
            ]  # in turn: ours 1, TRL 1, ours 2, TRL 2
            for contestant in contestants:
                fastest = {}
                for run in repeat["runs"]:
                    if run["contestant"] == contestant:
                        best = fastest.get(run["steps"], run["wall_s"])
                        fastest[run["steps"]] = min(best, run["wall_s"])
                expected = (fastest[2] - fastest[1]) / (2 - 1)
                assert repeat["per_step_s"][contestant] == pytest.approx(expected, rel=1e-12, abs=1e-12)
            ours = repeat["per_step_s"]["ours"]
            bench_step = repeat["bench"]["step_s_median"]
            # the in-process step is the median difference of the bench run's own elapsed_s (its metrics.jsonl)
            with open(os.path.join(repeat["bench"]["run_dir"], "metrics.jsonl"), encoding="utf-8") as f:
                elapsed = [json.loads(line)["elapsed_s"] for line in f if line.strip()]
            assert len(elapsed) == 2 and bench_step == elapsed[1] - elapsed[0] > 0  # --tiny: 1 warm-up, 1 timed
            # a per-step time <= 0 (start-up noise larger than a tiny step) gives no ratio
            assert repeat["command_over_in_process"] == (pytest.approx(ours / bench_step) if ours > 0 else None)
            trl = repeat["per_step_s"]["trl"]
            assert repeat["ratio_ours_trl"] == (pytest.approx(ours / trl) if ours > 0 and trl > 0 else None)
            assert workload["summary"]["ours_s_per_step"]["values"] == [ours]


def test_ours_wall_time_covers_its_own_metrics_and_the_final_save(tiny_run):
    report, _, _ = tiny_run
    runs = contestant_runs(report, "ours")
    assert runs
    for run in runs:
        command = run["command"]
        assert shlex.split(command)[1:3] == [os.path.join(ROOT, "scripts", "bench", "full_length.py"), "grpo"]
        for flag, value in (
            ("--thinking_ratio", "1"),
            ("--eval_interval", "0"),
            ("--loss_type", "cispo"),
            ("--reward_model_path", "none"),
            ("--dtype", "float32"),
            ("--max_gen_len", "8"),
            ("--max_steps", str(run["steps"])),
        ):
            assert flag_value(command, flag) == value, (flag, command)
        assert int(flag_value(command, "--save_interval")) > run["steps"]
        with open(os.path.join(flag_value(command, "--run_dir"), "metrics.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        elapsed = [row["elapsed_s"] for row in rows if "elapsed_s" in row]
        assert len(elapsed) == run["steps"]
        assert run["returncode"] == 0 and run["wall_s"] >= elapsed[-1]
        with open(run["log"], encoding="utf-8") as f:
            log = f.read()
        assert f"step {run['steps']}/{run['steps']} |" in log and f"saved step {run['steps']}:" in log
        # what the script saves at its last step, whatever --save_interval says
        assert {"grpo_64.pth", "grpo_64.tokenizer.json", "grpo_64_resume.pth"} <= set(run["files_written"])


def test_trl_wall_time_covers_its_own_log(tiny_run):
    report, _, _ = tiny_run
    runs = contestant_runs(report, "trl")
    assert runs
    for run in runs:
        with open(run["log"], encoding="utf-8") as f:
            results = [json.loads(line.split(" ", 1)[1]) for line in f if line.startswith("TRL_WORKER_RESULT ")]
        assert len(results) == 1 and results[0]["global_step"] == run["steps"]
        assert len(results[0]["step_time"]) == run["steps"]
        assert run["returncode"] == 0
        assert run["wall_s"] >= results[0]["train_runtime"] >= 0
        assert run["wall_s"] >= sum(results[0]["step_time"])
        assert run["files_written"] == {}  # save_strategy="no": TRL writes nothing to its output folder


def test_every_contestant_gets_the_prompts_the_data_loader_renders(tiny_run, tokenizer):
    from dataset.lm_dataset import RLAIFDataset

    report, _, work_dir = tiny_run
    data_path = os.path.join(work_dir, "prompts.jsonl")
    runs = contestant_runs(report, "ours")
    seed = int(flag_value(runs[0]["command"], "--seed"))
    dataset = RLAIFDataset(data_path, tokenizer, thinking_ratio=1.0, seed=seed)
    rendered = [dataset[i]["prompt"] for i in range(len(dataset))]
    assert len(rendered) == 2 and report["prompts"] == rendered
    assert all(prompt.endswith("<|im_start|>assistant\n<think>\n") for prompt in rendered)
    for run in runs:
        assert flag_value(run["command"], "--data_path") == data_path
        assert flag_value(run["command"], "--thinking_ratio") == "1"
        assert int(flag_value(run["command"], "--seed")) == seed
    trl_runs = contestant_runs(report, "trl")
    assert trl_runs
    for run in trl_runs:
        with open(flag_value(run["command"], "--trl_worker"), encoding="utf-8") as f:
            assert json.load(f)["prompts"] == rendered


def test_table_names_every_size_and_dtype(tiny_run):
    report, stdout, _ = tiny_run
    assert [(w["size"], w["dtype"]) for w in report["workloads"]] == [("tiny", "float32")]
    rows = [line for line in stdout.splitlines() if line.startswith("| tiny (h64 x2) | float32 |")]
    assert len(rows) == 1 and rows[0] in report["table"]
    assert f"{os.cpu_count()} cores" in report["table"] and report["machine"]["cores"] == os.cpu_count()
