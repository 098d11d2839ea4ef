"""The results pages: docs/results.md (the summary) and the topic pages under docs/results/.
Each marked block sits on the page ``benchmarks/results_page.py``'s ``BLOCKS`` names and survives
a regeneration; the ``gpu`` block is what its recorded runs render; every link resolves."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_results  # noqa: E402
from results_page import ACCURACY, BLOCKS, RESULTS, kept_blocks, markers, splice  # noqa: E402

PAGES = [ROOT / "docs/results.md", *sorted(RESULTS.glob("*.md"))]


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


def test_every_hand_written_section_of_the_accuracy_page_sits_in_a_kept_block():
    """``reproduce.py`` rebuilds docs/results/accuracy.md from ``render`` and keeps the marked
    blocks: a section written by hand outside a block would be lost on the next regeneration.
    Every heading outside the blocks must be one ``results_page.py`` renders."""
    page = ACCURACY.read_text()
    outside = page
    for name in kept_blocks(page):
        begin, end = markers(name)
        outside = outside.partition(begin)[0] + outside.partition(end)[2]
    # the titles as the renderer's source spells them, implicit string concatenations joined
    rendered = re.sub(r'"\s*\n\s*"', "", (ROOT / "benchmarks/results_page.py").read_text())
    headings = re.findall(r"^#{1,3} (.+)$", outside, flags=re.M)
    assert headings, "the rendered part of the page has headings"
    lost = [h for h in headings if h not in rendered]
    assert not lost, f"hand-written sections outside a marked block: {lost}"


def test_every_block_is_on_the_page_blocks_names_once():
    """A script splices its block into the page ``BLOCKS`` names (its default ``--doc``): a
    block found elsewhere, twice, or not at all would be written as a second copy."""
    found = {}
    for page in PAGES:
        text = page.read_text()
        for name in re.findall(r"<!-- ([\w-]+):begin -->", text):
            assert text.count(markers(name)[1]) == 1, f"{page.name}: {name} not closed once"
            found.setdefault(name, []).append(page.relative_to(RESULTS.parent).as_posix())
    want = {name: [f"results/{page}"] for name, page in BLOCKS.items()}
    assert found == want


def test_the_gpu_block_is_what_its_recorded_runs_render(tmp_path):
    """docs/results/gpu.md's block is ``gpu_results.render()`` of ``benchmarks/data/gpu/``: a
    run log added or edited without rerendering the page fails here (checked on a copy of the
    data with one figure changed)."""
    page = kept_blocks((RESULTS / BLOCKS["gpu"]).read_text())["gpu"]
    assert page == gpu_results.render().strip(), "stale: python benchmarks/gpu_results.py"
    data = tmp_path / "gpu"
    shutil.copytree(gpu_results.DATA, data)
    run = next(f for f in sorted(data.glob("*.json")) if not f.name.endswith("-checks.json"))
    record = json.loads(run.read_text())
    record["rows"][-1]["wall_s"] = 12345.6
    run.write_text(json.dumps(record))
    assert page != gpu_results.render(data).strip()


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not comments in code
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


LINKED = [ROOT / "README.md", ROOT / "benchmarks/README.md", *sorted((ROOT / "docs").glob("*.md")),
          *sorted(RESULTS.glob("*.md"))]


@pytest.mark.parametrize("page", LINKED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_and_heading(page):
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
