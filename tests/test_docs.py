"""The docs as a product: links resolve, no diary files, the results page is well formed.

Pure file checks (no imports of rltlab, no model), well under a second:

- every relative markdown link in docs/**/*.md and README.md points to an existing file or
  folder (links inside code are ignored; README.md is checked for whatever links it has);
- no file under docs/ is named after a working session (`s12_...`, `..._call3...`) or a date;
- no tracked file mentions the reference notes that only the developers' machines have;
- `git ls-files docs` lists at most 60 files, and docs/ holds at most 25% of the repository's
  text lines (skipped outside a git checkout);
- every row of docs/results.md names a command, a commit and JSON files that exist, and every
  negative result names the commit where its code lived.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results.md"

MAX_DOCS_FILES = 60
MAX_DOCS_SHARE = 0.25
SESSION_NAME = re.compile(r"(^|[-_/])s\d+[-_]|call\d|\d{4}-\d{2}-\d{2}")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
BACKTICKED = re.compile(r"`([^`]+)`")
COMMIT = re.compile(r"`[0-9a-f]{7,40}`")
ROW_ID = re.compile(r"^[A-Z]\d+$")
# Assembled so that this file does not contain the name it looks for.
FORBIDDEN_NAME = "REFERENCE" + ".md"


def markdown_files() -> list[Path]:
    files = sorted(DOCS.rglob("*.md"))
    readme = ROOT / "README.md"
    return files + ([readme] if readme.exists() else [])


def relative_links(text: str) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    links = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue                          # http:, mailto:, in-page anchors
        links.append(target.split("#", 1)[0])
    return links


def broken_links(path: Path) -> list[str]:
    """`file: target` for every relative link of `path` that points nowhere."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{name}: {t}" for t in relative_links(text) if not (path.parent / t).exists()]


def git_files(*args: str) -> list[str] | None:
    """Tracked paths (under `args`), or None outside a git checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run(["git", "ls-files", "-z", *args], cwd=ROOT, capture_output=True)
    if out.returncode != 0:
        return None
    return [p for p in out.stdout.decode().split("\0") if p]


def text_of(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:                           # tracked but deleted in the working tree
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def results_rows(text: str) -> list[dict[str, str]]:
    """Every data row of every table whose header starts with `id`, as {column: cell}."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells if cells and cells[0] == "id" else []
        elif header and ROW_ID.match(cells[0]):
            assert len(cells) == len(header), f"results.md row {cells[0]}: {len(cells)} cells, " \
                                              f"the header has {len(header)}"
            rows.append(dict(zip(header, cells)))
    return rows


def negative_results(text: str) -> list[str]:
    section = text.split("## Negative results", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("- ")]


def test_markdown_links_resolve():
    files = markdown_files()
    assert RESULTS in files, "docs/results.md is missing"
    broken = [b for f in files for b in broken_links(f)]
    assert broken == []


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("[ok](there.md) [anchor](#a) [web](https://x.org) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n[bad](missing.md#part)\n")
    assert broken_links(page) == ["page.md: missing.md"]


def test_no_docs_file_is_named_after_a_session_or_a_date():
    names = set(git_files("docs") or ()) | \
        {p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*") if p.is_file()}
    diary = sorted(n for n in names if SESSION_NAME.search(n[len("docs/"):]))
    assert diary == []
    assert SESSION_NAME.search("experiments/scripts/s12_call3_h200.sh")
    assert SESSION_NAME.search("benchmarks/2026-12-03-s12-h200.md")


def test_no_tracked_file_mentions_the_private_reference_notes():
    tracked = git_files()
    if tracked is None:
        pytest.skip("not a git checkout")
    hits = [p for p in tracked
            if (t := text_of(ROOT / p)) is not None and FORBIDDEN_NAME in t]
    assert hits == []


def test_docs_stay_small():
    tracked = git_files()
    if tracked is None:
        pytest.skip("not a git checkout")
    docs = [p for p in tracked if p.startswith("docs/")]
    assert len(docs) <= MAX_DOCS_FILES, f"{len(docs)} files under docs/"
    lines = {p: t.count("\n") for p in tracked if (t := text_of(ROOT / p)) is not None}
    share = sum(n for p, n in lines.items() if p.startswith("docs/")) / sum(lines.values())
    assert share <= MAX_DOCS_SHARE, f"docs/ holds {share:.1%} of the text lines"


def test_results_rows_name_a_command_a_commit_and_existing_json():
    text = RESULTS.read_text(encoding="utf-8")
    rows = results_rows(text)
    assert len(rows) >= 10
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate ids in results.md"
    problems = []
    for r in rows:
        if not BACKTICKED.search(r["command"]):
            problems.append(f"{r['id']}: no command in backticks")
        if not COMMIT.search(r["commit"]):
            problems.append(f"{r['id']}: no commit hash in backticks")
        paths = BACKTICKED.findall(r["JSON"])
        if not paths:
            problems.append(f"{r['id']}: no JSON file")
        problems += [f"{r['id']}: {p} does not exist" for p in paths
                     if not p.endswith(".json") or not (ROOT / p).is_file()]
        if not r["verdict"] or not r["state"]:
            problems.append(f"{r['id']}: verdict or state empty")
    assert problems == []


def test_negative_results_name_their_commit():
    lines = negative_results(RESULTS.read_text(encoding="utf-8"))
    assert lines
    assert [line for line in lines if not COMMIT.search(line)] == []


def test_the_results_parser_reads_a_row():
    text = ("| id | command | commit | JSON | verdict | state |\n|---|---|---|---|---|---|\n"
            "| Z1 | `run x` | `abc1234` | `docs/results/nope.json` | met | current |\n\nprose\n"
            "| a | b |\n|---|---|\n| Z2 | c |\n")
    rows = results_rows(text)
    assert rows == [{"id": "Z1", "command": "`run x`", "commit": "`abc1234`",
                     "JSON": "`docs/results/nope.json`", "verdict": "met", "state": "current"}]


def test_readme_is_a_short_page_that_names_every_notebook():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 150, f"README.md has {readme.count(chr(10))} lines"
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    missing = [name for name in notebooks if f"`{name}`" not in readme]
    assert not missing, f"README.md does not name {missing}"
