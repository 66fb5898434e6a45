"""The README and docs/ as a reader meets them: a short README that opens with the two
commands that work on a fresh machine, and no relative link that leads nowhere (a clone
has only what is in the repository)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_LIMIT = 10240

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"(`+).*?\1", "", line))
    return lines


def links(text: str) -> list[str]:
    found = []
    for line in prose_lines(text):
        found += INLINE_LINK.findall(line)
        match = REFERENCE_DEF.match(line)
        if match:
            found.append(match.group(1))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, without punctuation, spaces as
    hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = text.replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            result.add(base if n == 0 else f"{base}-{n}")
    return result


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of ``path`` that does not reach a file inside ``root`` (or a
    heading of it, for a ``#anchor``), with the reason."""
    problems = []
    for target in links(path.read_text()):
        if SCHEME.match(target):
            continue  # http(s), mailto: not ours to check offline
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
        if not target:
            problems.append("an empty link target")
        elif not dest.is_relative_to(root.resolve()):
            problems.append(f"{target}: outside the repository")
        elif not dest.is_file():
            problems.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(root.resolve())}")
    return problems


def test_readme_is_short():
    size = README.stat().st_size
    assert size < README_LIMIT, f"README.md is {size} bytes; move detail into docs/"


def test_readme_opens_with_the_demo_and_test_commands():
    lines = [line for line in README.read_text().splitlines() if line.strip()]
    assert lines[0].startswith("# "), "README.md starts with its title"
    assert lines[1].startswith("```"), "the first thing after the title is the command block"
    assert lines[2].startswith("scripts/demo.sh ") and lines[3].startswith("scripts/test.sh "), lines[2:4]
    assert lines[4].startswith("```"), "the block holds just the two commands"


def commands(script: Path) -> list[str]:
    return [line.strip() for line in script.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_two_commands_do_what_the_readme_says():
    """demo.sh: setup, then the demo; test.sh: setup, then pytest; CI runs test.sh."""
    for name in ("demo.sh", "test.sh", "setup.sh"):
        assert (ROOT / "scripts" / name).stat().st_mode & 0o111, f"scripts/{name} is not executable"
    demo = commands(ROOT / "scripts" / "demo.sh")
    setup_at = next(i for i, c in enumerate(demo) if c.startswith("scripts/setup.sh"))
    assert demo[-1] == 'exec .venv/bin/dxpu demo "$@"' and setup_at < len(demo) - 1
    test = commands(ROOT / "scripts" / "test.sh")
    assert test.index("scripts/setup.sh") < len(test) - 1
    assert test[-1] == 'exec .venv/bin/python -m pytest "$@"'
    assert commands(ROOT / ".ci" / "run")[-1] == "exec scripts/test.sh"


def test_docs_exist_beside_the_readme():
    pages = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"docs/architecture.md", "docs/testing.md", "docs/benchmarks.md"} <= pages


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    problems = broken_links(path)
    assert not problems, f"broken links in {path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_link_check_finds_broken_links(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The `x` part (of it)\n\ntext\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# T\n\n[ok](docs/a.md) [ok](docs/a.md#the-x-part-of-it) [ok](#t) [web](https://example.org/x)\n"
        "`[not a link](nowhere.md)`\n```\n[not a link](nowhere.md)\n```\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#a-pag) [out](../elsewhere.md) ![img](docs/no.png)\n"
        "[ref]: docs/missing.md\n")
    (tmp_path.parent / "elsewhere.md").touch()
    problems = broken_links(page, root=tmp_path)
    assert [p.split(":")[0] for p in problems] == [
        "docs/b.md", "docs/a.md#a-pag", "../elsewhere.md", "docs/no.png", "docs/missing.md"], problems
