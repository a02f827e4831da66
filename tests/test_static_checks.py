"""Names the code uses but never defines: pyflakes over the package (rltlab, kernels,
engine_patches), and the test files. Such a name fails only when its
line runs, which for GPU-only paths is never on this machine (the W1 bench's round_profile
raised NameError on CUDA for a day before pyflakes found it)."""
from pathlib import Path

import pytest
from pyflakes import api, messages, reporter

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["rltlab", "kernels", "engine_patches", "tests"]
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class Collect(reporter.Reporter):
    def __init__(self):
        self.found = []

    def flake(self, message):
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")


def undefined_names(paths) -> list[str]:
    collect = Collect()
    for path in paths:
        api.checkPath(str(path), collect)
    return collect.found


@pytest.mark.parametrize("folder", CHECKED)
def test_no_undefined_names(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"{folder}: no Python files (moved?)"
    assert undefined_names(files) == []


def test_the_check_finds_an_undefined_name(tmp_path):
    """The check itself can fail: a name read in a function but defined only in another."""
    bad = tmp_path / "bad.py"
    bad.write_text("def pick():\n    token = 1\n    return token\n\n\n"
                   "def report():\n    return token\n")
    found = undefined_names([bad])
    assert len(found) == 1 and "undefined name 'token'" in found[0]
