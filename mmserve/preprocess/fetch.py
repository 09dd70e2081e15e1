"""http(s) image fetches a public endpoint can afford: one deadline, a byte cap, public hosts only.

Owns: the URL rules (scheme, no user info, no backslash or control characters, the domain allowlist),
the address check on every connection (also each redirect hop's), dialling the checked address, at most
`MAX_REDIRECTS` redirects, the byte cap, name resolution bounded by the fetch's deadline, and the reading. Does
not own: a fetch's deadline over its sockets and its group (`fetch_lifetime.py`), `data:` and `file:` URLs or
decoding (`media.py`, `image_decode.py`).

Every refusal is an `UnsupportedURLError` (a source we refuse to read) or a `MediaError` (a source that
did not give us an image in time).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import ipaddress
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from mmserve.config import MediaConfig
from mmserve.errors import InvalidRequestError, MediaError, OverloadedError, UnsupportedURLError
from mmserve.preprocess.fetch_lifetime import OneFetch, current_group

log = logging.getLogger(__name__)
Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP address strings
Dialer = Callable[..., socket.socket]  # socket.create_connection's signature

MAX_REDIRECTS = 5
MAX_DIALS = 3  # addresses of one host tried in turn
MAX_RESOLVING = 256  # name resolutions under way in a process (a thread each); past it a fetch is a 503
_RESOLVING = threading.BoundedSemaphore(MAX_RESOLVING)
_CHUNK = 64 * 1024  # bytes per read
# NAT64 prefixes (RFC 6052, RFC 8215): the low 32 bits are an IPv4 address a gateway dials for us
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def default_resolver(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6). NOTE: the C resolver also reads the other
    spellings of an IPv4 literal (2130706433, 0177.0.0.1, 0x7f.1, 127.1), so they are checked as what
    they dial."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def is_public_address(ip: str) -> bool:
    """False for loopback, private, link-local, multicast, reserved, unspecified and other non-global
    addresses, also when an IPv6 address carries one inside (IPv4-mapped, 6to4, Teredo, NAT64)."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])  # drop an IPv6 scope id
    inner: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [addr]
    if isinstance(addr, ipaddress.IPv6Address):
        inner += [a for a in (addr.ipv4_mapped, addr.sixtofour, *(addr.teredo or ())) if a is not None]
        if any(addr in net for net in _NAT64):
            inner.append(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    return not any(a.is_loopback or a.is_private or a.is_link_local or a.is_multicast or a.is_reserved
                   or a.is_unspecified or not a.is_global for a in inner)


class HttpFetcher:
    """Fetches http(s) URLs for one engine; `resolver` and `dial` are injectable for tests."""

    def __init__(self, config: MediaConfig, *, resolver: Resolver = default_resolver,
                 dial: Dialer = socket.create_connection) -> None:
        self.config = config
        self._resolver = resolver
        self._dial = dial

    def check_url(self, url: str) -> None:
        """The URL rules, for the first URL and every redirect target; addresses are checked on connect.

        NOTE: user info and backslashes are refused outright: parsers disagree on where such a host
        ends, and an allowlist read by one parser while another one dials is how allowlists get bypassed.
        """
        if any(c == "\\" or ord(c) <= 0x20 or ord(c) >= 0x7F for c in url):
            raise UnsupportedURLError("URL contains a backslash, a space, a control or a non-ASCII character "
                                      "(percent-encode the path, punycode the host)")
        parts = split_url(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise UnsupportedURLError(f"redirect to scheme {parts.scheme!r} is not allowed")
        if "@" in parts.netloc:
            raise UnsupportedURLError("URLs with user info (user@host) are not allowed")
        self.check_host(parts.hostname or "")

    def check_host(self, host: str) -> None:
        host = host.rstrip(".").lower()
        if not host:
            raise UnsupportedURLError("URL has no host")
        allowed = self.config.allowed_domains
        if allowed is not None and not any(_host_matches(host, d) for d in allowed):
            raise UnsupportedURLError(f"host {host!r} is not in the allowed domains")

    def connect(self, address: tuple[str, int], timeout: float | None = None,
                source_address: tuple[str, int] | None = None, *, deadline: float | None = None,
                ended: threading.Event | None = None) -> socket.socket:
        """Check the host actually dialled, resolve, refuse non-public addresses, dial the checked address
        (at most `MAX_DIALS` of them, each with what is left of `deadline`, a monotonic time).

        NOTE: dialling the checked IP (not the host name again) closes the DNS-rebinding gap between the
        check and the connection; TLS still verifies the certificate against the host.
        """
        host, port = address
        self.check_host(host)
        # NOTE: one answer for a name that does not resolve and one that resolves inside: which one it was (and
        # the address) would tell a client the internal names and their addresses (logged here instead)
        refused = UnsupportedURLError(f"host {host!r} does not resolve to a public address")
        try:
            ips = self._resolve(host, port, deadline, ended)
        except TimeoutError:
            raise
        except OSError as err:
            log.info("image host %r does not resolve: %s", host, err)
            raise refused from None
        private = [ip for ip in ips if not is_public_address(ip)] if not self.config.allow_private_addresses else []
        if not ips or private:
            log.info("image host %r refused: it resolves to %s", host, private or "no address")
            raise refused
        last: OSError | None = None
        for ip in ips[:MAX_DIALS]:  # NOTE: a name with many dead addresses must not multiply the deadline
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("fetch deadline passed")
            budget = [t for t in (timeout, left) if t is not None]
            try:
                return self._dial((ip, port), min(budget) if budget else None, source_address)
            except OSError as err:
                last = err
        raise last or OSError(f"cannot connect to {host!r}")

    def _resolve(self, host: str, port: int, deadline: float | None, ended: threading.Event | None) -> list[str]:
        """The resolver's answer, waited for until `deadline` at most, or until `ended` is set (TimeoutError).

        NOTE: `getaddrinfo` cannot be interrupted and runs under the system resolver's own timeouts (a
        nameserver that never answers holds it for tens of seconds): it runs on a thread of its own, which the
        fetch stops waiting for at its deadline. A thread each, not a shared pool: a few names that never
        resolve would hold a pool's every thread, and every other fetch of the process would wait behind them.
        """
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("fetch deadline passed before resolving the host")
        slots = _RESOLVING  # NOTE: the one acquired is the one released, whatever the module's name holds then
        if not slots.acquire(blocking=False):  # NOTE: each is a thread until the system resolver gives up
            raise OverloadedError(f"more than {MAX_RESOLVING} host names are being resolved at once; retry later")
        future: concurrent.futures.Future[list[str]] = concurrent.futures.Future()

        def resolve() -> None:
            try:
                future.set_result(self._resolver(host, port))
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                slots.release()

        try:
            threading.Thread(target=resolve, name="mmserve-resolve", daemon=True).start()
        except RuntimeError as exc:  # "can't start new thread": the process is out of threads
            slots.release()
            raise OverloadedError(f"cannot resolve a host name now ({exc}); retry later") from None
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # NOTE: in slices when the fetch may be ended early (its prompt's other image refused)
            wait = left if ended is None else (0.05 if left is None else min(left, 0.05))
            try:
                return future.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                over = deadline is not None and time.monotonic() >= deadline
                if over or (ended is not None and ended.is_set()):
                    raise TimeoutError("fetch ended while resolving the host") from None

    def fetch(self, url: str) -> bytes:
        self.check_url(url)
        timeout = self.config.fetch_timeout_s
        one = OneFetch(self, time.monotonic() + timeout)
        group = current_group()
        if group is not None:
            group.add(one)
        request = urllib.request.Request(url, headers={"User-Agent": "mmserve", "Accept": "image/*"})
        timer = threading.Timer(timeout, one.expire)
        timer.daemon = True
        timer.start()
        try:
            return self._read(one, request)
        except InvalidRequestError:  # our own refusals (a redirect target, the byte cap) as they are
            raise
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:  # UnicodeError too
            if isinstance(err, urllib.error.HTTPError):
                err.close()  # NOTE: it holds the answer's socket, open for as long as the error (our cause) lives
            if one.expired or time.monotonic() >= one.deadline:  # (the timer may not have fired yet)
                raise one.timed_out(url) from err
            raise _failure(url, err) from err
        finally:
            timer.cancel()
            one.close()

    def _read(self, one: OneFetch, request: urllib.request.Request) -> bytes:
        cap = self.config.max_image_bytes
        with _build_opener(one).open(request, timeout=self.config.fetch_timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > cap:
                raise MediaError(f"image is {int(length)} bytes, more than the {cap}-byte limit")
            data = _read_capped(response, cap)
        if one.expired:  # the deadline cut the body short: what we have is not the image
            raise one.timed_out(request.full_url)
        return data


def _failure(url: str, err: BaseException) -> MediaError:
    if isinstance(err, urllib.error.HTTPError):
        if 300 <= err.code < 400:
            return MediaError(f"fetching {url} failed: more than {MAX_REDIRECTS} redirects")
        return MediaError(f"fetching {url} failed: HTTP {err.code}")
    if isinstance(err, urllib.error.URLError):
        return MediaError(f"fetching {url} failed: {err.reason}")
    return MediaError(f"fetching {url} failed: {err!r}")  # timeouts, resets, bad responses


def split_url(url: str) -> urllib.parse.SplitResult:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as err:
        raise UnsupportedURLError(f"malformed URL: {err}") from err
    return parts


def _host_matches(host: str, domain: str) -> bool:
    domain = domain.strip(".").lower()
    return host == domain or host.endswith("." + domain)


def _read_capped(stream: http.client.HTTPResponse, cap: int) -> bytes:
    """Read until EOF; stop past `cap` bytes."""
    chunks: list[bytes] = []
    total = 0
    while chunk := stream.read(_CHUNK):
        total += len(chunk)
        if total > cap:
            raise MediaError(f"image is more than the {cap}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


class _GuardedRedirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def __init__(self, fetcher: HttpFetcher) -> None:
        self._fetcher = fetcher

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self._fetcher.check_url(newurl)  # newurl is absolute here
        return super().redirect_request(req, fp, code, msg, headers, newurl)

    def http_error_302(self, req, fp, code, msg, headers):
        # NOTE: check before urllib's own scheme test, so file:/ftp: targets raise UnsupportedURLError.
        target = headers.get("location") or headers.get("uri")
        if target:
            self._fetcher.check_url(urllib.parse.urljoin(req.full_url, target))
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _guarded(base: type[http.client.HTTPConnection], one: OneFetch) -> Any:
    """A connection factory whose sockets come from `one.connect` (deadline, check, resolve, dial)."""
    def make(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
        conn = base(*args, **kwargs)
        conn._create_connection = one.connect  # type: ignore[attr-defined]
        return conn
    return make


class _GuardedHTTP(urllib.request.HTTPHandler):
    def __init__(self, one: OneFetch) -> None:
        super().__init__()
        self._make = _guarded(http.client.HTTPConnection, one)

    def http_open(self, req):
        return self.do_open(self._make, req)


class _GuardedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, one: OneFetch) -> None:
        super().__init__()
        self._make = _guarded(http.client.HTTPSConnection, one)

    def https_open(self, req):
        return self.do_open(self._make, req)


def _build_opener(one: OneFetch) -> urllib.request.OpenerDirector:
    """Only the handlers we need. NOTE: no ProxyHandler, so environment proxies are ignored."""
    opener = urllib.request.OpenerDirector()
    for handler in (_GuardedHTTP(one), _GuardedHTTPS(one), _GuardedRedirects(one.fetcher),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor(),
                    urllib.request.UnknownHandler()):
        opener.add_handler(handler)
    return opener
