"""How the code is put together: scripts do not import scripts, flags mean one thing, booleans take 0/1."""

import ast
import glob
import os

import pytest
import torch

from conftest import ROOT

SCRIPT_DIRS = ("trainer", "scripts")


def entry_scripts():
    """Files run as `python DIR/NAME.py`: the train_*.py of trainer/ and every .py under scripts/ (the SGLang
    server's package excepted)."""
    paths = [
        os.path.join("trainer", n)
        for n in os.listdir(os.path.join(ROOT, "trainer"))
        if n.startswith("train_") and n.endswith(".py")
    ]
    for folder, _, names in os.walk(os.path.join(ROOT, "scripts")):
        relative = os.path.relpath(folder, ROOT)
        if relative.startswith(os.path.join("scripts", "sglang_cpu")):
            continue
        paths += [os.path.join(relative, n) for n in names if n.endswith(".py") and n != "__init__.py"]
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
    # scripts/walkthrough.py, scripts/bench/bench.py and scripts/bench/lora_memory.py exist to run the training
    # code's own step functions (lora_memory: the scripts' losses; memory.py: their main for one step; fsdp_memory.py:
    # train_grpo's main for two steps under torchrun);
    # scripts/bench/bench_process.py and bench_levers.py take their workloads and machine checks from bench.py,
    # scripts/bench/profile_run.py its tracer
    allowed = {
        "scripts/walkthrough.py",
        "scripts/bench/bench.py",
        "scripts/bench/bench_process.py",
        "scripts/bench/bench_levers.py",
        "scripts/bench/profile_run.py",
        "scripts/bench/lora_memory.py",
        "scripts/bench/memory.py",
        "scripts/bench/fsdp_memory.py",
    }
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
    from trainer.infra.dtypes import autocast_context, resolve_train_dtype

    assert resolve_train_dtype("auto", "cpu") == "float32"
    assert resolve_train_dtype("bfloat16", "cpu") == "bfloat16"
    assert resolve_train_dtype("float32", "cuda:0") == "float32"
    with autocast_context("cpu", "auto"):  # float32: no autocast, a matmul stays fp32
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with autocast_context("cpu", "bfloat16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "device, message",
    [
        ("mps", "the scripts run on cpu or cuda"),
        ("tpu:0", "is not a device"),
        ("gpu", "is not a device"),
    ],
)
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


def test_reward_model_dtype_is_half_on_a_gpu_and_float32_on_the_cpu():
    # upstream MiniMind loads its reward model in half precision (3.6 GB instead of 7.2 GB for a 1.8B model)
    from trainer.infra.dtypes import reward_model_dtype

    assert reward_model_dtype("", "cpu") == torch.float32
    assert reward_model_dtype("", "cuda:1") == torch.float16  # upstream's LMForRewardModel default
    assert reward_model_dtype("bfloat16", "cpu") == torch.bfloat16  # --reward_dtype wins


def test_device_flag_picks_the_device():
    from trainer.infra.distributed import init_distributed_mode

    assert init_distributed_mode("cpu") == (0, "cpu")
    assert init_distributed_mode("") == (0, "cuda:0" if torch.cuda.is_available() else "cpu")


def test_use_compile_wraps_the_same_parameters_and_0_leaves_the_module():
    # compiling is lazy (the first call compiles, ~1-3 min on a 2-core CPU), so this builds the wrapper only
    from trainer.infra.distributed import unwrap_model
    from trainer.infra.distributed import compile_for_training

    model = torch.nn.Linear(3, 2)
    assert compile_for_training(model, 0) is model
    compiled = compile_for_training(model, 1)
    assert compiled is not model and unwrap_model(compiled) is model
    assert [id(p) for p in compiled.parameters()] == [id(p) for p in model.parameters()]


# ----------------------------------------------------------------------------- where the chapter's code lives
INFRASTRUCTURE = sorted(
    n[:-3] for n in os.listdir(os.path.join(ROOT, "trainer", "infra")) if n.endswith(".py") and n != "__init__.py"
)


def parse(path):
    return ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())


def top_level_functions(tree):
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_an_update_step_clips_and_steps_only_when_every_value_is_finite():
    """The one update of the RL loops (``OptimizerStep.clip_and_step``) skips the step on a NaN gradient or a NaN
    checked value and applies it otherwise: the weights and the schedule move exactly when everything is finite."""
    from trainer.infra.optimizer import OptimizerStep, build_cosine_scheduler

    for bad in (None, "gradient", "loss"):
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        scheduler = build_cosine_scheduler(optimizer, 10)
        update = OptimizerStep(
            [model], [optimizer], 1.0, "cpu", accumulation_steps=1, total_steps=10, schedulers=[scheduler]
        )
        before = model.weight.detach().clone()
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        if bad == "gradient":
            model.weight.grad[0, 0] = float("nan")
        result = update.clip_and_step(1, loss=float("nan") if bad == "loss" else loss)
        assert result["skipped_update"] == float(bad is not None)
        assert torch.equal(model.weight.detach(), before) is (bad is not None)
        assert scheduler.last_epoch == (0 if bad else 1)
        assert model.weight.grad is None  # cleared either way
    scheduler = build_cosine_scheduler(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0), 10, start_step=5)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)  # 0.1 + 0.45 * (1 + cos(pi / 2))


