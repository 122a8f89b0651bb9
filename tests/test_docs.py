"""The documents a learner reads: every relative link resolves, and the README's commands parse their flags."""

import glob
import os
import re
import shlex

import pytest

from conftest import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def documents():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


@pytest.mark.parametrize("path", documents(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_points_to_a_file(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+://", target) or target.startswith("#") or target.startswith("mailto:"):
            continue
        file_part = target.split("#", 1)[0]
        if not os.path.exists(os.path.join(os.path.dirname(path), file_part)):
            broken.append(target)
    assert not broken, f"{os.path.relpath(path, ROOT)} links to missing files: {broken}"


def readme_python_commands():
    """Every `python SCRIPT ...` / `torchrun ... SCRIPT ...` command in the README's code blocks, as
    (launcher, [script, flags...]) (line continuations joined, comments dropped)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.DOTALL)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part.split("#", 1)[0])
                scripts = [i for i, w in enumerate(words) if w.endswith(".py")]
                if words[:1] in (["python"], ["torchrun"]) and scripts:
                    commands.append((words[0], words[scripts[0] :]))
    return commands


def test_readme_commands_parse_their_flags(monkeypatch):
    import importlib

    commands = readme_python_commands()
    scripts = {command[0] for _, command in commands}
    assert {"trainer/train_grpo.py", "trainer/train_ppo.py"} <= scripts, scripts
    for launcher, (script, *flags) in commands:
        module = importlib.import_module(script[:-3].replace("/", "."))
        if not hasattr(module, "parse_args"):
            continue
        if launcher == "torchrun":  # torchrun gives each process its RANK (--fsdp 1 needs it)
            monkeypatch.setenv("RANK", "0")
        else:
            monkeypatch.delenv("RANK", raising=False)
        try:
            module.parse_args(flags)  # argparse and the range checks; exits 2 on a bad or unknown flag
        except SystemExit as stop:
            pytest.fail(f"{script} {' '.join(flags)}: rejected its flags (exit {stop.code})")


@pytest.mark.parametrize("module_name", ["trainer.train_grpo", "trainer.train_ppo"])
def test_every_training_flag_has_help(module_name, monkeypatch):
    import argparse
    import importlib

    parsers = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        return original(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    importlib.import_module(module_name).parse_args(["--reward_model_path", "none"])
    undocumented = [action.dest for action in parsers[0]._actions if not action.help]
    assert not undocumented, f"{module_name}: flags without help: {undocumented}"


FLAG_VALUE = re.compile(r"`(--[a-z_]+)` ([^\s,()`]+)")


def readme_flag_table():
    """(script, flag, documented default) of every "`--flag` value" in the README's table of the flags people change
    most: the GRPO column is train_grpo.py's, the PPO column train_ppo.py's ("the same": the GRPO column's)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## The flags people change most", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        grpo, ppo = cells[1], cells[2] if cells[2] != "the same" else cells[1]
        rows += [("train_grpo", *pair) for pair in FLAG_VALUE.findall(grpo)]
        rows += [("train_ppo", *pair) for pair in FLAG_VALUE.findall(ppo)]
    return rows


def test_the_readmes_flag_table_gives_each_scripts_defaults():
    """What the table says a flag defaults to is what the script parses with no flags (the chapter's loss settings
    resolved as the loop resolves them)."""
    import importlib

    from trainer.grpo_family import build_loss_config

    rows = readme_flag_table()
    assert len(rows) >= 30, rows
    assert ("train_ppo", "--lam", "1.0") in rows  # GAE lambda 1.0 (the chapter's 0.95 is --lam 0.95)
    defaults = {}
    for script in ("train_grpo", "train_ppo"):
        args = importlib.import_module(f"trainer.{script}").parse_args([])
        defaults[script] = vars(args)
    defaults["train_grpo"].update(
        {
            key: value
            for key, value in vars(
                build_loss_config(importlib.import_module("trainer.train_grpo").parse_args([]))
            ).items()
            if key in ("epsilon", "epsilon_high")
        }
    )
    wrong = []
    for script, flag, documented in rows:
        actual = defaults[script][flag[2:]]
        try:
            same = float(documented) == float(actual)
        except (TypeError, ValueError):
            same = str(actual) == documented or str(actual).endswith(os.sep + documented)
        if not same:
            wrong.append((script, flag, documented, actual))
    assert wrong == []
