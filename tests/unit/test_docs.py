"""The documentation is held to the code where the two can drift apart unnoticed.

design.md's layer table must list exactly the layers of the import-linter contract in
``setup.cfg`` (the contract is what ``lint-imports`` enforces; the table is what a reader
learns), in its order and with its module names. And every relative link in the README and
in ``docs/`` (``docs/dev/`` included) must reach a file, and, with an ``#anchor``, a heading
of that file as GitHub names it: pages move, and a moved page must not leave links behind.
"""
from __future__ import annotations

import configparser
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = "importlinter:contract:layers"
LAYERS_HEADING = "## Package layout: layers"

Layers = List[List[str]]


def contract_layers(setup_cfg: str) -> Layers:
    """The contract's layers, top first, each as its module names in the order written."""
    parser = configparser.ConfigParser()
    parser.read_string(setup_cfg)
    lines = [line.strip() for line in parser[CONTRACT]["layers"].splitlines() if line.strip()]
    return [[name.strip() for name in line.split("|")] for line in lines]


def design_layers(design: str) -> Layers:
    """The modules column of design.md's layer table, top row first.

    Raises:
        ValueError: the section or its table is missing.
    """
    if LAYERS_HEADING not in design:
        raise ValueError(f"design.md has no section {LAYERS_HEADING!r}")
    section = design.split(LAYERS_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    if len(rows) < 3:
        raise ValueError("design.md's layers section has no table")
    layers = []
    for row in rows[2:]:
        cells = row.strip().strip("|").split("|")
        layers.append(re.findall(r"`(distopt(?:\.\w+)*)`", cells[1]))
    return layers


def test_design_md_lists_the_import_contract_layers_in_order() -> None:
    contract = contract_layers((ROOT / "setup.cfg").read_text())
    design = design_layers((ROOT / "docs" / "design.md").read_text())
    assert design == contract, (
        "docs/design.md's layer table (modules column, top row first) differs from setup.cfg's "
        f"[{CONTRACT}]: make the table list the contract's layers, top to bottom, with the same "
        f"module names.\n table:    {design}\n contract: {contract}")


def test_the_layer_check_sees_a_change_on_either_side() -> None:
    """A swapped row in design.md, or a layer added to the contract alone, is a difference."""
    setup_cfg = (ROOT / "setup.cfg").read_text()
    design = (ROOT / "docs" / "design.md").read_text()
    contract = contract_layers(setup_cfg)

    rows = [line for line in design.splitlines() if line.startswith("| 2 |") or line.startswith("| 3 |")]
    assert len(rows) == 2
    swapped = design.replace(rows[0], "\0").replace(rows[1], rows[0]).replace("\0", rows[1])
    assert design_layers(swapped) != contract

    added = setup_cfg.replace("    distopt.planning", "    distopt.planning\n    distopt.newlayer")
    assert added != setup_cfg
    assert design_layers(design) != contract_layers(added)


# -- links ---------------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _pages() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "dev").glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("code", FENCE.sub("", text))


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: its text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> Set[str]:
    """Every heading anchor of a page, with GitHub's -1, -2 ... for repeated headings."""
    seen: Dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> List[Tuple[str, str]]:
    """(target path, anchor) of every relative link in a page; ('', anchor) for one in the page itself."""
    found = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        found.append((path, anchor))
    return found


def test_the_pages_checked_are_found() -> None:
    names = {page.relative_to(ROOT).as_posix() for page in _pages()}
    assert {"README.md", "docs/design.md", "docs/benchmark.md", "docs/dev/README.md"} <= names
    assert len(links(ROOT / "README.md")) > 10


@pytest.mark.parametrize("page", _pages(), ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_a_file_and_its_heading(page: Path) -> None:
    broken = []
    for path, anchor in links(page):
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{path}#{anchor}" if anchor else path)
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{path}#{anchor} (no such heading in {target.relative_to(ROOT).as_posix()})")
    assert not broken, f"{page.relative_to(ROOT).as_posix()} links to what is not there: {broken}"


def test_anchors_follow_github(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Slow links (`--link`)\n\n```\n# not a heading\n```\n\n"
                    "## `pack_threshold=\"auto\"`\n\n### Uneven inputs: join()\n\n## Title\n")
    assert anchors(page) == {"title", "slow-links---link", "pack_thresholdauto", "uneven-inputs-join", "title-1"}


def test_links_in_code_are_not_links(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("See [a](a.md#x) and `opt[0](1)`.\n\n```python\nx = d[k](y)\n```\n"
                    "![img](images/p.png) [web](https://example.com) [here](#title)\n")
    assert links(page) == [("a.md", "x"), ("images/p.png", ""), ("", "title")]
