"""The front page and docs/: links that resolve, the flags table that matches `mtp-serve --help`, a
front page short enough to read, and the CI's test command where .ci/run reads it."""

import re
from pathlib import Path

from mtp_serve.cli.flags_doc import END, START, rendered_block

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """The page without its code blocks (links and headings inside them are not the page's)."""
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", prose(page), re.M)}


def links(page: Path) -> list:
    return LINK.findall(prose(page))


def test_every_relative_link_resolves_to_a_file_and_heading():
    """Each relative link of README.md and docs/*.md names a file that exists, and its #anchor a heading there."""
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+:", target):
                continue  # http(s) links are not fetched
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_front_page():
    linked = {t.partition("#")[0] for t in links(REPO / "README.md")}
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in linked]
    assert not missing, missing


def test_flags_table_matches_mtp_serve_help():
    """docs/serving.md's table between the flags markers is what `mtp-serve`'s parser renders now, and
    names every flag; `python -m mtp_serve.cli.flags_doc docs/serving.md` regenerates it."""
    from mtp_serve.cli.serve import build_parser

    text = (REPO / "docs" / "serving.md").read_text()
    block = text[text.index(START):text.index(END) + len(END)]
    assert block == rendered_block(), "docs/serving.md's flags table drifted from mtp-serve --help"
    flags = [f for a in build_parser()._actions for f in a.option_strings if f.startswith("--") and f != "--help"]
    assert flags and all(f"`{f}`" in block for f in flags)


def test_front_page_is_under_two_thousand_words():
    words = len(prose(REPO / "README.md").split())
    assert words < 2000, words


def test_ci_test_command_and_start_command_are_on_the_front_page():
    """.ci/run runs the block between the test-command markers; the start command installs the SDKs the
    quick start imports."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- test-command -->\n```bash\n(.*?)\n```\n<!-- /test-command -->", text, re.S)
    assert block and block.group(1) == "./install.sh --test && python3 -m pytest -q --all-tiers"
    start = re.search(r"^\./install\.sh && .*mtp-serve --enable-mtp$", text, re.M)
    assert start and "openai" in start.group(0) and "anthropic" in start.group(0)
    for sdk in ("from openai import", "import anthropic"):
        assert sdk in text
