"""File permissions the tests expect of what rltlab writes."""
import stat
from pathlib import Path

from rltlab.common.atomic import process_umask


def assert_umask_permissions(path) -> None:
    """path (and, for a directory, everything in it) as mkdir() and open() make them under the
    process umask, not tempfile's private 0700 / 0600."""
    path, umask = Path(path), process_umask()
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        expected = (0o777 if p.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(p.stat().st_mode) == expected, (p, oct(p.stat().st_mode))
