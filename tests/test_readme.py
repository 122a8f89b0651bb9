"""The README's chapter map names functions that exist where it says, and they cite their section."""
import importlib
import os
import re

from conftest import ROOT

ROW = re.compile(r"^\|\s*(8\.\d(?:\.\d)?)\s*\|\s*`([^`]+\.py)`\s*\|\s*`([A-Za-z_][A-Za-z0-9_.]*)`\s*\|")


def chapter_map_rows():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return [m.groups() for m in map(ROW.match, f) if m]


def test_chapter_map_covers_sections():
    sections = {section for section, _, _ in chapter_map_rows()}
    for expected in ["8.1", "8.2", "8.3", "8.5.1", "8.5.2", "8.6"]:
        assert expected in sections


def test_chapter_map_functions_exist():
    rows = chapter_map_rows()
    assert len(rows) >= 10
    for section, path, name in rows:
        assert os.path.isfile(os.path.join(ROOT, path)), path
        module = importlib.import_module(path[:-3].replace("/", "."))
        obj = module
        for part in name.split("."):
            assert hasattr(obj, part), f"README maps {section} to {path}:{name}, which does not exist"
            obj = getattr(obj, part)


def test_readme_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert "pip install -r requirements.txt && python trainer/train_grpo.py" in text
    assert "pip install -r requirements.txt && python -m pytest -q tests" in text
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert "pytest -q tests" in f.read()


def test_mapped_functions_cite_their_section():
    for section, path, name in chapter_map_rows():
        obj = importlib.import_module(path[:-3].replace("/", "."))
        for part in name.split("."):
            obj = getattr(obj, part)
        chapter = ".".join(section.split(".")[:2])  # 8.5.1 -> 8.5
        assert chapter in (obj.__doc__ or ""), f"{path}:{name} docstring does not cite {chapter}"
