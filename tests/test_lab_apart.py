"""The lab stays apart from the product: tools/ holds at most 18 entries, each named in the
Makefile, the README or docs/ (a script no document names is a lab script: git keeps it), and the
benchmark page stays a product document of at most 400 lines (dated runs live in
docs/benchmarks/results/) whose sections the links into it name."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
MAX_TOOLS = 18
MAX_BENCHMARK_PAGE_LINES = 400


def product_text() -> str:
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "Makefile", ROOT / "README.md", *docs])


def tool_entries(tools: Path = TOOLS) -> list[str]:
    return sorted(p.name for p in tools.iterdir() if not p.name.startswith(".") and p.name != "__pycache__")


def unnamed(entries: list[str], text: str) -> list[str]:
    """The entries `text` never names as tools/NAME."""
    return [name for name in entries if f"tools/{name}" not in text]


def test_tools_holds_at_most_18_entries():
    names = tool_entries()
    assert len(names) <= MAX_TOOLS, f"tools/ has {len(names)} entries (at most {MAX_TOOLS}): {names}"


def test_every_tool_is_named_by_the_makefile_the_readme_or_docs():
    missing = unnamed(tool_entries(), product_text())
    assert not missing, f"tools/ entries no product document names: {missing}"


def test_the_benchmark_page_is_at_most_400_lines():
    n = len((ROOT / "docs/benchmarks/README.md").read_text(encoding="utf-8").splitlines())
    assert n <= MAX_BENCHMARK_PAGE_LINES, f"docs/benchmarks/README.md has {n} lines"


def test_a_tool_no_document_names_fails_the_check(tmp_path):
    """The check has teeth: a stray script beside a named one is reported by name, and a name
    that only appears without the tools/ prefix does not count."""
    for name in ("one-off-probe.py", "install.sh", ".cache"):
        (tmp_path / name).write_text("")
    text = "run tools/install.sh, or one-off-probe.py by hand"
    assert unnamed(tool_entries(tmp_path), text) == ["one-off-probe.py"]


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_the_benchmark_page_name_its_sections():
    """Sections moved to results/ when the page was cut down: an anchor that names a section it no
    longer has is a broken link, though the file exists."""
    page = ROOT / "docs/benchmarks/README.md"
    anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)}
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            points_here = (doc.parent / path).resolve() == page if path else doc == page
            if anchor and points_here and anchor not in anchors:
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert slug("What decides speculation on a CPU and on a GPU") in anchors and slug("EAGLE-3 head") == "eagle-3-head"
