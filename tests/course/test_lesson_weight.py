"""How much of a lesson is machinery: the targets of issue 34, counted over ``course/NN_*.py``.

Counted as the issue counts: non-blank, non-comment lines of code cells; "the student writes" is
what stands between ``# BEGIN SOLUTION`` and ``# END SOLUTION``, "the rest" everything else.
And how much a student reads (issue 41): the words of the markdown cells, split on whitespace once
each line's leading ``#`` is dropped, at most 20,000 over the course and 350 in a cell.
``python tests/course/test_lesson_weight.py`` prints the table.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LESSONS = sorted((ROOT / "course").glob("[0-9][0-9]_*.py"))
TOTAL, PER_LESSON, PER_CELL = 1000, 150, 25  # the rest in all, in a lesson, in a cell without one
WORDS, CELL_WORDS = 20_000, 350  # markdown words over the course, in one markdown cell
DIRECTIVE = re.compile(r"#\s*(fmt:|noqa)")
# The lessons rewritten around the lab library so far (issue 34); the rest are other helpers' work
# in progress. Once all are here, the total is asserted too.
DONE = {"00", "01", "02", "03", "04", "05", "06", "07", "08", "09"}


def weigh(path: Path) -> dict:
    """student / rest / longest cell without an exercise / tooling directives, for one lesson."""
    cells, cell = [], None
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            cell = {"code": "[markdown]" not in line, "lines": []}
            cells.append(cell)
        elif cell is not None:
            cell["lines"].append(line)
    student = rest = longest = directives = 0
    for c in filter(lambda c: c["code"], cells):
        inside, mine, others = False, 0, 0
        for line in c["lines"]:
            s = line.strip()
            directives += bool(DIRECTIVE.search(line))
            if s == "# BEGIN SOLUTION":
                inside = True
            elif s == "# END SOLUTION":
                inside = False
            elif s and not s.startswith("#"):
                mine += inside
                others += not inside
        student, rest = student + mine, rest + others
        if not any(line.strip() == "# BEGIN SOLUTION" for line in c["lines"]):
            longest = max(longest, others)
    return dict(student=student, rest=rest, longest=longest, directives=directives)


def markdown_cells(path: Path) -> list[tuple[int, int]]:
    """(line of the header, words) of every markdown cell of a lesson source."""
    cells = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("# %%"):
            cells.append([n, 0 if "[markdown]" in line else None])
        elif cells and cells[-1][1] is not None:
            cells[-1][1] += len(line.removeprefix("#").split())
    return [(n, w) for n, w in cells if w is not None]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_no_markdown_cell_is_over_350_words(path: Path):
    over = [f"line {n}: {w} words" for n, w in markdown_cells(path) if w > CELL_WORDS]
    assert not over, f"{path.name}: markdown cells over {CELL_WORDS} words: {over}"


def test_the_course_is_at_most_20000_words():
    words = sum(w for p in LESSONS for _, w in markdown_cells(p))
    assert words <= WORDS, f"{words} words of markdown over course/ (at most {WORDS})"


def test_markdown_cells_count_words_not_marks(tmp_path: Path):
    src = tmp_path / "00_x.py"
    src.write_text("# %% [markdown]\n# # Title\n#\n# two words\n\n# %%\nx = 1  # not counted\n")
    assert markdown_cells(src) == [(1, 4)]  # "#", "Title", "two", "words": the comment marks go


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_rewritten_lesson_is_mostly_its_lesson(path: Path):
    if path.stem[:2] not in DONE:
        pytest.skip(f"{path.stem} is not rewritten around the lab library yet (issue 34)")
    w = weigh(path)
    assert w["rest"] <= PER_LESSON, f"{path.name}: {w['rest']} lines outside its exercises"
    assert w["longest"] <= PER_CELL, f"{path.name}: a cell without an exercise of {w['longest']}"
    assert w["directives"] == 0, f"{path.name}: {w['directives']} '# fmt:' / '# noqa' directives"


def test_the_course_in_all():
    if len(DONE) < len(LESSONS):
        pytest.skip(f"lessons not yet rewritten: {len(LESSONS) - len(DONE)}")
    rest = sum(weigh(p)["rest"] for p in LESSONS)
    assert rest <= TOTAL, f"{rest} lines outside the exercises over course/ (at most {TOTAL})"


def test_weigh_counts_code_not_comments(tmp_path: Path):
    src = tmp_path / "00_x.py"
    src.write_text(
        "# %% [markdown]\n# text\n\n# %%\nimport x  # noqa: F401\n\n# comment\n"
        "def f():\n    # BEGIN SOLUTION\n    # TODO: y\n    return 1\n    # END SOLUTION\n"
        "# %%\na = 1\nb = 2\n"
    )
    assert weigh(src) == dict(student=1, rest=4, longest=2, directives=1)


if __name__ == "__main__":
    total = 0
    print(f"{'lesson':<24}{'student':>8}{'rest':>6}{'longest':>8}{'fmt/noqa':>9}")
    for p in LESSONS:
        w = weigh(p)
        total += w["rest"]
        print(f"{p.stem:<24}{w['student']:>8}{w['rest']:>6}{w['longest']:>8}{w['directives']:>9}")
    words = {p.stem: markdown_cells(p) for p in LESSONS}
    for stem, cells in words.items():
        counts = [w for _, w in cells]
        print(f"{stem:<24}{sum(counts):>6} words, largest cell {max(counts)}")
    in_all = sum(w for c in words.values() for _, w in c)
    print(f"markdown words in all: {in_all} (at most {WORDS})")
    print(
        f"{'all':<24}{'':>8}{total:>6}   (targets: {TOTAL} in all, {PER_LESSON} a lesson, "
        f"{PER_CELL} a cell)"
    )
