"""Every link in the README and in docs/ resolves: a relative link names a file of the clone, and
an #anchor names a heading of the page it points into (GitHub's rule for heading anchors)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation but - and _ dropped,
    spaces to hyphens; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code blocks
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans hold no links
    return LINK.findall(text)


def test_the_slug_rule():
    page = ROOT / "docs" / "results.md"
    assert "zero-at-stage-3" in anchors(page) and "on-a-gpu" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: - not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading for #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


@pytest.mark.parametrize(
    "source", sorted((ROOT / "course").glob("[0-9][0-9]_*.py")), ids=lambda p: p.stem
)
def test_every_link_of_a_lesson_resolves(source: Path):
    """A lesson's markdown links, read from where its notebook lies (lessons/, my-lessons/)."""
    text = "\n".join(line[2:] for line in source.read_text().splitlines() if line.startswith("# "))
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (ROOT / "lessons" / path).resolve()
        if not dest.exists():
            broken.append(f"{target}: no file")
        elif anchor and anchor not in anchors(dest):
            broken.append(f"{target}: no heading for #{anchor}")
    assert not broken, f"{source.name}: broken links: {broken}"
