"""Tier 1: the repository's shape, as its pages promise it.

- ``benchmarks/`` holds at most 300 files and 8 MB: the files the pages and the code cite, the DeepEP anchors
  (``benchmarks/anchors/``) and the model's check (``benchmarks/model/``). Raw runs no document cites stay out of
  the tree (git history keeps them). In a git checkout the files counted are the tracked ones; in a source archive
  without ``.git``, the files on disk.
- BENCHMARKS.md is at most 300 lines.
- README.md, BENCHMARKS.md, docs/*.md and the READMEs under benchmarks/ carry no work-log labels (session numbers
  such as ``s14``, ``call 2``, lanes), and no file or folder name under benchmarks/ does.
- Every ``benchmarks/...`` path that README.md, BENCHMARKS.md or docs/*.md cite exists.
"""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_FILES = 300
MAX_BYTES = 8_000_000
MAX_BENCHMARKS_LINES = 300
LABEL = re.compile(r"\b(s[0-9]{1,2}|call ?[0-9]|lanes?)\b")
LABEL_IN_NAME = re.compile(r"(^|[-_.])(s[0-9]{1,2}|call[0-9]*|lanes?)([-_.]|$)")
CITED = re.compile(r"benchmarks/[A-Za-z0-9_./-]+")
KEPT_BY_RULE = ("anchors", "model")  # benchmarks/<these>/ stay whether cited or not


def _pages(root: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in (root / "README.md", root / "BENCHMARKS.md", *sorted((root / "docs").glob("*.md")))
            if p.is_file()]


def _git_root(root: pathlib.Path) -> bool:
    """Whether ``root`` is the top of a git checkout (a source archive without .git is not)."""
    if not (root / ".git").exists() or shutil.which("git") is None:
        return False
    top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], check=False, capture_output=True,
                         text=True)
    return top.returncode == 0 and pathlib.Path(top.stdout.strip()).resolve() == root.resolve()


def benchmark_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The files of ``root/benchmarks``: git's tracked ones in a checkout, else those on disk."""
    if _git_root(root):
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", "benchmarks"],
                             capture_output=True, check=True).stdout.decode()
        return sorted(root / p for p in out.split("\0") if p and (root / p).is_file())
    return sorted(p for p in (root / "benchmarks").rglob("*") if p.is_file())


def cited_paths(text: str) -> set[str]:
    """``benchmarks/...`` paths in ``text``, without the punctuation that may end a sentence."""
    return {m.rstrip(".,;:") for m in CITED.findall(text)}


def problems(root: pathlib.Path) -> list[str]:
    """Every way ``root`` breaks the rules of the module docstring, one line each (empty: none)."""
    out = []
    files = benchmark_files(root)
    if len(files) > MAX_FILES:
        out.append(f"benchmarks/ holds {len(files)} files, more than {MAX_FILES}")
    size = sum(p.stat().st_size for p in files)
    if size > MAX_BYTES:
        out.append(f"benchmarks/ holds {size} bytes, more than {MAX_BYTES}")
    bench_md = root / "BENCHMARKS.md"
    if bench_md.is_file():
        lines = len(bench_md.read_text(encoding="utf-8").splitlines())
        if lines > MAX_BENCHMARKS_LINES:
            out.append(f"BENCHMARKS.md has {lines} lines, more than {MAX_BENCHMARKS_LINES}")
    readmes = [p for p in files if p.name == "README.md"]
    for page in _pages(root) + readmes:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in LABEL.finditer(line):
                out.append(f"{page.relative_to(root)}:{n}: work-log label {m.group(0)!r}")
    for p in files:
        for part in p.relative_to(root / "benchmarks").parts:
            if LABEL_IN_NAME.search(part):
                out.append(f"benchmarks/ name {part!r} (in {p.relative_to(root)}) is a work-log label")
    page_text = "\n".join(p.read_text(encoding="utf-8") for p in _pages(root))
    for cited in sorted(cited_paths(page_text)):
        if not (root / cited).exists():
            out.append(f"{cited} is cited but does not exist")
    code = [*root.glob("src/**/*.py"), *root.glob("tests/**/*.py"), *root.glob("scripts/*")]
    every = cited_paths(page_text + "\n".join(p.read_text(encoding="utf-8", errors="replace")
                                              for p in code if p.is_file()))
    every = {c.rstrip("/") for c in every}
    for p in files:
        parts = p.relative_to(root).parts
        if len(parts) < 3 or parts[1] in KEPT_BY_RULE or p.name == "README.md":
            continue
        # the file, or a folder it sits in below benchmarks/<date>/, is cited somewhere
        if not any("/".join(parts[:i]) in every for i in range(3, len(parts) + 1)):
            out.append(f"{p.relative_to(root)} is cited by no page, module or test")
    return out


def test_repository_shape():
    assert problems(ROOT) == []


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_a_clean_archive_without_git_passes(tmp_path):
    root = _tree(tmp_path, {
        "README.md": "Figures: BENCHMARKS.md.\n",
        "BENCHMARKS.md": "Rows: [JSONL](benchmarks/2026-11-28/h200x2-ll.jsonl), "
                         "[logs](benchmarks/2026-11-28/h100-tier3/).\n",
        "docs/model.md": "![plot](../benchmarks/model/plot.png)\n",
        "benchmarks/2026-11-28/h200x2-ll.jsonl": "{}\n",
        "benchmarks/2026-11-28/h100-tier3/ht.log": "passed\n",
        "benchmarks/model/plot.png": "png",
        "benchmarks/anchors/deepep.log": "uncited, kept by rule\n",
        "benchmarks/README.md": "index\n",
    })
    assert not _git_root(root)
    assert len(benchmark_files(root)) == 5
    assert problems(root) == []


def test_each_rule_fails_on_its_break(tmp_path):
    files = {
        "README.md": "See benchmarks/2026-11-28/gone.jsonl.\n",
        "BENCHMARKS.md": "".join(f"row {i}: benchmarks/2026-11-28/many/\n" for i in range(MAX_BENCHMARKS_LINES)) +
                         "as s14 call 3 found in lane 0\n",
        "docs/v2.md": "fine\n",
        "benchmarks/2026-11-28/s14/call2-13e3a4b/w2.jsonl": "{}\n",
        "benchmarks/2026-11-28/uncited.jsonl": "{}\n",
        "benchmarks/2026-11-28/big.bin": "x" * (MAX_BYTES + 1),
    }
    files.update({f"benchmarks/2026-11-28/many/{i}.log": "" for i in range(MAX_FILES)})
    found = "\n".join(problems(_tree(tmp_path, files)))
    for expected in (f"holds {MAX_FILES + 3} files", "bytes, more than", f"{MAX_BENCHMARKS_LINES + 1} lines",
                     "label 's14'", "label 'call 3'", "label 'lane'", "name 's14'", "name 'call2-13e3a4b'",
                     "benchmarks/2026-11-28/gone.jsonl is cited but does not exist",
                     "benchmarks/2026-11-28/uncited.jsonl is cited by no page"):
        assert expected in found, (expected, found)
