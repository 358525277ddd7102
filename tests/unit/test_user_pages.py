"""The user pages stay short enough to read (issue 60): what a platform engineer reads to run
kvpersist, at most 20,000 words in all (`wc -w`), and the first cached prompt (README's front page
and the user guide) within 3,000. Apart: the design notes (design.md, datapath.md, security.md) and
what is generated (api-reference.md from the models, reliability.md from the fault tests' records,
the chart README's values table)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
USER_PAGES = ["README.md", *(f"docs/{p}.md" for p in ("user-guide", "gpu-cluster", "api", "attach", "admin", "upgrading",
                                                     "runbooks", "hfbucket-checklist", "gitops", "local-cluster"))]
APART = {"design.md", "datapath.md", "security.md", "api-reference.md", "reliability.md"}


def words(path: str) -> int:
    return len((ROOT / path).read_text().split())


def test_every_page_of_docs_is_counted_or_set_apart() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == {Path(p).name for p in USER_PAGES if p.startswith("docs/")} | APART, pages


def test_the_user_pages_total_at_most_20000_words() -> None:
    counts = {p: words(p) for p in USER_PAGES}
    assert sum(counts.values()) <= 20_000, counts
    assert counts["README.md"] + counts["docs/user-guide.md"] <= 3_000, counts
