"""scripts/bench/bench.py: its FLOP count against torch's own counter, its phase tracer against the wall clock, its tiny
mode end to end (step times against the runs' own metrics.jsonl; no speed asserted), and that the benchmarks run
the training code as it is (no patching, no copy of the update)."""

import ast
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import ROOT, require_trl
from dataset.lm_dataset import RLAIFDataset
from model.model_minimind import MiniMindForCausalLM
from scripts.bench.bench import NUM_GENERATIONS, NUM_PROMPTS, PHASES, forward_flops, has_bf16_units
from trainer.infra.weights import build_config


def test_forward_flops_equal_torch_flop_counter():
    """Without the attention term (context 0) the count is every matrix product of a real forward."""
    config = build_config(64, 2, 0)
    model = MiniMindForCausalLM(config)
    input_ids = torch.randint(0, config.vocab_size, (3, 10))  # [B, T]
    with FlopCounterMode(display=False) as counter:
        model(input_ids, logits_to_keep=4)
    assert forward_flops(config, tokens=30, context=0, logit_positions=12) == counter.get_total_flops()


def test_tiny_bench_runs_every_contestant(tmp_path, tokenizer):
    require_trl()
    out, work_dir = tmp_path / "bench.json", tmp_path / "work"
    result = subprocess.run(
        [sys.executable, "scripts/bench/bench.py", "--tiny", "--json", str(out), "--work_dir", str(work_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["matmul_peak_gflops"]["float32"] > 0
    # every contestant got the prompts our scripts' data loader renders from the prompt file they read
    dataset = RLAIFDataset(str(work_dir / "prompts.jsonl"), tokenizer, thinking_ratio=1.0, seed=42)
    assert report["prompts"] == [dataset[i]["prompt"] for i in range(len(dataset))] and len(dataset) == NUM_PROMPTS
    by_name = {row["contestant"]: row["result"] for row in report["results"] if row["dtype"] == "float32"}
    assert set(by_name) == {"ours_grpo", "trl_grpo", "ours_rollout", "hf_generate", "ours_ppo", "trl_ppo"}
    if "skipped" in by_name["trl_ppo"]:  # TRL 1.9.2 goes into a folder of its own (scripts/bench/bench.py)
        assert "pip install --no-deps --target" in by_name.pop("trl_ppo")["skipped"]
    for name, figures in by_name.items():
        assert "error" not in figures, (name, figures)
        phases = figures["phases_s"]
        assert set(phases) == set(PHASES) | {"other"}
        assert figures["step_s_median"] == statistics.median(figures["step_s"]) and len(figures["step_s"]) == 1
        # with one timed step the phases and "other" add up to the step (unless the phases overran it: other 0)
        assert abs(sum(phases.values()) - figures["step_s_median"]) < 1e-6 or phases["other"] == 0
        assert figures["rollout_tokens_per_s"] == NUM_PROMPTS * NUM_GENERATIONS * 8 / phases["rollout"]
        assert figures["peak_rss_mib"] > 0 and figures["cpu_s_median"] > 0
    for name in ("ours_grpo", "ours_ppo"):  # the step time is the loop's own clock: metrics.jsonl's elapsed_s
        figures = by_name[name]
        with open(os.path.join(figures["run_dir"], "metrics.jsonl"), encoding="utf-8") as f:
            elapsed = [json.loads(line)["elapsed_s"] for line in f if line.strip()]
        assert len(elapsed) == 2 and figures["step_s"] == [elapsed[1] - elapsed[0]]  # --tiny: 1 warm-up, 1 timed
        assert not os.path.exists(os.path.join(os.path.dirname(figures["run_dir"]), "save"))  # checkpoints removed
    for name in ("ours_grpo", "trl_grpo", "ours_ppo"):  # the traced phases of a step
        phases = by_name[name]["phases_s"]
        assert (
            min(
                phases[p]
                for p in ("rollout", "reference_forward", "policy_forward", "policy_backward", "optimizer", "reward")
            )
            > 0
        ), (name, phases)
        assert by_name[name]["python_calls_per_step"] > 0
    assert "| tiny (h64 x2), 8 tok, float32 | ours_grpo |" in result.stdout
    # --dtype auto: fp32 always, bf16 as well only where the CPU lists bf16 matrix units
    expected_dtypes = {"float32", "bfloat16"} if has_bf16_units("cpu") else {"float32"}
    assert {row["dtype"] for row in report["results"]} == expected_dtypes


def test_untraced_worker_reports_the_loops_step_times_only(tmp_path, tokenizer):
    """--phases 0: our GRPO run without the trace function, its step times still metrics.jsonl's differences."""
    from scripts.bench.bench import loader_prompts, prepare_weights, run_worker, write_prompt_file

    data_path = str(tmp_path / "prompts.jsonl")
    write_prompt_file(
        data_path,
        [
            "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n",
        ],
        ["2", "5"],
    )
    prompts, answers = loader_prompts(data_path, tokenizer)
    assert all(p.endswith("<think>\n") for p in prompts) and answers == ["2", "5"]
    pth, folder = prepare_weights("tiny", str(tmp_path), tokenizer)
    spec = dict(
        contestant="ours_grpo",
        hidden_size=64,
        num_hidden_layers=2,
        pth=pth,
        qwen3_folder=folder,
        gen_len=4,
        prompts=prompts,
        answers=answers,
        data_path=data_path,
        prompt_len=16,
        steps=2,
        warmup=1,
        dtype="float32",
        threads=1,
        peaks={"float32": 1.0},
        device="cpu",
        phases=False,
        tmp_dir=str(tmp_path / "worker"),
        ours_flags=[],
        natural_eos=False,
    )
    figures = run_worker(spec, 600)
    assert "error" not in figures, figures
    with open(tmp_path / "worker" / "run" / "metrics.jsonl", encoding="utf-8") as f:
        elapsed = [json.loads(line)["elapsed_s"] for line in f if line.strip()]
    assert len(elapsed) == 3 and figures["step_s"] == [elapsed[1] - elapsed[0], elapsed[2] - elapsed[1]]
    assert figures["phases_s"] is None and figures["python_calls_per_step"] is None
    assert figures["step_s_median"] == statistics.median(figures["step_s"])
    assert len(figures["run_dir"]) and figures["cpu_s_median"] > 0


def test_phase_tracer_times_watched_calls_and_leaves_them_in_place():
    from scripts.bench.bench import PhaseTracer, forward_phase

    def leaf(seconds):
        time.sleep(seconds)

    def outer():
        leaf(0.03)  # inside a watched call: counts for "outer" only
        time.sleep(0.02)

    @torch.no_grad()
    def decorated():
        time.sleep(0.01)

    def forward(model):
        time.sleep(0.01)

    def failing():
        time.sleep(0.01)
        raise KeyError("out")

    def step_end():
        pass

    trained, frozen = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).requires_grad_(False)
    codes = [f.__code__ for f in (leaf, outer, decorated, forward, failing)]
    tracer = PhaseTracer()
    for function, phase in (
        (leaf, "leaf"),
        (outer, "outer"),
        (decorated, "decorated"),
        (forward, forward_phase),
        (failing, "failing"),
    ):
        tracer.watch(function, phase)
    tracer.at_entry(step_end, tracer.end_step)
    before = sys.gettrace()
    walls = {}
    with tracer.tracing():
        for name, call in (
            ("outer", outer),
            ("leaf", lambda: leaf(0.02)),
            ("decorated", decorated),
            ("policy_forward", lambda: forward(trained)),
        ):
            start = time.perf_counter()
            call()
            walls[name] = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():
            forward(trained)  # the trained model without grad: a reference forward
        forward(frozen)  # grad on, no trainable weight: a reference forward too
        walls["reference_forward"] = time.perf_counter() - start
        start = time.perf_counter()
        with pytest.raises(KeyError):
            failing()
        walls["failing"] = time.perf_counter() - start
        step_end()
        step_end()
    assert sys.gettrace() is before
    assert [f.__code__ for f in (leaf, outer, decorated, forward, failing)] == codes  # nothing replaced
    phases, empty = tracer.steps
    assert empty == {} and set(phases) == set(walls)
    lower = {
        "outer": 0.05,
        "leaf": 0.02,
        "decorated": 0.01,
        "policy_forward": 0.01,
        "reference_forward": 0.02,
        "failing": 0.01,
    }
    for name, seconds in phases.items():
        assert lower[name] <= seconds <= walls[name], (name, seconds, walls[name])
    assert tracer.calls_per_step[0] >= 7  # at least the calls above


def imported_training_names(tree):
    """Names a module binds to trainer/ or model/ modules or their members (imports and importlib.import_module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in ("trainer", "model")
            )
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("trainer", "model"):
            names.update(a.asname or a.name for a in node.names)
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "importlib.import_module"
        ):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@pytest.mark.parametrize(
    "script, replaced",
    [
        ("bench.py", []),
        ("bench_process.py", []),
        ("bench_levers.py", []),
        ("profile_run.py", []),
        ("full_length.py", ["MiniMindForCausalLM.generate"] * 2),  # set, then restored
    ],
)
def test_benchmarks_patch_no_training_module_and_copy_no_update(script, replaced):
    """No assignment, setattr or del on anything imported from trainer/ or model/ (but ``generate`` in
    scripts/bench/full_length.py), and no call of the update's operations (backward, optimizer / scheduler step,
    clipping, zero_grad): the training loop does those."""
    tree = ast.parse(open(os.path.join(ROOT, "scripts", "bench", script), encoding="utf-8").read())
    training = imported_training_names(tree)
    patched, update_calls = [], []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "delattr") and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        patched += [
            ast.unparse(t)
            for t in targets
            if isinstance(t, (ast.Attribute, ast.Subscript)) and root_name(t) in training
        ]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("backward", "step", "clip_grad_norm_", "zero_grad")
        ):
            update_calls.append(ast.unparse(node))
    assert patched == replaced and update_calls == []


def test_full_length_answers_sample_to_the_limit_and_keep_the_mask(policy, tokenizer):
    """scripts/bench/full_length.py: every row samples max_new_tokens tokens; through its first EOS a row holds the
    tokens and log-probs of a plain rollout with the same generator, and its completion mask ends there. On leaving the
    block ``generate`` is the model's own again."""
    from model.model_minimind import MiniMindForCausalLM
    from scripts.bench.full_length import full_length_answers
    from trainer.rollout_engine import TorchRolloutEngine, tokenize_prompts

    own_generate = MiniMindForCausalLM.generate
    eos_bias = torch.zeros(policy.config.vocab_size)  # [V]
    eos_bias[tokenizer.eos_token_id] = 8.0  # p(EOS) ~ 30% per token: every row emits EOS within the limit
    policy.lm_head.register_forward_hook(lambda module, inputs, logits: logits + eos_bias)
    prompts = ["<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"] * 2
    prompt_ids, attention_mask, _ = tokenize_prompts(tokenizer, prompts, 256, "cpu")
    results = []
    for full_length in (False, True):
        engine = TorchRolloutEngine(policy, tokenizer, generator=torch.Generator().manual_seed(3))
        with full_length_answers() if full_length else contextlib.nullcontext():
            results.append(engine.rollout(prompt_ids, attention_mask, 4, 24, temperature=0.9))
    plain, full = results
    assert MiniMindForCausalLM.generate is own_generate
    assert full.completion_ids.size(1) == 24 and plain.completion_ids.size(1) < 24
    assert torch.equal(
        full.completion_mask,
        torch.cat(
            [plain.completion_mask, plain.completion_mask.new_zeros((8, 24 - plain.completion_ids.size(1)))], dim=1
        ),
    )
    mask = plain.completion_mask.bool()  # [8, R]
    width = plain.completion_ids.size(1)
    assert 0 < (~mask).sum() and torch.equal(full.completion_ids[:, :width][mask], plain.completion_ids[mask])
    assert (full.per_token_logps[:, :width][mask] - plain.per_token_logps[mask]).abs().max() <= 1e-5
    assert (full.completion_ids[:, width:] != tokenizer.pad_token_id).any()  # sampled past EOS, not padded
    assert full.completions == plain.completions


def test_bf16_units_are_read_from_the_cpu_flags(tmp_path, monkeypatch):
    import builtins

    real_open = builtins.open
    for flags, expected in (
        ("fpu avx2 avx512f", False),
        ("fpu avx512f avx512_bf16", True),
        ("fpu amx_tile amx_bf16 amx_int8", True),
    ):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(
            builtins, "open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k)
        )
        assert has_bf16_units("cpu") is expected, flags
    monkeypatch.setattr(builtins, "open", real_open)


def test_bench_levers_layouts_give_the_same_first_loss(tiny_weights, tmp_path):
    """scripts/bench/bench_levers.py's runs: every forward layout computes step 1's loss from the same rollout, so the
    losses agree to float rounding (the bf16 variant is left out: it rounds differently)."""
    from scripts.bench.bench_levers import VARIANTS, format_table, run_training

    save_dir, name = tiny_weights
    tiny = [
        "--from_weight",
        os.path.join(save_dir, f"{name}_64.pth"),
        "--hidden_size",
        "64",
        "--num_hidden_layers",
        "2",
        "--batch_size",
        "2",
        "--num_generations",
        "3",
        "--max_gen_len",
        "8",
    ]
    results = {}
    for i, (variant, flags) in enumerate(VARIANTS["grpo"][:2]):
        seconds, loss, wall = run_training("grpo", tiny + flags, 2, str(tmp_path / str(i)), 600)
        assert len(seconds) == 1 and seconds[0] > 0 and wall > seconds[0]
        results[variant] = [(seconds[0], loss)]
    losses = [runs[0][1] for runs in results.values()]
    assert min(abs(loss) for loss in losses) > 1e-3, results  # a loss that is not 0, so agreeing means something
    assert max(losses) - min(losses) <= 1e-5, results
    table = format_table("grpo", results).splitlines()
    assert len(table) == 2 + 2
    expected_ratio = results[VARIANTS["grpo"][1][0]][0][0] / results[VARIANTS["grpo"][0][0]][0][0]
    assert table[3].split("|")[4].strip() == f"{expected_ratio:.2f}"  # --shared_prefix 0 against the defaults


def test_combine_runs_takes_the_median_of_the_run_medians():
    from scripts.bench.bench import combine_runs

    runs = [
        {
            "step_s_median": s,
            "step_s_min": s - 0.1,
            "step_s_max": s + 0.1,
            "phases_s": {"rollout": r},
            "rollout_tokens_per_s": t,
            "mfu": None,
            "peak_rss_mib": m,
            "cpu_s_median": c,
        }
        for s, r, t, m, c in ((2.0, 1.0, 10.0, 500.0, 0.5), (1.0, 0.4, 30.0, 700.0, 0.3), (4.0, 2.0, 20.0, 600.0, 0.9))
    ]
    combined = combine_runs(runs)
    assert (combined["step_s_median"], combined["step_s_min"], combined["step_s_max"]) == (2.0, 1.0, 4.0)
    assert combined["phases_s"] == {"rollout": 1.0} and combined["rollout_tokens_per_s"] == 20.0
    assert combined["cpu_s_median"] == 0.5
    untraced = combine_runs([dict(run, phases_s=None) for run in runs])
    assert untraced["phases_s"] is None and untraced["step_s_median"] == 2.0
    assert combined["mfu"] is None and combined["peak_rss_mib"] == 700.0
    assert combined["runs"] == 3 and combined["run_medians"] == [2.0, 1.0, 4.0]
    assert combine_runs(runs[:1]) is runs[0]
    assert combine_runs([runs[0], {"error": "timed out after 5 s"}]) == {"error": "timed out after 5 s"}


def test_ratio_pairs_the_runs():
    from scripts.bench.bench import ratio

    ours = {"step_s_median": 2.0, "run_medians": [1.0, 2.0, 4.0]}
    theirs = {"step_s_median": 4.0, "run_medians": [4.0, 2.0, 5.0]}
    assert ratio(ours, theirs, "step_s_median") == "0.80 (0.25-1.00)"  # pairs 0.25, 1.00, 0.80
    assert ratio({"step_s_median": 1.0}, {"step_s_median": 4.0}, "step_s_median") == "0.25"
    assert ratio(ours, None, "step_s_median") == "-"
    ours["rollout_tokens_per_s"], theirs["rollout_tokens_per_s"] = 10.0, 5.0
    assert ratio(ours, theirs, "rollout_tokens_per_s") == "1.25 (1.00-4.00)"  # theirs' time / ours: 4, 1, 1.25


def test_profile_run_times_a_short_run_phase_by_phase(tiny_weights, small_data, tmp_path):
    """scripts/bench/profile_run.py on 3 steps of a tiny run: the steps, rows and decode steps the flags ask for, every
    step phase seen, the phases of a step within its time, the evaluations and saves of the run found."""
    from scripts.bench.profile_run import main

    save_dir, name = tiny_weights
    out = tmp_path / "profile.json"
    main(
        [
            "--script",
            "grpo",
            "--json",
            str(out),
            "--",
            "--from_weight",
            os.path.join(save_dir, f"{name}_64.pth"),
            "--hidden_size",
            "64",
            "--num_hidden_layers",
            "2",
            "--max_steps",
            "3",
            "--batch_size",
            "2",
            "--num_generations",
            "2",
            "--max_gen_len",
            "8",
            "--reward_model_path",
            "none",
            "--data_path",
            small_data,
            "--eval_data_path",
            small_data,
            "--eval_interval",
            "2",
            "--eval_num_prompts",
            "4",
            "--run_dir",
            str(tmp_path / "run"),
        ]
    )
    result = json.loads(out.read_text())
    assert result["steps"] == 3
    assert result["decode"]["rows"] == 4 and result["decode"]["decode_steps"] == 8  # random weights: no EOS in 8
    assert result["decode"]["operator_calls_per_decode_step"] > 50
    for phase in (
        "rollout decode",
        "reward (rule + reward model)",
        "reference and old log-probs",
        "policy forward",
        "policy_backward",
        "optimizer",
        "logging",
    ):
        assert result["per_step"][phase] > 0, phase
    assert result["per_step"]["other"] >= 0  # the watched phases fit inside the steps' time
    assert result["command"]["evaluations"] > 0 and result["command"]["saves"] > 0  # steps 0, 2, 3; saved at 3
    loop_clock = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [row["step"] for row in loop_clock if "elapsed_s" in row] == [1, 2, 3]
