"""The docs hold together: every relative link of the README and the pages it links to names a
file of the checkout (and, with ``#anchor``, one of its headings), and the README stays a
README: what refinery is first, then the two set-up commands, on a few screens."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "RELIABILITY.md", ROOT / "SECURITY.md", ROOT / "CONTRIBUTING.md",
                *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 320


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lowercase, punctuation but ``-`` and ``_`` dropped,
    spaces made ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' line in a code block is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` (outside code blocks) that name no file, or no heading of it."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            bad.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            bad.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_relative_link_resolves() -> None:
    assert len(PAGES) > 8
    assert [b for page in PAGES for b in broken_links(page)] == []


def test_a_broken_link_is_named(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Some part: here\n\n[ok](#some-part-here) [gone](missing.md) "
                    "[no heading](#other) [web](https://example.org/x)\n\n```text\n[in code](nowhere.md)\n```\n")
    assert broken_links(page, tmp_path) == ["page.md: missing.md (no such file)", "page.md: #other (no such heading)"]


def test_the_readme_says_what_it_is_then_how_to_set_up_on_a_few_screens() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES
    assert "refinery prepares data for training large language models" in " ".join(lines[:3])
    first_block = lines.index("```bash")
    assert all(line.strip() for line in lines[2:first_block - 1])  # one paragraph, then the commands
    assert [line.split()[:2] for line in lines[first_block + 1:first_block + 3]] == [["make", "demo"],
                                                                                     ["make", "test"]]
