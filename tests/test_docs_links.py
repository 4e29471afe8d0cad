"""The README and ``docs/`` hang together: every relative link (and image) names a file of the repository and,
with ``#anchor``, a heading of that file (GitHub's anchor rules); the README stays a five-minute read that starts
with the install-and-run command and the test command and links every page of ``docs/``; every page starts with
the task it answers and a command that does it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("**/*.md"))
# [text](target) and ![alt](target); a target ends at the first space (an optional "title" follows) or ")"
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code (links there are examples, not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_' removed, spaces to
    '-' (https://github.com/gjtorikian/html-pipeline, toc_filter.rb)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)          # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        base = anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def check(path: Path, target: str, root: Path = ROOT) -> str | None:
    """Why ``target`` (a link in ``path``) does not resolve, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):       # https:, mailto: ...: not this repository's
        return None
    file, _, frag = target.partition("#")
    dest = (path.parent / file).resolve() if file else path
    if not dest.exists():
        return f"{path.relative_to(root)}: link {target!r}: no file {file!r}"
    if root.resolve() not in dest.parents:
        return f"{path.relative_to(root)}: link {target!r} leaves the repository"
    if frag:
        if dest.suffix != ".md":
            return f"{path.relative_to(root)}: link {target!r}: an anchor into a file that is not Markdown"
        if frag not in anchors(dest):
            return (f"{path.relative_to(root)}: link {target!r}: {dest.relative_to(root)} has no heading "
                    f"#{frag} (it has: {', '.join(sorted(anchors(dest)))})")
    return None


def test_the_docs_exist():
    assert len(PAGES) >= 10, PAGES


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path):
    found = links(path)
    problems = [why for t in found if (why := check(path, t))]
    assert not problems, "\n".join(problems)


def test_the_link_check_can_fail(tmp_path):
    """A broken file, a broken anchor and a good anchor, on a page of its own."""
    (tmp_path / "a.md").write_text("# Title\n\n## The `--compile` flag: fast\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[x](a.md#the---compile-flag-fast) [y](missing.md) [z](a.md#not-a-heading) "
                    "`[w](inline.md)` [u](https://example.com/x)\n")
    results = {t: check(page, t, root=tmp_path) for t in links(page)}
    assert set(results) == {"a.md#the---compile-flag-fast", "missing.md", "a.md#not-a-heading",
                            "https://example.com/x"}
    assert results["a.md#the---compile-flag-fast"] is None and results["https://example.com/x"] is None
    assert "no file" in results["missing.md"] and "has no heading" in results["a.md#not-a-heading"]


def test_readme_is_short_and_links_every_page():
    text = README.read_text()
    assert len(text.splitlines()) < 150, len(text.splitlines())
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README) if not re.match(r"^\w+:", t)}
    missing = [str(p.relative_to(ROOT)) for p in PAGES if p.resolve() not in linked]
    assert not missing, f"README.md links no page {missing} (its 'Where to go next' table)"


def test_readme_starts_with_the_two_commands():
    """.ci/run runs the second; tests/training/test_trainer.py runs the first's recipe."""
    first = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).strip().splitlines()
    assert first[0].startswith("pip install torch==2.13.0 && pip install -e \".[test]\" && moefold train"), first
    assert first[1] == "python -m pytest -q", first
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_page_opens_with_its_task_and_command(path):
    """Before the first section: a line saying the task, and a shell block with the command that does it."""
    text = path.read_text()
    assert text.startswith("# "), f"{path.relative_to(ROOT)} starts without a title"
    opening = text.split("\n## ", 1)[0]
    assert re.search(r"^\*\*Task\*\*", opening, re.M), f"{path.relative_to(ROOT)}: no **Task** line before ##"
    assert re.search(r"```(bash|sh|console|shell)\n", opening), \
        f"{path.relative_to(ROOT)}: no command (a shell block) before its first section"
