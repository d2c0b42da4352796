"""The documentation: its code blocks run, its results pages are current, and nothing narrates past work.

* Every fenced ``python`` block of README.md and docs/**/*.md runs: a file's blocks in order, in one
  namespace, in a fresh temporary working directory. A block preceded by the line
  ``<!-- illustrative -->`` (blank lines between allowed) is skipped. A file holding the line
  ``<!-- docs-test: slow -->`` needs the real default model: its test is marked ``slow``.
* docs/results/ is what ``bench/results_pages.py`` writes from bench/results/.
* README.md, CHANGELOG.md, docs/ and the code (eqjax/, pallas_kernels/, tests/, examples/, bench/*.py)
  hold none of the ``NARRATION`` patterns (see docs/contributing.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ILLUSTRATIVE = "<!-- illustrative -->"
SLOW = "<!-- docs-test: slow -->"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, source)`` of every fenced python block not marked illustrative."""
    lines = text.splitlines()
    blocks: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), m.group("indent")
        lang = (m.group("info").split() or [""])[0].lower()
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and lines[j].strip().strip(fence[0]) == ""):
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marked = k >= 0 and lines[k].strip() == ILLUSTRATIVE
        if lang in ("python", "py") and not marked:
            body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]]
            blocks.append((i + 2, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def _params() -> list:
    out = []
    for f in doc_files():
        text = f.read_text()
        if not python_blocks(text):
            continue
        marks = [pytest.mark.slow] if SLOW in text else []
        out.append(pytest.param(f, marks=marks, id=str(f.relative_to(ROOT))))
    return out


@pytest.mark.parametrize("path", _params())
def test_code_blocks_run(path: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict = {"__name__": f"docs:{path.name}"}
    for line, source in python_blocks(path.read_text()):
        code = compile(source, f"{path.relative_to(ROOT)}:{line}", "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own examples


def test_block_parser():
    text = "\n".join([
        "```python", "a = 1", "```",
        ILLUSTRATIVE, "", "```python", "b = undefined", "```",
        "````markdown", "```python", "c = 3", "```", "````",
        "```bash", "echo no", "```",
        "  ```py", "  d = a + 1", "  ```",
    ])
    assert [src for _, src in python_blocks(text)] == ["a = 1\n", "d = a + 1\n"]


def test_results_pages_are_current():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "results_pages.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, f"docs/results is stale; run python bench/results_pages.py\n{r.stderr}"


# ------------------------------------------------------------------------------------- narration
ORDINALS = (r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            r"fourteenth|fifteenth|\d+(?:st|nd|rd|th)")
NARRATION = {
    "session ordinal": re.compile(rf"\b(?:{ORDINALS})[ -]+(?:work[ -]+)?sessions?\b", re.IGNORECASE),
    "session reference": re.compile(r"\b(?:this|that|previous|last|next|earlier|later|same|each|one)\s+sessions?\b"
                                    r"|\bsessions?\s+(?:\d+|of\s+20\d\d)", re.IGNORECASE),
    "issue number": re.compile(r"\bissues?\s*(?:#|no\.?\s*)?\d+", re.IGNORECASE),
    "work in flight": re.compile(r"\bin[ -]progress\b", re.IGNORECASE),
}
"""Phrases that narrate how the work went rather than what the project is (``InferenceSession`` is fine)."""


def narration_files(docs: bool) -> list[Path]:
    if docs:
        files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "mkdocs.yml"]
        files += sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file())
    else:
        files = []
        for d in ("eqjax", "pallas_kernels", "tests", "examples"):
            files += sorted(p for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".toml", ".sh", ".txt"))
        files += sorted((ROOT / "bench").glob("*.py"))
    return [f for f in files if f.is_file() and "__pycache__" not in f.parts]


def narration(files: list[Path]) -> list[str]:
    found = []
    for f in files:
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for what, pat in NARRATION.items():
                for m in pat.finditer(line):
                    found.append(f"{f.relative_to(ROOT)}:{n}: {what}: {m.group(0)!r}")
    return found


def test_narration_patterns():
    s, i = "session", "issue"  # split so that this file does not match its own patterns
    bad = [f"in the twelfth {s}", f"this {s}'s run", f"{i} 13", f"{i.title()} #12", "(in " + "progress)",
           f"sixth {s}", f"the 8th {s}", f"{s} 3"]
    good = ["onnxruntime.InferenceSession", "sessions of onnxruntime", "tissue 12", "quality_issue13.json"]
    assert all(narration_probe(s) for s in bad)
    assert not any(narration_probe(s) for s in good)


def narration_probe(s: str) -> bool:
    return any(p.search(s) for p in NARRATION.values())


def test_docs_do_not_narrate_history():
    found = narration(narration_files(docs=True))
    assert not found, "history narrated in the documentation:\n" + "\n".join(found)


def test_code_does_not_narrate_history():
    found = narration(narration_files(docs=False))
    assert not found, f"history narrated in {len(found)} places in the code:\n" + "\n".join(found)


def test_readme_results_table_quotes_the_result_files():
    """The README's peers table quotes the generated results pages (which read bench/results/) exactly."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Results against the peers", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| tool")]
    peers = (ROOT / "docs" / "results" / "peers.md").read_text()
    quality = (ROOT / "docs" / "results" / "quality.md").read_text()
    assert rows
    for ln in rows:
        for ppl in re.findall(r"\b\d+\.\d{3}\b", ln):
            assert f"| {ppl} |" in peers, f"README figure {ppl} is not in docs/results/peers.md: {ln}"
        for size in re.findall(r"\b(\d+\.\d) MB\b", ln):
            assert f"| {size} |" in quality, f"README size {size} MB is not in docs/results/quality.md: {ln}"