@pytest.mark.parametrize("module", INFRASTRUCTURE)
def test_infrastructure_modules_import_no_chapter_code(module):
    """The infrastructure a learner may skip sits below the chapter's code: of trainer/ it imports only other
    infrastructure (so following a step never leads from the infrastructure back into the algorithm)."""
    imported = {name for name in imported_modules(f"trainer/infra/{module}.py") if name.startswith("trainer")}
    allowed = {f"trainer.infra.{other}" for other in INFRASTRUCTURE} | {"trainer.infra"}
    offenders = {name for name in imported if name not in allowed and name.rsplit(".", 1)[0] not in allowed}
    assert offenders == set()


def test_the_top_of_trainer_shows_the_scripts_and_the_modules_of_the_readme_tour():
    """trainer/'s top level is what teaches: the training scripts and the modules the README's tour names, each with
    its line; the agent's rollout, tools and rewards, the exact speed-ups and the infrastructure sit in folders."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    names = os.listdir(os.path.join(ROOT, "trainer"))
    modules = sorted(n for n in names if n.endswith(".py") and not n.startswith("train_") and n != "__init__.py")
    assert [m for m in modules if f"trainer/{m}" not in readme] == []
    folders = {n for n in names if os.path.isdir(os.path.join(ROOT, "trainer", n)) and n != "__pycache__"}
    assert folders == {"agent", "infra", "speed"}
    assert {"rollout.py", "tools.py", "rewards.py"} <= set(os.listdir(os.path.join(ROOT, "trainer", "agent")))


def test_the_top_of_scripts_holds_the_user_tools_of_the_readme_tour():
    """scripts/'s top level holds what a user runs, each named in the README's tour of the files; the benchmarks,
    the developer tools and one investigation's probes sit in folders whose README has a line for each file."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    tour = readme.split("\n## Tour\n", 1)[1].split("\n## ", 1)[0]
    names = sorted(os.listdir(os.path.join(ROOT, "scripts")))
    tools = [n for n in names if os.path.isfile(os.path.join(ROOT, "scripts", n))]
    assert {"make_demo_data.py", "eval_policy.py", "eval_toolcall.py", "check_gpu.py"} <= set(tools)
    assert [n for n in tools if os.path.splitext(n)[0] not in tour] == []
    folders = [n for n in names if os.path.isdir(os.path.join(ROOT, "scripts", n)) and n != "__pycache__"]
    assert set(folders) == {"bench", "dev", "agent_copy_study", "sglang_cpu"}
    for folder in ("bench", "dev", "agent_copy_study"):
        described = open(os.path.join(ROOT, "scripts", folder, "README.md"), encoding="utf-8").read()
        files = [n for n in os.listdir(os.path.join(ROOT, "scripts", folder)) if n.endswith(".py")]
        files += (
            [f"results/{n}" for n in os.listdir(os.path.join(ROOT, "scripts", folder, "results"))]
            if folder == "bench"
            else []
        )
        assert files and [n for n in files if f"`{n}`" not in described] == [], folder
        assert f"scripts/{folder}/" in readme, folder


def test_the_top_of_tests_holds_the_test_files_only():
    """tests/'s top level holds the test files and conftest.py; helper modules, workers and recorded references
    sit in tests/support/, third-party files in tests/fixtures/, the benchmarks' tests in tests/bench/."""
    names = [n for n in os.listdir(os.path.join(ROOT, "tests")) if n != "__pycache__"]
    files = [n for n in names if os.path.isfile(os.path.join(ROOT, "tests", n))]
    assert [n for n in files if not (n.startswith("test_") and n.endswith(".py")) and n != "conftest.py"] == []
    assert sorted(set(names) - set(files)) == ["bench", "fixtures", "support"]


