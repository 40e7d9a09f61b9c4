"""The documentation holds together: every relative link in ``README.md`` and ``docs/*.md`` reaches
a file of the checkout, every ``#anchor`` names a heading of its page (GitHub's anchor slugs), and
the README stays short enough to read (at most 200 lines; the rest lives in ``docs/``).

Pure text, no network: links with a scheme (``https:``, ``mailto:``) are not followed.
Run: ``pytest tests/test_docs.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import safetensors.torch

from tests.support.launch import ROOT

pytestmark = pytest.mark.stage3  # no stage involved

README_MAX_LINES = 200
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target), the target up to whitespace or the closing parenthesis.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def _prose(text: str) -> list[tuple[int, str]]:
    """The numbered lines outside fenced code blocks: links inside them are not links."""
    out, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fence = not fence
            continue
        if not fence:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, formatting and punctuation dropped
    (letters, digits, ``_`` and ``-`` kept), spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page offers, one per heading; repeats get ``-1``, ``-2`` as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose(path.read_text()):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``path`` that reaches no file, or no heading of a markdown page."""
    problems = []
    for number, line in _prose(path.read_text()):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                continue  # https:, mailto: ...: not followed
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
            elif anchor and dest.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not markdown")
    return problems


def test_every_relative_link_reaches_its_file_and_heading() -> None:
    assert len(PAGES) > 1, "docs/ holds no pages"
    problems = [p for page in PAGES for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checker_sees_a_broken_file_link_and_a_missing_anchor(tmp_path: Path) -> None:
    """The checker is not vacuous: a page with one good and two bad links yields exactly the bad."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading, with: punctuation\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Same\n\n## Same\n\n"
        "[ok](other.md#a-code-heading-with-punctuation) [ok](#same-1) `[not a link](nowhere.md)`\n"
        "```\n[in code](nowhere.md)\n```\n"
        "[gone](missing.md) [no anchor](other.md#nothing) [web](https://example.com/x)\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2, problems
    assert "missing.md: no file" in problems[0]
    assert "#nothing in other.md" in problems[1]


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("torch.compile", "torchcompile"),
        (
            "When a rank fails, stalls or falls out of step",
            "when-a-rank-fails-stalls-or-falls-out-of-step",
        ),
        ("`ShardedModule(module, *, stage=3)`", "shardedmodulemodule--stage3"),
        (
            "ZeRO stages against DeepSpeed, FSDP2 and DDP",
            "zero-stages-against-deepspeed-fsdp2-and-ddp",
        ),
    ],
)
def test_anchor_slugs_follow_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_readme_is_at_most_200_lines() -> None:
    count = len((ROOT / "README.md").read_text().splitlines())
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines, more than {README_MAX_LINES}: move the detail into a page "
        "under docs/ and link it from the README's feature map"
    )


def test_the_module_map_names_every_module_of_the_package_and_no_other() -> None:
    """docs/concepts.md's module map lists each module by its path under ``shardwrap/``."""
    package = ROOT / "shardwrap"
    modules = {
        str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "__init__.py"
    }
    text = (ROOT / "docs" / "concepts.md").read_text()
    start = text.index("**Where each decision lives**")
    found = re.findall(r"`([\w/]+\.py)`", text[start : text.index("\n\n", start)])
    listed = {path for path in found if not path.startswith("tests/")}
    assert modules - listed == set(), f"missing from the module map: {sorted(modules - listed)}"
    assert listed - modules == set(), f"in the map, not in the package: {sorted(listed - modules)}"


def test_the_readme_quickstart_trains_saves_resumes_and_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's Quickstart runs as it stands (world size 1): a first run stopped after
    30 steps leaves a checkpoint at step 19; the block itself then resumes from step 20, trains
    to the end and exports what the plain model loads."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Quickstart")
    block = readme[
        readme.index("```python", start) + len("```python") : readme.index("```\n", start + 20)
    ]
    monkeypatch.chdir(tmp_path)
    assert "range(start, 40)" in block
    first: dict[str, object] = {}
    exec(
        compile(block.replace("range(start, 40)", "range(start, 30)"), "quickstart", "exec"), first
    )
    saved = tmp_path / "ckpt"
    assert (saved / "step-19").is_dir() and not (saved / "step-39").exists()
    again: dict[str, object] = {}
    exec(compile(block, "quickstart", "exec"), again)
    assert again["start"] == 20, "the second run did not resume from the checkpoint"
    exported = safetensors.torch.load_file(tmp_path / "model" / "model.safetensors")
    plain = again["model"]
    assert set(exported) == set(plain.full_state_dict())  # type: ignore[attr-defined]
