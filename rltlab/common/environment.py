"""The hardware and software facts stamped into metrics and benchmark JSON."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def environment() -> dict[str, Any]:
    """Hardware/dtype facts to stamp into metrics.json."""
    return {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cuda": torch.cuda.is_available(),
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads()}


def git_commit() -> str | None:
    """The commit the code runs at: $RLTLAB_COMMIT where set (a copy of the tree without its
    .git, e.g. on a lent GPU machine), else `git rev-parse HEAD` of the checkout, with
    "-dirty" when tracked files differ from it; None outside a checkout."""
    if os.environ.get("RLTLAB_COMMIT"):
        return os.environ["RLTLAB_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root,
                               capture_output=True, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")