def names_bound_in(function):
    """Names a function binds itself: its parameters, assignment and loop targets."""
    names = {arg.arg for arg in function.args.args}
    for node in ast.walk(function):
        if isinstance(node, (ast.Assign, ast.For, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


@pytest.mark.parametrize(
    "script, step_functions",
    [("train_grpo", {"grpo_rollout", "grpo_policy_loss"}), ("train_ppo", {"ppo_rollout", "ppo_update"})],
)
def test_main_makes_every_object_its_step_uses(script, step_functions):
    """Each argument of the step functions called in main's loop is a plain name that main itself binds (or the
    script's own ``args``): a reader finds where every object of the step is made by reading main, never as an
    attribute of a harness object."""
    main = top_level_functions(parse(f"trainer/{script}.py"))["main"]
    bound = names_bound_in(main)
    calls = [node for node in ast.walk(main) if isinstance(node, ast.Call) and ast.unparse(node.func) in step_functions]
    assert {ast.unparse(call.func) for call in calls} == step_functions
    for call in calls:
        arguments = list(call.args) + [keyword.value for keyword in call.keywords]
        not_plain = [ast.unparse(a) for a in arguments if not isinstance(a, ast.Name) or a.id not in bound]
        assert not_plain == [], (ast.unparse(call.func), not_plain)


def step_calls(script_path):
    """Names called by the script's step functions (``grpo_rollout``, ``grpo_policy_loss``; ``ppo_rollout``,
    ``ppo_update``) and, transitively,
    every function of the script they call. Returns (called names, {imported name: module})."""
    tree = parse(script_path)
    functions = top_level_functions(tree)
    imported = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    pending = [
        functions[name]
        for name in ("grpo_rollout", "grpo_policy_loss", "ppo_rollout", "ppo_update")
        if name in functions
    ]
    seen, called = set(), set()
    while pending:
        for node in ast.walk(pending.pop()):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                called.add(name)
                if name in functions and name not in seen:
                    seen.add(name)
                    pending.append(functions[name])
    return called, imported


@pytest.mark.parametrize("script", ["train_grpo", "train_ppo"])
def test_the_rl_step_reaches_the_chapter_modules_only(script):
    """A reader following the RL step itself (rollout, rewards, advantages, losses, the update) meets the script and
    the chapter's shared modules only (rollout engine, trainer_utils, the model), what comes after the chapter beside
    them (the GRPO family, the advantage estimators, the shared-prefix and chunked forwards, the micro-batches), the
    optimizer's helpers and the rank
    helpers; the bookkeeping (checkpoints, metrics, stop requests) is called from main's loop, in view."""
    called, imported = step_calls(f"trainer/{script}.py")
    modules = {imported[name.split(".")[0]] for name in called if name.split(".")[0] in imported}
    project_modules = {module for module in modules if module.split(".")[0] in ("trainer", "model", "dataset")}
    assert project_modules <= {
        "trainer.rollout_engine",
        "trainer.trainer_utils",
        "model.model_minimind",
        "trainer.grpo_family",
        "trainer.advantage_estimators",
        "trainer.speed.shared_prefix",
        "trainer.speed.chunked_logps",
        "trainer.speed.micro_batches",
        "trainer.infra.optimizer",
        "trainer.infra.distributed",
    }, project_modules


def project_imports(path):
    """The project modules (model., dataset., trainer.) a file imports, at its top or inside a function."""
    return {name for name in imported_modules(path) if name.split(".")[0] in ("model", "dataset", "trainer")}


def test_dataset_imports_nothing_from_trainer():
    """The data layer sits below the training code: dataset/ imports model/ or dataset/ only."""
    offenders = {
        path: sorted(n for n in project_imports(f"dataset/{path}") if n.startswith("trainer"))
        for path in os.listdir(os.path.join(ROOT, "dataset"))
        if path.endswith(".py")
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_project_import_graph_has_no_cycle():
    """No two modules of the project import each other, directly or through others, at their top or inside a
    function (an import hidden in a function is still an arrow of the graph)."""
    files = [
        os.path.relpath(p, ROOT)
        for folder in ("model", "dataset", "trainer")
        for p in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)
    ]
    module_of = {path: path[:-3].replace(os.sep, ".").removesuffix(".__init__") for path in files}
    modules = set(module_of.values())
    graph = {
        module_of[path]: {name if name in modules else name.rsplit(".", 1)[0] for name in project_imports(path)}
        & modules - {module_of[path]}
        for path in files
    }
    state, cycles = {}, []

    def visit(module, stack):
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                cycles.append(stack[stack.index(other) :] + [other])
            elif other not in state:
                visit(other, stack + [other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_three_rl_loops_call_one_update():
    """Clipping and stepping live in one place, ``OptimizerStep`` (infra/optimizer.py), which GRPO's, the agent's and
    PPO's loops call after their backward; what goes beyond the chapter (the token-sum window, the final norm's
    projection, the non-finite checks) enters through its arguments, not as lines of the scripts."""
    not_rl = {"train_full_sft.py", "train_reward.py", "train_tokenizer.py"}  # supervised trainers
    callers = [
        os.path.relpath(path, ROOT)
        for path in glob.glob(os.path.join(ROOT, "trainer", "**", "*.py"), recursive=True)
        if os.path.basename(path) not in not_rl and "clip_grad_norm_" in open(path, encoding="utf-8").read()
    ]
    assert callers == [os.path.join("trainer", "infra", "optimizer.py")]
    for script in ("train_grpo", "train_ppo", "train_agent"):
        source = open(os.path.join(ROOT, "trainer", f"{script}.py"), encoding="utf-8").read()
        assert "optimizer_step.clip_and_step(" in source, script
        for name in (
            "scale_gradients",
            "project_scale_only_gradients",
            "nonfinite_parts",
            "window_num_items",
            "clip_grad_norm_",
        ):
            assert name not in source, (script, name)
