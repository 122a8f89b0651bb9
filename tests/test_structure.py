"""How the code is put together: scripts do not import scripts, flags mean one thing, booleans take 0/1."""
import ast
import os

import pytest
import torch

from conftest import ROOT

SCRIPT_DIRS = ("trainer", "scripts")


def entry_scripts():
    """Files run as `python DIR/NAME.py`: the train_*.py of trainer/ and everything in scripts/."""
    paths = [os.path.join("trainer", n) for n in os.listdir(os.path.join(ROOT, "trainer"))
             if n.startswith("train_") and n.endswith(".py")]
    paths += [os.path.join("scripts", n) for n in os.listdir(os.path.join(ROOT, "scripts")) if n.endswith(".py")]
    return sorted(paths)


def imported_modules(path):
    """Dotted names of every module imported by the file, at any depth (``from a import b`` gives a and a.b)."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_script_imports_another_script():
    scripts = {p[:-3].replace(os.sep, ".") for p in entry_scripts()}
    assert "trainer.train_grpo" in scripts and "trainer.train_ppo" in scripts
    offenders = {p: sorted(imported_modules(p) & scripts) for p in entry_scripts()}
    offenders = {p: names for p, names in offenders.items() if names}
    # scripts/walkthrough.py and scripts/bench.py exist to run the training code's own step functions;
    # scripts/bench_process.py times the same work as scripts/bench.py and takes its workloads from there
    allowed = {"scripts/walkthrough.py", "scripts/bench.py", "scripts/bench_process.py"}
    assert {p: n for p, n in offenders.items() if p not in allowed} == {}


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_yes_no_flags_take_0_1_and_a_bare_flag_means_1(script):
    import importlib
    parse_args = importlib.import_module(f"trainer.train_{script}").parse_args
    defaults = parse_args([])
    assert (defaults.use_wandb, defaults.debug_mode, defaults.from_resume, defaults.use_moe) == (0, 0, 0, 0)
    bare = parse_args(["--use_wandb", "--debug_mode", "--trust_remote_code", "--max_steps", "3"])
    assert (bare.use_wandb, bare.debug_mode, bare.trust_remote_code, bare.max_steps) == (1, 1, 1, 3)
    explicit = parse_args(["--use_wandb", "0", "--from_resume", "1"])
    assert (explicit.use_wandb, explicit.from_resume) == (0, 1)
    with pytest.raises(SystemExit):
        parse_args(["--from_resume", "2"])


def test_accumulation_flags_have_one_meaning_each():
    from trainer.train_grpo import parse_args as grpo_parse_args
    from trainer.train_ppo import parse_args as ppo_parse_args
    assert grpo_parse_args(["--accumulation_steps", "2"]).accumulation_steps == 2
    assert ppo_parse_args(["--minibatch_accumulation_steps", "3"]).minibatch_accumulation_steps == 3
    # upstream MiniMind's train_ppo.py counts its --accumulation_steps in minibatches: the same meaning, so the
    # name is accepted there and sets PPO's flag (GRPO's --accumulation_steps counts steps)
    assert ppo_parse_args(["--accumulation_steps", "2"]).minibatch_accumulation_steps == 2


def test_dtype_auto_is_float32_on_the_cpu_and_explicit_names_stay():
    from trainer.dtypes import autocast_context, resolve_train_dtype
    assert resolve_train_dtype("auto", "cpu") == "float32"
    assert resolve_train_dtype("bfloat16", "cpu") == "bfloat16"
    assert resolve_train_dtype("float32", "cuda:0") == "float32"
    with autocast_context("cpu", "auto"):  # float32: no autocast, a matmul stays fp32
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with autocast_context("cpu", "bfloat16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize("device, message", [
    ("mps", "the scripts run on cpu or cuda"),
    ("tpu:0", "is not a device"),
    ("gpu", "is not a device"),
])
def test_bad_device_is_an_error_that_names_the_flag(device, message, capsys):
    from trainer.train_grpo import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--device", device])
    err = capsys.readouterr().err
    assert f"--device {device!r}" in err and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_device_without_a_gpu_is_refused(capsys):
    from trainer.train_ppo import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--device", "cuda:1"])
    assert "this machine has no CUDA GPU" in capsys.readouterr().err


def test_reward_model_dtype_is_half_on_a_gpu_and_the_policys_on_the_cpu():
    # upstream MiniMind loads its reward model in half precision (3.6 GB instead of 7.2 GB for a 1.8B model)
    from trainer.dtypes import reward_model_dtype
    assert reward_model_dtype("cpu", torch.float32) == torch.float32
    assert reward_model_dtype("cuda:1", torch.float32) == torch.float16  # upstream's LMForRewardModel default


def test_device_flag_picks_the_device():
    from trainer.distributed import init_distributed_mode
    assert init_distributed_mode("cpu") == (0, "cpu")
    assert init_distributed_mode("") == (0, "cuda:0" if torch.cuda.is_available() else "cpu")


def test_use_compile_wraps_the_same_parameters_and_0_leaves_the_module():
    # compiling is lazy (the first call compiles, ~1-3 min on a 2-core CPU), so this builds the wrapper only
    from trainer.checkpoints import unwrap_model
    from trainer.distributed import compile_for_training
    model = torch.nn.Linear(3, 2)
    assert compile_for_training(model, 0) is model
    compiled = compile_for_training(model, 1)
    assert compiled is not model and unwrap_model(compiled) is model
    assert [id(p) for p in compiled.parameters()] == [id(p) for p in model.parameters()]


# ----------------------------------------------------------------------------- where the chapter's code lives
TRAINER_CHAPTER_MODULES = {"trainer.train_grpo", "trainer.train_ppo", "trainer.trainer_utils", "trainer.rollout_engine",
                           "trainer.evaluation"}
LOWER_INFRASTRUCTURE = ("distributed", "dtypes", "checkpoints", "optimizer", "metrics")


def function_calls(path, function_name):
    """Dotted names of every call inside the top-level function ``function_name`` of ``path`` (``a.b.c(...)``
    gives 'a.b.c', ``f(...)`` gives 'f')."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function_name)
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            names.add(ast.unparse(node.func))
    return names


