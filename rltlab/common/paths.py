"""Where the project's shipped artifacts live."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS_DIR = REPO_ROOT / "artifacts"


def embedded_model_dir() -> Path:
    """The embedded default model (artifacts/ouro-tiny); RLTLAB_EMBEDDED_MODEL overrides it."""
    override = os.environ.get("RLTLAB_EMBEDDED_MODEL")
    path = Path(override) if override else ARTIFACTS_DIR / "ouro-tiny"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"embedded model not found at {path}: run from a full clone of rltlab (the model "
            "ships under artifacts/ouro-tiny) or set RLTLAB_EMBEDDED_MODEL")
    return path
