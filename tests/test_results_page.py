"""benchmarks/results_page.py: the marked blocks other scripts write survive a regenerated
docs/results.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from results_page import kept_blocks, splice  # noqa: E402


def test_every_marked_block_is_kept_and_replaced_in_place():
    doc = splice(splice("# Results\n\nold text\n", "recipes table"), "sizes table", "calib-size")
    assert kept_blocks(doc) == {"recipes": "recipes table", "calib-size": "sizes table"}
    page = "# Results\n\nnew text\n"
    for name, block in kept_blocks(doc).items():
        page = splice(page, block, name)
    assert page.index("new text") < page.index("recipes table") < page.index("sizes table")
    again = splice(page, "sizes table v2", "calib-size")
    assert kept_blocks(again) == {"recipes": "recipes table", "calib-size": "sizes table v2"}
    assert again.count("<!-- calib-size:begin -->") == 1


def test_every_hand_written_section_of_the_page_sits_in_a_kept_block():
    """``reproduce.py`` rebuilds docs/results.md from ``render`` and keeps the marked blocks:
    a section written by hand outside a block would be lost on the next regeneration. Every
    heading outside the blocks must be one ``results_page.py`` renders."""
    import re

    root = Path(__file__).resolve().parent.parent
    page = (root / "docs/results.md").read_text()
    outside = page
    for name in kept_blocks(page):
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        outside = outside.partition(begin)[0] + outside.partition(end)[2]
    # the titles as the renderer's source spells them, implicit string concatenations joined
    rendered = re.sub(r'"\s*\n\s*"', "", (root / "benchmarks/results_page.py").read_text())
    headings = re.findall(r"^#{1,3} (.+)$", outside, flags=re.M)
    assert headings, "the rendered part of the page has headings"
    lost = [h for h in headings if h not in rendered]
    assert not lost, f"hand-written sections outside a marked block: {lost}"