def test_the_update_is_written_out_in_both_training_scripts():
    """Clip, optimizer.step and zero_grad are in each script's own code, not behind an infrastructure call."""
    grpo = function_calls("trainer/train_grpo.py", "main")
    assert {"torch.nn.utils.clip_grad_norm_", "optimizer.step", "scheduler.step", "optimizer.zero_grad"} <= grpo
    ppo_step = function_calls("trainer/train_ppo.py", "clip_and_step")
    assert {"torch.nn.utils.clip_grad_norm_", "optimizer.step", "optimizer.zero_grad"} <= ppo_step
    assert "clip_and_step" in function_calls("trainer/train_ppo.py", "ppo_update")


def test_the_roles_of_section_8_1_are_built_in_each_main():
    """Policy, frozen reference and reward model (PPO: and the critic) are built by main itself; the harness's
    set-up builds no model."""
    for script, roles in (("train_grpo", {"load_policy", "copy.deepcopy", "load_reward_model"}),
                          ("train_ppo", {"load_policy", "copy.deepcopy", "load_reward_model", "build_critic"})):
        assert roles <= function_calls(f"trainer/{script}.py", "main"), script
    tree = ast.parse(open(os.path.join(ROOT, "trainer", "rl_harness.py"), encoding="utf-8").read())
    harness_calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not harness_calls & {"load_policy", "init_model", "LMForRewardModel", "load_reward_model", "CriticModel"}


def test_trainer_utils_holds_the_chapter_sections_8_3_and_8_6_only():
    """Two section headers, 8.3 and 8.6, every definition under one of them, and no infrastructure imported (the
    one project import is the InternLM2 reward model of 8.3)."""
    text = open(os.path.join(ROOT, "trainer", "trainer_utils.py"), encoding="utf-8").read()
    headers = [line for line in text.splitlines() if line.startswith("# ----")]
    assert len(headers) == 2 and "chapter 8.3" in headers[0] and "chapter 8.6" in headers[1]
    first_header_line = text.splitlines().index(headers[0]) + 1
    tree = ast.parse(text)
    definitions = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign))]
    assert all(node.lineno > first_header_line for node in definitions)
    project_modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and node.module.split(".")[0] in ("trainer", "model")}
    assert project_modules == {"trainer.internlm2_reward"}  # 8.3's reward model


@pytest.mark.parametrize("module", LOWER_INFRASTRUCTURE)
def test_infrastructure_modules_import_no_chapter_code(module):
    """The infrastructure a learner may skip sits below the chapter's code: it imports only other infrastructure
    (so following a step never leads from the infrastructure back into the algorithm)."""
    imported = {name for name in imported_modules(f"trainer/{module}.py") if name.startswith("trainer.")}
    allowed = {f"trainer.{other}" for other in LOWER_INFRASTRUCTURE}
    offenders = {name for name in imported if name.rsplit(".", 1)[0] not in allowed and name not in allowed}
    assert offenders == set()
    assert not {name.rsplit(".", 1)[0] for name in imported} & TRAINER_CHAPTER_MODULES


def step_calls(script_path):
    """Names called by one step of the script's loop: the body of the ``for`` loop in ``main`` and, transitively,
    every function of the script it calls. Returns (called names, {imported name: module})."""
    tree = ast.parse(open(os.path.join(ROOT, script_path), encoding="utf-8").read())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    imported = {alias.asname or alias.name: node.module for node in tree.body
                if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    loop = next(node for node in ast.walk(functions["main"]) if isinstance(node, ast.For))
    pending, seen, called = [loop], set(), set()
    while pending:
        for node in ast.walk(pending.pop()):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                called.add(name)
                if name in functions and name not in seen and name != "main":
                    seen.add(name)
                    pending.append(functions[name])
    return called, imported


@pytest.mark.parametrize("script", ["train_grpo", "train_ppo"])
def test_one_step_stays_in_the_chapter_modules(script):
    """A reader following one step of the loop meets the script, the chapter's shared modules (rollout engine,
    trainer_utils), the optimizer and rank helpers, and the harness (``run.``) only: the dtype context is built
    once at set-up, and no step calls into dtypes, checkpoints, metrics or flags directly."""
    called, imported = step_calls(f"trainer/{script}.py")
    modules = {imported[name.split(".")[0]] for name in called if name.split(".")[0] in imported}
    project_modules = {module for module in modules if module.split(".")[0] in ("trainer", "model", "dataset")}
    assert project_modules <= {"trainer.rollout_engine", "trainer.trainer_utils", "trainer.optimizer",
                               "trainer.distributed", "trainer.rl_harness"}, project_modules
    assert "autocast_context" not in called
    harness_calls = {name for name in called if name.startswith("run.")}
    assert harness_calls <= {"run.batches", "run.print_samples_if_due", "run.guard.record", "run.log",
                             "run.save_if_due", "run.rollout_engine.update_policy"}, harness_calls
