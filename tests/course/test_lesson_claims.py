"""What a lesson's prose tells the student holds in the kit: every path it names exists, every name
it tells the student to call is bound by the lesson's import, every lesson opens alike, every
command it names is the README's, and the library gives reasons, not the kit's issue numbers."""

import ast
import builtins
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LESSONS = sorted((ROOT / "course").glob("[0-9][0-9]_*.py"))
README = ROOT / "README.md"
OTHER_REPOS = {"docs/source/api-guide/dist_optimizer.md"}  # Megatron-LM's, cited by name
PATH = re.compile(r"(?<![\w/.~-])((?:minizero|tests|docs|course)/[\w/.-]*\w)")
STAR = re.compile(r"^from (minizero\.course\.labs\.\w+) import \*", re.M)


def markdown(path: Path) -> str:
    """A lesson's markdown cells as one text, comment marks dropped, lines joined by spaces (a
    code span or a command may break across two lines)."""
    out, in_md = [], False
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            in_md = "[markdown]" in line
        elif in_md:
            out.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
    return " ".join(out)


def code(path: Path) -> str:
    """A lesson's code cells."""
    out, in_code = [], False
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            in_code = "[markdown]" not in line
        elif in_code:
            out.append(line)
    return "\n".join(out)


@pytest.mark.parametrize("page", [*LESSONS, README], ids=lambda p: p.name)
def test_every_path_a_lesson_names_exists(page: Path):
    text = page.read_text()
    missing = {p for p in PATH.findall(text) if p not in OTHER_REPOS and not (ROOT / p).exists()}
    assert not missing, f"{page.name} names paths the kit does not have: {sorted(missing)}"


def calls(text: str) -> list[tuple[str, set[str]]]:
    """The code spans of ``text`` a student can run as written: a call, no ``...`` in it; each with
    the names it reads first (``plots_budget`` of ``display(plots_budget.calculator())``)."""
    out = []
    for span in re.findall(r"`([^`]+)`", text):
        try:
            tree = ast.parse(span, mode="eval")
        except SyntaxError:
            continue
        nodes = list(ast.walk(tree))
        if not any(isinstance(n, ast.Call) for n in nodes) or any(
            isinstance(n, ast.Constant) and n.value is Ellipsis for n in nodes
        ):
            continue
        out.append((span, {n.id for n in nodes if isinstance(n, ast.Name)}))
    return out


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_name_the_markdown_calls_is_bound(path: Path):
    """A call the markdown shows (``compare.compare_stages(NPROCS)``) reads no name that the
    lesson's lab module has but its star import leaves out, unless the lesson defines it or Python
    has it (builtins, the standard library's modules, IPython's ``display``): else the student
    meets a NameError. (A placeholder, ``fn(model)``'s ``model``, is not the lab's: not held.)
    ``lab.x`` must be a name of the lab."""
    (module,) = STAR.findall(path.read_text())
    lab = importlib.import_module(module)
    bound = set(getattr(lab, "__all__", [n for n in vars(lab) if not n.startswith("_")]))
    src = code(path)
    defined = set(re.findall(r"^(?:def|class) (\w+)", src, re.M))
    for targets in re.findall(r"^([\w, ]+?) *=[^=]", src, re.M):
        defined |= {t.strip() for t in targets.split(",")}
    known = bound | defined | set(dir(builtins)) | set(sys.stdlib_module_names) | {"display"}
    unbound, not_in_lab = set(), set()
    for span, names in calls(markdown(path)):
        unbound |= {f"{n} (in `{span}`)" for n in names - known if hasattr(lab, n)}
        not_in_lab |= {a for a in re.findall(r"(?<![\w.])lab\.(\w+)", span) if not hasattr(lab, a)}
    assert not unbound, f"{path.name}: its import does not bind {sorted(unbound)}"
    assert not not_in_lab, f"{path.name}: the lab has no {sorted(not_in_lab)}"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_lesson_opens_alike(path: Path):
    src = code(path)
    assert len(STAR.findall(src)) == 1, f"{path.name}: one star import of its lab"
    opens = re.findall(r"^(.*)\bsetup\(", src, re.M)
    assert opens == ["NPROCS, INFO = "], f"{path.name}: `NPROCS, INFO = setup(...)`, not {opens}"


