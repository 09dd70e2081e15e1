"""One http(s) fetch's lifetime: its deadline over every socket it opens, and the group of fetches ended together.

Owns: shutting down a fetch's sockets when its deadline passes or its group is abandoned (a socket timeout alone
restarts at every byte of a slow drip), and the thread-local group a reading thread's fetches join. Does not own
the fetch rules or the reading (`fetch.py`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mmserve.errors import MediaError

if TYPE_CHECKING:
    from mmserve.preprocess.fetch import HttpFetcher


def current_group() -> FetchGroup | None:
    """The group the fetches this thread starts join, if any."""
    return getattr(_GROUP, "current", None)


class FetchGroup:
    """Fetches abandoned together: a prompt's other images once one is refused (or its reader left), so that a
    cheap 400 leaves no reads running to their deadline. Fetches started on a thread inside `joined()` join it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fetches: list[OneFetch] = []
        self._abandoned = False

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        _GROUP.current = self
        try:
            yield
        finally:
            _GROUP.current = None

    def add(self, one: OneFetch) -> None:
        with self._lock:
            self._fetches.append(one)
            abandoned = self._abandoned
        if abandoned:
            one.expire()

    def abandon(self) -> None:
        """End every fetch of the group now (their sockets shut down; a later one ends at its first dial)."""
        with self._lock:
            self._abandoned = True
            fetches = list(self._fetches)
        for one in fetches:
            one.expire()


_GROUP = threading.local()  # the FetchGroup of the fetches this thread starts, if any



class OneFetch:
    """One fetch's deadline: every socket it opens is shut down when the deadline passes, so no slow
    drip, slow header or redirect chain outlives it (a socket timeout alone restarts at every byte)."""

    def __init__(self, fetcher: HttpFetcher, deadline: float) -> None:
        self.fetcher, self.deadline, self.expired = fetcher, deadline, False
        self.ended = threading.Event()  # set with `expired`: a resolution under way stops waiting
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []  # duplicates: TLS wrapping detaches the original object

    def connect(self, address: tuple[str, int], timeout: float | None = None,
                source_address: tuple[str, int] | None = None) -> socket.socket:
        if self.expired or time.monotonic() >= self.deadline:  # (a redirect hop after it: no new resolve)
            raise TimeoutError("fetch deadline passed")
        sock = self.fetcher.connect(address, timeout, source_address, deadline=self.deadline, ended=self.ended)
        with self._lock:
            try:
                if self.expired:
                    raise TimeoutError("fetch deadline passed")
                self._socks.append(sock.dup())  # NOTE: shutdown acts on the socket behind every descriptor
            except BaseException:
                sock.close()
                raise
        return sock

    def expire(self) -> None:
        self.ended.set()
        with self._lock:
            self.expired = True
            for sock in self._socks:
                with contextlib.suppress(OSError):  # already closed by the other side
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            for sock in self._socks:
                sock.close()
            self._socks.clear()

    def timed_out(self, url: str) -> MediaError:
        return MediaError(f"fetching {url} failed: no complete answer within {self.fetcher.config.fetch_timeout_s} s "
                          "(connect, redirects, headers and body together)")
