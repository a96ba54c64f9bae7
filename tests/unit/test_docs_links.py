"""Every relative link in README.md and docs/**/*.md points at a file or directory that exists
and, in a git checkout, that git does not ignore (a clean clone has it too).

Links are markdown inline links and images (`[text](path)`, `[text](path#anchor)`) and
reference definitions (`[id]: path`). Web and mail links (http, https, mailto) and links to
an anchor of the same page (`#anchor`) are not checked; of `path#anchor`, only the path is.
Code blocks and code spans are skipped: what they hold is code, not links.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("**/*.md"))]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[`~]*[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`)(?:(?!\n[ \t]*\n).)+?(?<!`)\1(?!`)", re.S)  # within a paragraph
INLINE_LINK = re.compile(
    r"!?\[(?P<text>(?:[^\[\]]|\[[^\[\]]*\])*)\]"  # [text], which may hold one level of brackets
    r"\(\s*(?P<target><[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"  # (target "optional title")
)
REFERENCE = re.compile(r"^ {0,3}\[(?P<text>[^\]]+)\]:\s*(?P<target><[^>]*>|\S+)", re.M)
UNCHECKED = ("http://", "https://", "mailto:")


def _blank(match: re.Match) -> str:
    """The match with every character but newlines turned into a space (offsets and lines kept)."""
    return re.sub(r"[^\n]", " ", match.group(0))


def links(markdown: str) -> list[tuple[int, str, str]]:
    """(line, text, target) of every link outside code, in order."""
    prose = CODE_SPAN.sub(_blank, FENCE.sub(_blank, markdown))
    found = []
    for pattern in (INLINE_LINK, REFERENCE):
        for match in pattern.finditer(prose):
            target = match.group("target").strip("<>")
            line = prose.count("\n", 0, match.start()) + 1
            found.append((match.start(), line, match.group("text").strip(), target))
    return [(line, text, target) for _, line, text, target in sorted(found)]


def local_path(target: str) -> str | None:
    """The file part of a link to check, or None for a link not checked (web, mail, same-page anchor)."""
    if target.lower().startswith(UNCHECKED) or target.startswith("#"):
        return None
    return unquote(target.split("#", 1)[0])


def ignored_by_git(paths: list[Path]) -> set[Path]:
    """Those of `paths` that git ignores; empty where ROOT is not a git checkout or git is absent."""
    if not paths or shutil.which("git") is None or not (ROOT / ".git").exists():
        return set()
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--stdin"],
        input="\n".join(str(p) for p in paths),
        capture_output=True,
        text=True,
        check=False,
    )
    return {Path(line).resolve() for line in listed.stdout.splitlines() if line}


def broken_links(document: Path) -> list[str]:
    """One line per link of `document` whose target is missing or, in a git checkout, ignored by git."""
    checked = []
    for line, text, target in links(document.read_text(encoding="utf-8")):
        path = local_path(target)
        if path is None:
            continue
        resolved = (ROOT / path.lstrip("/") if path.startswith("/") else document.parent / path).resolve()
        checked.append((line, text, target, resolved))
    inside = [resolved for *_, resolved in checked if resolved.exists() and resolved.is_relative_to(ROOT)]
    ignored = ignored_by_git(inside)  # git refuses a whole batch holding a path outside the checkout
    broken = []
    for line, text, target, resolved in checked:
        shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
        if not resolved.exists():
            broken.append(f"line {line}: [{text}]({target}) -> {shown} does not exist")
        elif resolved in ignored:
            broken.append(f"line {line}: [{text}]({target}) -> {shown} is ignored by git (a clone lacks it)")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_relative_link_exists(document):
    broken = broken_links(ROOT / document)
    assert not broken, f"{document} has {len(broken)} broken link(s):\n" + "\n".join(broken)


def test_the_documents_are_found():
    assert "README.md" in DOCUMENTS
    assert any(d.startswith("docs/") for d in DOCUMENTS), "no docs/**/*.md found"
    assert any(local_path(t) for _, _, t in links((ROOT / "README.md").read_text(encoding="utf-8"))), (
        "README.md has no relative link: is the parser broken?"
    )


def test_the_parser_checks_what_it_should():
    sample = "\n".join(
        [
            'See [a](docs/a.md), [b](docs/b.md#part), ![img](pic.png "title") and [web](https://example.com).',
            "[mail](mailto:x@example.com), [here](#anchor), [`code` text](<with space.md>).",
            "`[not](a-link.md)` and:",
            "```",
            "[not](in-a-fence.md)",
            "```",
            "[ref]: ../ref.md",
        ]
    )
    found = [(line, target) for line, _, target in links(sample)]
    assert found == [
        (1, "docs/a.md"),
        (1, "docs/b.md#part"),
        (1, "pic.png"),
        (1, "https://example.com"),
        (2, "mailto:x@example.com"),
        (2, "#anchor"),
        (2, "with space.md"),
        (7, "../ref.md"),
    ]
    checked = [local_path(target) for _, target in found]
    assert checked == ["docs/a.md", "docs/b.md", "pic.png", None, None, None, "with space.md", "../ref.md"]


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "there.md").write_text("")
    document = tmp_path / "page.md"
    document.write_text("[ok](there.md#top) [gone](missing.md#top) [dir](.)\n")
    assert [b.split(" -> ")[0] for b in broken_links(document)] == ["line 1: [gone](missing.md#top)"]
