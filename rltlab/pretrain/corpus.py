"""Text sources of the embedded model: Python source files of the running interpreter, recorded
by content digest so a run can be reproduced and compared.

* the standard library (minus tests, IDLE and machine-specific files), split train / heldout by
  a stable hash of the relative path (3% held out);
* installed third-party packages (site-packages), all train, deduplicated by content (vendored
  copies appear once) and interleaved across packages, so that a byte budget samples every
  package rather than the first few large ones.

Everything is offline: the files are the interpreter's own. Which files they are depends on the
machine, so `corpus_manifest` records each source's file count, bytes and sha256 over the sorted
(path, file sha256) pairs, and the data is built once where the files are.
"""
from __future__ import annotations

import hashlib
import os
from collections import deque
import sysconfig
import zlib
from pathlib import Path

from rltlab.pretrain.tasks import _in_split

TEXT_HELDOUT_PERCENT = 3   # share of stdlib files held out for text loss
_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}  # not walked
# Files that are data rather than code (generated tables, minified blobs) would teach little.
_MAX_FILE_BYTES = 400_000
_MAX_LINE_CHARS = 400


def _python_files(root: Path) -> list[str]:
    """Relative paths of the .py files under root, sorted, minus tests / caches / nested
    site-packages and `_sysconfigdata*` (machine-specific)."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP and not d.startswith("config-")]
        rels += [Path(dirpath, f).relative_to(root).as_posix() for f in filenames
                 if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(rels)


def stdlib_source_files() -> list[Path]:
    """Sorted .py files of the running interpreter's stdlib, minus tests (huge, repetitive), IDLE,
    installed packages and `_sysconfigdata*` (machine-specific: the corpus would differ by host)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / rel for rel in _python_files(root)]


def _read(path: Path) -> str:
    # errors="replace": a stray non-UTF-8 byte must not break the corpus
    return path.read_text(encoding="utf-8", errors="replace")


def load_text_documents(max_bytes: int | None = None, split: str = "train") -> list[str]:
    """One string per stdlib file of `split` (~3% of files, by path hash, are "heldout"), up to
    max_bytes (UTF-8) in all. Files are ordered by a hash of their path, not alphabetically, so a
    max_bytes prefix samples the whole stdlib rather than only the modules 'a'..'m'."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [r for r in _python_files(root) if _in_split("text:" + r, TEXT_HELDOUT_PERCENT, split)]
    rels.sort(key=lambda r: (zlib.crc32(r.encode()), r))
    docs, total = [], 0
    for rel in rels:
        raw = _read(root / rel).encode("utf-8")
        if max_bytes is not None and total + len(raw) > max_bytes:
            if max_bytes > total:  # cut the last file at a character boundary
                docs.append(raw[: max_bytes - total].decode("utf-8", errors="ignore"))
            break
        docs.append(raw.decode("utf-8"))
        total += len(raw)
    return docs


def load_text_corpus(max_bytes: int | None = None, split: str = "train") -> str:
    """The documents of `load_text_documents` joined by blank lines."""
    return "\n\n".join(load_text_documents(max_bytes, split))


def site_packages_roots() -> list[Path]:
    """The interpreter's site-packages folders (purelib and platlib, once each)."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths[k]).resolve() for k in ("purelib", "platlib")
                   if Path(paths[k]).is_dir()})


def _looks_like_code(text: str) -> bool:
    lines = text.splitlines()
    return bool(lines) and max(map(len, lines)) <= _MAX_LINE_CHARS


def load_package_documents(max_bytes: int, roots: list[Path] | None = None
                           ) -> tuple[list[str], dict]:
    """Up to max_bytes of installed packages' Python source: (documents, manifest).

    Files are grouped by top-level package, ordered within a package by a hash of the path,
    and taken round-robin across packages (sorted by name) until the budget is spent, so a large
    package cannot crowd out the rest. Files over 400 KB or with lines over 400 characters
    (generated tables, minified data) are skipped, and so is any content seen before (vendored
    copies). The manifest lists, per package, the files taken and a sha256 over their sorted
    (relative path, content sha256) pairs, plus the same digest over everything."""
    roots = site_packages_roots() if roots is None else roots
    packages: dict[str, list[tuple[Path, str]]] = {}
    for root in roots:
        for rel in _python_files(root):
            packages.setdefault(rel.split("/")[0].removesuffix(".py"), []).append((root, rel))
    queues = {name: deque(sorted(files, key=lambda f: (zlib.crc32(f[1].encode()), f[1])))
              for name, files in sorted(packages.items())}
    docs, taken, seen, total = [], {}, set(), 0
    while queues and total < max_bytes:
        for name in list(queues):
            if not queues[name]:
                del queues[name]
                continue
            root, rel = queues[name].popleft()
            path = root / rel
            if path.stat().st_size > _MAX_FILE_BYTES:
                continue
            text = _read(path)
            digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
            if digest in seen or not _looks_like_code(text):
                continue
            seen.add(digest)
            docs.append(text)
            taken.setdefault(name, []).append((rel, digest))
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                break
    manifest = {"roots": [str(r) for r in roots], "files": len(docs), "bytes": total,
                "sha256": _digest(pair for files in taken.values() for pair in files),
                "packages": {name: {"files": len(files), "sha256": _digest(files)}
                             for name, files in sorted(taken.items())}}
    return docs, manifest


def stdlib_manifest(split: str = "train") -> dict:
    """Files, bytes and sha256 over (relative path, content sha256) of the stdlib split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pairs = []
    for rel in _python_files(root):
        if _in_split("text:" + rel, TEXT_HELDOUT_PERCENT, split):
            pairs.append((rel, hashlib.sha256(_read(root / rel).encode("utf-8")).hexdigest()))
    return {"root": str(root), "files": len(pairs), "sha256": _digest(pairs)}


def _digest(pairs) -> str:
    h = hashlib.sha256()
    for rel, digest in sorted(pairs):
        h.update(f"{rel}\0{digest}\n".encode("utf-8"))
    return h.hexdigest()
