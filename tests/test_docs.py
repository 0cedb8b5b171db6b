"""The docs hold together: every relative link in the README and docs/ reaches a file (and
its heading, when it names one), and every citation of the design document in the code,
the tests and the docs names a section or an invariant that docs/design.md has."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "design.md"

#: ``[text](target)``, not an image's, not a URL.
LINK = re.compile(r"(?<!!)\[[^\]]+\]\(([^)\s]+)\)")
#: ``design.md section 5``, ``design.md) sections 4 and 7``, ``design.md invariants 2, 8``,
#: across a line break too.
CITATION = re.compile(
    r"design\.md\)?,?\s+(sections?|invariants?)\s+(\d+(?:(?:,\s*|\s+and\s+|\s+or\s+)\d+)*)"
)


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def sources() -> list[Path]:
    found = [*documents(), REPO / "pyproject.toml", REPO / "Makefile"]
    for root in ("worker", "supervisor", "tests", "bench", "systemd", "config"):
        found += [
            p for p in sorted((REPO / root).rglob("*")) if p.suffix in (".py", ".toml", ".service")
        ]
    return found


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped but ``-``
    and ``_``, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_in_the_docs_reaches_its_file_and_heading() -> None:
    broken = []
    for doc in documents():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            name, _, anchor = target.partition("#")
            path = (doc.parent / name).resolve() if name else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def design_parts() -> tuple[set[int], set[int]]:
    text = DESIGN.read_text()
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", text, flags=re.M)}
    start = text.index("## 6. Invariants")
    block = text[start : text.index("\n## ", start + 1)]
    invariants = {int(n) for n in re.findall(r"^(\d+)\. ", block, flags=re.M)}
    return sections, invariants


def test_the_design_document_numbers_its_sections_and_invariants() -> None:
    sections, invariants = design_parts()
    assert sections == set(range(1, 21))
    assert invariants == set(range(1, 11))


def test_every_citation_of_the_design_document_names_a_part_it_has() -> None:
    sections, invariants = design_parts()
    seen, wrong = 0, []
    for path in sources():
        for kind, numbers in CITATION.findall(path.read_text(errors="replace")):
            have = sections if kind.startswith("section") else invariants
            for number in re.findall(r"\d+", numbers):
                seen += 1
                if int(number) not in have:
                    wrong.append(f"{path.relative_to(REPO)}: {kind} {number}")
    assert seen > 50, "the citation pattern no longer matches how the code cites"
    assert wrong == []


def test_nothing_cites_a_design_document_outside_the_repository() -> None:
    outside = [
        str(path.relative_to(REPO))
        for path in sources()
        if path != Path(__file__) and re.search(r"\bDESIGN\.md\b", path.read_text(errors="replace"))
    ]
    assert outside == []
