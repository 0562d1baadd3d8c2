"""The project's Markdown (README, docs/, configs/): every link to a file of the tree names a file that exists, and
every #anchor names a heading of its target, as GitHub spells heading anchors."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)")


def _markdown() -> list[Path]:
    return sorted([*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "configs").rglob("*.md")])


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a file's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: Counter = Counter()
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return out


def test_anchors_follow_githubs_spelling():
    text = "# A: b\n## Zen 4: c=1 TTFT (2026-12-07, 12:00 UTC)\n## A: b\n"
    assert anchors(text) == {"a-b", "zen-4-c1-ttft-2026-12-07-1200-utc", "a-b-1"}


def test_links_name_files_and_headings_that_exist():
    broken = []
    for doc in _markdown():
        for path, anchor in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", path):  # http:, https:, mailto:
                continue
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {path} does not exist")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {path}#{anchor} names no heading there")
    assert not broken, "\n".join(broken)
