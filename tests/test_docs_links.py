"""Every relative link in README.md and docs/ points at a file or folder that exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# [text](target) and [text](target "title"); images too. Targets in code spans are not links.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
EXTERNAL = ("http://", "https://", "mailto:", "#")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    return [t for t in LINK.findall(prose) if not t.startswith(EXTERNAL)]


def test_the_link_reader_finds_links_and_skips_code() -> None:
    text = 'See [a](docs/a.md#part), ![b](img/b.png "B") and [web](https://x.org).\n'
    text += "`[not](code.md)`\n```\n[not](fenced.md)\n```\n"
    assert relative_links(text) == ["docs/a.md#part", "img/b.png"]


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path) -> None:
    broken = []
    for target in relative_links(document.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0]
        if path and not (document.parent / path).exists():
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)}: broken links {broken}"


def test_the_readme_links_every_doc() -> None:
    linked = set(relative_links((ROOT / "README.md").read_text(encoding="utf-8")))
    missing = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "docs").glob("*.md"))
        if str(p.relative_to(ROOT)) not in linked
    ]
    assert not missing, f"README.md links none of {missing}"
