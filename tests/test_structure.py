"""How the code is put together: scripts do not import scripts, flags mean one thing, booleans take 0/1."""
import ast
import os

import pytest

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
    # scripts/walkthrough.py and scripts/bench.py exist to run the training code's own step functions
    allowed = {"scripts/walkthrough.py", "scripts/bench.py"}
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
    with pytest.raises(SystemExit):  # PPO's unit is the minibatch: the GRPO flag (steps) is not accepted there
        ppo_parse_args(["--accumulation_steps", "2"])