def test_every_command_a_lesson_names_is_the_readmes():
    readme = " ".join(README.read_text().split())
    for path in LESSONS:
        text = markdown(path)
        modules = re.findall(r"python -m minizero\.[\w.]+", text)
        assert not modules, f"{path.name} runs a module, not a command: {modules}"
        for cmd in re.findall(r"python -m minizero ((?:bench )?[a-z]+)", text):
            assert f"python -m minizero {cmd}" in readme, f"{path.name}: `{cmd}` not in README"


def test_the_grade_paragraph_is_said_once():
    """How to grade yourself and give a slow check more time: the README and lesson 00 say it;
    the other lessons name their grade command only."""
    said = [p.name for p in LESSONS if re.search(r"--check-timeout|Grade yourself", markdown(p))]
    assert said == ["00_collectives.py"], f"the grade paragraph in {said}"
    assert "--check-timeout" in README.read_text() and "Grade yourself" in markdown(LESSONS[0])


def test_the_library_gives_reasons_not_the_kits_issue_numbers():
    """``issue 32`` tells a reader of minizero/ nothing; another project's issue is cited with its
    repository (``pytorch/pytorch issue #65650``, ``nccl-tests/issues/212``, ``nccl-tests#196``)."""
    own = re.compile(r"(?<![\w/.-]/)(?<!/)\bissues?\s+#?\d+")
    repo = re.compile(r"[\w.-]+/[\w.-]+,?\s+$")
    found = []
    for f in sorted((ROOT / "minizero").rglob("*.py")):
        text = f.read_text()
        for m in own.finditer(text):
            if not repo.search(text[max(0, m.start() - 60) : m.start()]):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{f.relative_to(ROOT)}:{line}: {m.group()}")
    assert not found, "say the reason instead: " + "; ".join(found)


def test_the_course_packages_table_lists_every_module():
    """minizero/course/__init__.py's table: one row per module and subpackage of the course."""
    course = ROOT / "minizero" / "course"
    doc = importlib.import_module("minizero.course").__doc__
    rows = set(re.findall(r"^(\w+(?:\.py|/)) ", doc, re.M))
    files = {f.name for f in course.glob("*.py") if f.name != "__init__.py"}
    files |= {f"{d.name}/" for d in course.iterdir() if (d / "__init__.py").exists()}
    assert rows == files, f"missing: {sorted(files - rows)}, not there: {sorted(rows - files)}"


def test_the_import_the_docs_describe_is_the_lessons():
    """README and the course package say how a lesson opens: with its lab's star import."""
    for path in LESSONS:
        assert STAR.search(path.read_text()), path.name
    for text in (README.read_text(), importlib.import_module("minizero.course").__doc__):
        assert "from minizero.course import checks" not in text
        assert "from minizero.course.labs.lesson" in text


@pytest.mark.parametrize(
    "wrong",
    [
        "has no reduce-scatter",  # gloo has ReduceScatterHalvingDoubling; torch's
        # ProcessGroupGloo answers reduce_scatter_tensor with an all-reduce of a clone
        "busbw is built on",  # busbw is algbw times the ring's 2(n-1)/n or (n-1)/n: no α
        "minizero's extension",  # Megatron-LM's distributed optimizer instances; FSDP1's
        # _HYBRID_SHARD_ZERO2
    ],
)
def test_a_corrected_claim_stays_corrected(wrong: str):
    pages = [*LESSONS, README, *sorted((ROOT / "minizero").rglob("*.py"))]
    said = [p.name for p in pages if wrong in " ".join(p.read_text().replace("#", " ").split())]
    assert not said, f"{said} say {wrong!r}"
