"""The docs are a product: README.md and docs/*.md hold design and how-to, not a work log.

Measurements with their machines and dates live under docs/results/ (the archive included);
the front page and the design docs must not name machines or dates, and every relative
Markdown link in them must point to a file that exists.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Machine names (as prose names them; result file labels such as `amd-zen5` are lower case),
# calendar years other than a paper citation's ("Chen et al. 2023") and work-log wording.
FORBIDDEN = re.compile(
    r"\b(Xeon|EPYC|Zen ?[2-5]|AMD|Intel)\b"
    r"|(?<!et al\. )(?<!et al\., )\b20[1-3][0-9]\b"
    r"|\b[Tt]his session\b"
)
# [text](target) and ![alt](target); the target stops at whitespace or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


def _lines(path):
    """(line number, text) of a Markdown file, fenced code blocks left out."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _anchors(path):
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to '-'."""
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for _, line in _lines(path)
        if line.startswith("#")
    }


def _broken_links(path):
    """'file:line: target' for each relative link of path whose file or heading anchor is missing."""
    broken = []
    for number, line in _lines(path):
        for target in LINK.findall(line):
            if EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = path.parent / file_part if file_part else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}:{number}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}:{number}: {target} (no such heading)")
    return broken


def test_docs_exist():
    assert len(DOCS) > 5, DOCS
    assert all(path.is_file() for path in DOCS)


def test_no_machine_names_or_dates():
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for path in DOCS
        for number, line in _lines(path)
        for match in FORBIDDEN.finditer(line)
    ]
    assert not hits, "machine names/dates belong in docs/results/:\n" + "\n".join(hits)


def test_relative_links_resolve():
    checked = sum(len(LINK.findall(line)) for path in DOCS for _, line in _lines(path))
    assert checked > 20, checked
    broken = [entry for path in DOCS for entry in _broken_links(path)]
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_archive_links_resolve():
    """The archived measurement files keep working links too."""
    archive = sorted((ROOT / "docs" / "results" / "archive").glob("*.md"))
    assert archive
    broken = [entry for path in archive for entry in _broken_links(path)]
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_the_module_map_has_a_row_for_every_module():
    """docs/architecture.md names every module of src/river_hf (as ``path.py``, ``name.py`` in its
    package's table, or its package folder ``pkg/``), so the map cannot fall behind the tree."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    package = root / "src" / "river_hf"
    doc = (root / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if path.name == "__init__.py":
            continue
        names = {rel, path.name, rel.split("/", 1)[-1], *(f"{p}/" for p in Path(rel).parent.parts[:1])}
        if not any(f"`{n}`" in doc for n in names):
            missing.append(rel)
    assert missing == [], f"docs/architecture.md has no row for {missing}"


def test_the_serve_examples_serve_a_model_river_speeds_up():
    """The README's `river-hf serve` example serves generate's default model (on a 135M model River and
    lossless mode are slower than the plain model, docs/river.md), and its request names that model;
    docs/serve.md's examples serve no 135M model either."""
    from river_hf.river.cli import DEFAULT_MODEL

    def fenced(path):
        text = path.read_text(encoding="utf-8")
        return "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL))

    readme = fenced(ROOT / "README.md")
    served = re.findall(r"river-hf serve (\S+)", readme)
    assert served == [DEFAULT_MODEL], served
    assert set(re.findall(r'"model": "([^"]+)"', readme)) == {DEFAULT_MODEL}
    examples = fenced(ROOT / "docs" / "serve.md")
    assert re.findall(r"river-hf serve (\S+)", examples) and "135m" not in " ".join(
        re.findall(r"river-hf serve (\S+)", examples) + re.findall(r'model[=:] ?"([^"]+)"', examples))
