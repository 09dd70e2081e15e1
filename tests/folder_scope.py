"""Session resources of one test folder (a served app, a local Ray cluster), released as soon as that
folder's last test has run instead of at the session's end.

NOTE: an idle mmserve keeps a good part of a core busy (Ray's processes polling; docs/benchmarks.md): left up until
the session ends, the e2e server and the integration cluster would take that from every test after them.
pytest's `package` scope does not help here: these folders are not packages, and for them it lasts the
session. A folder's tests run one after another (collection order), so the test after its last one is
the first that is not in it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


class FolderScope:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._stops: list[Callable[[], None]] = []

    def hold(self, stop: Callable[[], None]) -> Callable[[], None]:
        """Register `stop` (run once, whoever calls it first: this scope or the fixture's own teardown)."""
        done = False

        def once() -> None:
            nonlocal done
            if not done:
                done = True
                stop()

        self._stops.append(once)
        return once

    def after(self, nextitem: pytest.Item | None) -> None:
        """Call from the folder's `pytest_runtest_teardown`: past its last test, stop what it holds (last
        started, first stopped)."""
        if nextitem is not None and self.folder in nextitem.path.parents:
            return
        while self._stops:
            self._stops.pop()()
