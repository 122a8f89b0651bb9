"""The README's chapter map names functions that exist where it says, and they cite their section."""

import importlib
import os
import re

from conftest import FIXTURES, ROOT

ROW = re.compile(r"^\|\s*(8\.\d(?:\.\d)?)\s*\|\s*`([^`]+\.py)`\s*\|\s*`([A-Za-z_][A-Za-z0-9_.]*)`\s*\|")
HEADING = re.compile(r"^(8\.\d(?:\.\d)?) (\S.*)$")
# The numbered headings of the chapter "训练算法 - PPO & GRPO 强化学习", in order, kept in the repository.
SECTIONS_FILE = os.path.join(FIXTURES, "chapter_sections.txt")


def chapter_headings(lines):
    """(section, title) of every line of ``lines`` that is a numbered heading, e.g. "8.4.1 CriticModel 价值函数"."""
    return [m.groups() for m in map(HEADING.match, (line.rstrip("\n") for line in lines)) if m]


with open(SECTIONS_FILE, encoding="utf-8") as sections_file:
    CHAPTER_TITLES = chapter_headings(line for line in sections_file if not line.startswith("#"))
CHAPTER_SECTIONS = [section for section, _ in CHAPTER_TITLES]


def chapter_map_rows():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return [m.groups() for m in map(ROW.match, f) if m]


def section_key(section):
    return tuple(int(part) for part in section.split("."))


def test_chapter_map_covers_every_section_in_order():
    sections = [section for section, _, _ in chapter_map_rows()]
    missing = [s for s in CHAPTER_SECTIONS if s not in sections]
    assert not missing, f"README chapter map has no row for {missing}"
    assert set(sections) <= set(CHAPTER_SECTIONS), f"unknown sections {set(sections) - set(CHAPTER_SECTIONS)}"
    assert sections == sorted(sections, key=section_key), "chapter map rows are not in chapter order"


def test_sections_file_lists_the_chapters_sections():
    with open(SECTIONS_FILE, encoding="utf-8") as f:
        lines = [line for line in f if not line.startswith("#")]
    assert len(lines) == len(CHAPTER_TITLES), "every line that is not a # comment is a heading"
    assert CHAPTER_SECTIONS == [
        "8.1",
        "8.2",
        "8.3",
        "8.4",
        "8.4.1",
        "8.4.2",
        "8.4.3",
        "8.4.4",
        "8.5",
        "8.5.1",
        "8.5.2",
        "8.6",
        "8.7",
    ]
    assert all(title for _, title in CHAPTER_TITLES)


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
    assert (
        "pip install -r requirements-test.txt && python -m ruff check . && python -m ruff format --check . && "
        "python -m pytest -q -n 2 --dist loadfile tests"
    ) in text
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert "pip install -q -r requirements-test.txt" in ci and "ruff check ." in ci and "ruff format --check ." in ci
    assert "pytest -q -n 2 --dist loadfile tests" in ci


def test_mapped_functions_cite_their_section():
    for section, path, name in chapter_map_rows():
        obj = importlib.import_module(path[:-3].replace("/", "."))
        for part in name.split("."):
            obj = getattr(obj, part)
        # The exact section: "8.4" does not count for 8.4.2, nor "8.4.2" for 8.4 ("8.4.3-8.4.4" cites both).
        cited = re.search(rf"(?<![\d.]){re.escape(section)}(?!\.?\d)", obj.__doc__ or "")
        assert cited, f"{path}:{name} docstring does not cite section {section}"


INFRASTRUCTURE = tuple(
    f"trainer/infra/{name}"
    for name in sorted(os.listdir(os.path.join(ROOT, "trainer", "infra")))
    if name.endswith(".py") and name != "__init__.py"
)


def test_no_chapter_row_points_into_the_infrastructure():
    """A learner who skips the infrastructure modules (README, Tour) misses no section of the chapter."""
    into_infrastructure = [
        (section, path, name) for section, path, name in chapter_map_rows() if path in INFRASTRUCTURE
    ]
    assert into_infrastructure == []
    for path in INFRASTRUCTURE:
        assert os.path.isfile(os.path.join(ROOT, path)), f"{path} is listed as infrastructure but does not exist"
