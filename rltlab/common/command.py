"""How every `python -m rltlab...` command ends on a missing input: one line, not a traceback."""
from __future__ import annotations

import sys
from typing import Callable, TypeVar

T = TypeVar("T")


def run_command(main: Callable[[], T]) -> T:
    """Run a command's main() and return what it returns. A missing checkpoint, heads
    directory or input file (FileNotFoundError, NotADirectoryError: the loaders name the path
    and what is missing) ends the command with one "error: ..." line on stderr and exit status
    2, as argparse does for a bad option. Every other exception keeps its traceback: it is a
    bug, not bad input. Only for `__main__`: library callers of main() get the exception."""
    try:
        return main()
    except (FileNotFoundError, NotADirectoryError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
