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
    broken = []
    checked = 0
    for path in DOCS:
        for number, line in _lines(path):
            for target in LINK.findall(line):
                if EXTERNAL.match(target) or target.startswith("#"):
                    continue
                file_part = target.split("#", 1)[0]
                checked += 1
                if not (path.parent / file_part).exists():
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {target}")
    assert checked > 20, checked
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_archive_links_resolve():
    """The archived measurement files keep working links too."""
    archive = ROOT / "docs" / "results" / "archive"
    broken = []
    for path in sorted(archive.glob("*.md")):
        for number, line in _lines(path):
            for target in LINK.findall(line):
                if EXTERNAL.match(target) or target.startswith("#"):
                    continue
                if not (path.parent / target.split("#", 1)[0]).exists():
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)
