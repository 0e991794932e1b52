"""Code comments cite design facts, not dated log entries: docs/BENCHMARKS.md states today's
figures and its history is git's, so a citation of a dated section (the page's name, then a day)
points at nothing.
A citation may name the page, or one of its sections by its heading."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("jaxbatch", "cpu_kernels", "pallas_kernels")
SUFFIXES = (".py", ".cc", ".h")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
QUOTED = re.compile(r'^\s*[,(]?\s*"([^"]+)"')     # right after the name: BENCHMARKS.md, "Section"
WINDOW = 160        # characters after the citation that belong to it (a comment runs on)
# The synthetic sources' day, put together here so that this file cites no dated entry itself.
DAY = "-".join(("2026", "12", "05"))


def headings(page: str) -> set[str]:
    return {line.lstrip("#").strip() for line in page.splitlines() if line.startswith("#")}


def offenders(root: Path = ROOT) -> list[str]:
    """`path:line: text` of each BENCHMARKS.md citation carrying a date, or naming a section the
    page does not have."""
    sections = headings((root / "docs" / "BENCHMARKS.md").read_text())
    found = []
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES:
                continue
            text = path.read_text()
            for match in re.finditer(r"BENCHMARKS(\.md)?", text):
                after = text[match.end():match.end() + WINDOW]
                # Only the comment's own words: comment markers and line breaks drop out.
                after = re.sub(r"\n\s*(#|//|\*)?", " ", after)
                quoted = QUOTED.match(after)
                dated = DATE.search(after.split(")")[0])
                if dated or (quoted and not any(quoted.group(1) in s for s in sections)):
                    line = text.count("\n", 0, match.start()) + 1
                    found.append(f"{path.relative_to(root)}:{line}: "
                                 f"{text.splitlines()[line - 1].strip()}")
    return found


def test_no_source_cites_a_dated_log_entry():
    found = offenders()
    assert not found, ("cite the design fact, not a dated BENCHMARKS.md entry:\n"
                       + "\n".join(found))


def test_the_check_finds_a_dated_citation_and_a_missing_section(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "BENCHMARKS.md").write_text("# Benchmarks\n\n## Prefix caching\n")
    (tmp_path / "jaxbatch").mkdir()
    (tmp_path / "jaxbatch" / "a.py").write_text(
        f"x = 1  # slower (docs/BENCHMARKS.md, {DAY}\n"
        "# morning)\n"
        "y = 2  # measured (BENCHMARKS.md, \"Prefix caching\")\n"
        "z = 3  # measured (BENCHMARKS.md, \"Late evening of a day\")\n"
        "w = 4  # figures in docs/BENCHMARKS.md\n")
    (tmp_path / "cpu_kernels").mkdir()
    (tmp_path / "cpu_kernels" / "k.cc").write_text(
        f"// slower (docs/BENCHMARKS.md,\n// {DAY} late morning).\n")
    (tmp_path / "pallas_kernels").mkdir()
    assert sorted(o.split(": ")[0] for o in offenders(tmp_path)) == [
        "cpu_kernels/k.cc:1", "jaxbatch/a.py:1", "jaxbatch/a.py:4"]


MAX_LINES = 400         # issue 55: today's figures, not a log
COMMAND = re.compile(r"jaxbatch bench \w|python -m benchmarks \w|bash scripts/|lm_eval ")


def undocumented_tables(page: str) -> list[str]:
    """The headings of sections (### within ##) that hold a table but name no date or no
    command reproducing it. The machine may be the page's default ("## Machine")."""
    missing = []
    for section in re.split(r"(?m)^(?=##+ )", page):
        if not re.search(r"(?m)^\|---", section):
            continue
        words = " ".join(section.split())
        if not (DATE.search(words) and COMMAND.search(words)):
            missing.append(section.splitlines()[0])
    return missing


def test_the_benchmarks_page_states_todays_figures_with_date_and_command():
    page = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert len(page.splitlines()) <= MAX_LINES
    assert "## Machine" in page
    assert not undocumented_tables(page)


def test_the_page_check_finds_a_table_without_its_command():
    page = ("## Machine\n\n## Good\n\n2026-12-07, `jaxbatch bench roofline --rows 16`\n\n"
            "| a |\n|---|\n| 1 |\n\n## Bad\n\n2026-12-07, by hand\n\n| a |\n|---|\n| 1 |\n")
    assert undocumented_tables(page) == ["## Bad"]
