"""fetch.py: http(s) fetches: one deadline over the whole fetch, the address check on every hop
however the address is spelled, the URL rules, the byte cap, parallel reads of one prompt."""

from __future__ import annotations

import socket
import threading
import time
import typing
import urllib.error
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mmserve.config import MediaConfig
from mmserve.errors import MediaError, UnsupportedURLError
from mmserve.preprocess.fetch import default_resolver, is_public_address
from mmserve.preprocess.media import MediaLoader
from tests.unit.preprocess.test_media import PNG


class _SlowReads:
    """How many /slow answers the server was writing at once, at most (the client's parallelism, counted)."""

    def __init__(self) -> None:
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.now -= 1


SLOW_READS = _SlowReads()
DRIPS_READ_TO_THE_END: list[str] = []  # a /drip-counted answer each, whose client read on to its last byte


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # no keep-alive; a body without Content-Length ends at close

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path, port = self.path, typing.cast(tuple[str, int], self.server.server_address)[1]
        if path == "/img.png":
            self._send(200, PNG)
        elif path.startswith("/redirect/"):
            hops = int(path.rsplit("/", 1)[1])
            self._redirect("/img.png" if hops == 0 else f"/redirect/{hops - 1}")
        elif path == "/to-internal":
            self._redirect(f"http://internal.test:{port}/img.png")
        elif path == "/to-loopback":
            self._redirect(f"http://127.0.0.1:{port}/img.png")
        elif path == "/to-file":
            self._redirect("file:///etc/passwd")
        elif path == "/big":
            self._send(200, b"\0" * 50_000)
        elif path == "/big-no-length":
            self._send(200, b"\0" * 50_000, length=False)
        elif path == "/slow":
            time.sleep(1.0)
            self._send(200, PNG)
        elif path == "/slow-counted":  # /slow, counted in SLOW_READS (other tests' late /slow reads are not)
            with SLOW_READS:
                time.sleep(1.0)
            self._send(200, PNG)
        elif path.startswith("/to?u="):  # a redirect to any target
            self._redirect(urllib.parse.unquote(path[len("/to?u="):]))
        elif path.startswith("/slow-redirect/"):  # each hop answers within a socket timeout, all of them do not
            time.sleep(0.3)
            hops = int(path.rsplit("/", 1)[1])
            self._redirect("/img.png" if hops == 0 else f"/slow-redirect/{hops - 1}")
        elif path in ("/drip", "/slow-headers", "/drip-counted"):
            self._drip(path != "/slow-headers", counted=path == "/drip-counted")
        else:
            self._send(404, b"no")

    def _drip(self, body: bool, counted: bool = False) -> None:
        """A byte (or a header line) every 50 ms for 3 s: every read succeeds well within any timeout.
        `counted`: one more in DRIPS_READ_TO_THE_END as its last byte goes (before it: its reader cannot end first)."""
        try:
            self.send_response(200)
            if body:
                self.send_header("Content-Length", "60")
                self.end_headers()
            self.flush_headers()  # the status line (and headers so far) go out now
            for i in range(60):
                time.sleep(0.05)
                if counted and i == 59:
                    DRIPS_READ_TO_THE_END.append(self.path)
                self.wfile.write(b"\0" if body else f"X-Slow-{i}: 1\r\n".encode())
                self.wfile.flush()
        except OSError:
            pass  # the client gave up, as it should

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.end_headers()

    def _send(self, code: int, body: bytes, length: bool = True) -> None:
        self.send_response(code)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def local(**kw: object) -> MediaLoader:
    return MediaLoader(MediaConfig(allow_private_addresses=True, **kw))  # type: ignore[arg-type]


def test_fetch_from_local_server(port: int) -> None:
    assert local().load(f"http://127.0.0.1:{port}/img.png").size == (12, 8)


def test_loopback_is_refused_without_the_test_flag(port: int) -> None:
    for host in ("127.0.0.1", "localhost"):
        with pytest.raises(UnsupportedURLError, match="does not resolve to a public address"):
            MediaLoader(MediaConfig()).load(f"http://{host}:{port}/img.png")


def test_a_resolver_that_never_answers_ends_at_the_fetch_deadline() -> None:
    released = threading.Event()

    def stuck(host: str, port: int) -> list[str]:  # an attacker's nameserver that never answers
        released.wait(10)
        return ["8.8.8.8"]

    start = time.monotonic()
    try:
        with pytest.raises(MediaError, match=r"no complete answer within 0\.3 s"):
            MediaLoader(MediaConfig(fetch_timeout_s=0.3), resolver=stuck).load("http://slow-dns.test/img.png")
        assert time.monotonic() - start < 5.0  # NOTE: not the resolver's 10 s; room for a loaded machine
    finally:
        released.set()


def test_names_that_never_resolve_hold_up_no_other_fetch_and_end_with_their_prompt(port: int) -> None:
    released = threading.Event()

    def resolve(host: str, port: int) -> list[str]:
        if host == "stuck.test":  # an attacker's nameserver that never answers
            released.wait(30)
        return ["8.8.8.8"]

    def dial(address: tuple[str, int], *args: object) -> socket.socket:
        return socket.create_connection(("127.0.0.1", address[1]), *args)  # type: ignore[arg-type]

    loader = MediaLoader(MediaConfig(fetch_timeout_s=0.2), resolver=resolve, dial=dial)
    try:
        for _ in range(16):
            with pytest.raises(MediaError, match="no complete answer"):
                loader.load(f"http://stuck.test:{port}/img.png")
        # NOTE: not behind the stuck ones: behind them it would have met its 0.2 s deadline and raised
        assert loader.load(f"http://public.test:{port}/img.png").size == (12, 8)
        # a prompt whose first image is refused: its other image, still resolving, is let go at once
        slow = MediaLoader(MediaConfig(fetch_timeout_s=10), resolver=resolve, dial=dial)
        start = time.monotonic()
        with pytest.raises(MediaError, match="image 1"):
            list(slow.read_all(["data:text/plain,x", f"http://stuck.test:{port}/img.png"]))
        while any(t.name.startswith("media") for t in threading.enumerate()) and time.monotonic() - start < 5:
            time.sleep(0.02)
        assert time.monotonic() - start < 5.0, "the resolving fetch waited on to its 10 s deadline"
    finally:
        released.set()


def test_past_the_resolutions_under_way_a_fetch_is_told_to_come_back_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each resolution is a thread until the system resolver gives up: their number is bounded (a 503)."""
    from mmserve.errors import OverloadedError
    from mmserve.preprocess import fetch

    monkeypatch.setattr(fetch, "_RESOLVING", threading.BoundedSemaphore(1))
    fetch._RESOLVING.acquire()  # the one slot is held (a name that never resolves)

    def resolve(host: str, port: int) -> list[str]:
        raise AssertionError("resolved past the bound")  # NOTE: and never dials out

    with pytest.raises(OverloadedError, match="being resolved at once"):
        MediaLoader(MediaConfig(), resolver=resolve).load("http://any.test/img.png")


def test_a_name_that_does_not_resolve_is_answered_as_an_internal_one_is() -> None:
    """Which of the two it was (and the address) would map a network's internal names for a client."""
    table = {"internal.test": ["10.1.2.3"]}

    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]

    loader = MediaLoader(MediaConfig(), resolver=resolve)
    answers = []
    for host in ("internal.test", "nowhere.test"):
        with pytest.raises(UnsupportedURLError) as info:
            loader.load(f"http://{host}/img.png")
        answers.append(str(info.value).replace(host, "HOST"))
    assert answers[0] == answers[1] and "10.1.2.3" not in answers[0]


def test_domain_allowlist(port: int) -> None:
    with pytest.raises(UnsupportedURLError, match="not in the allowed domains"):
        local(allowed_domains=("example.com",)).load(f"http://127.0.0.1:{port}/img.png")
    with pytest.raises(UnsupportedURLError, match="not in the allowed domains"):
        local(allowed_domains=("example.com",)).load("http://evilexample.com/img.png")


def _fake_public(allowed: tuple[str, ...] | None = None) -> MediaLoader:
    """public.test 'resolves' to 8.8.8.8 (dialled to our server); internal.test to loopback."""
    table = {"public.test": ["8.8.8.8"], "internal.test": ["127.0.0.1"]}

    def resolve(host: str, port: int) -> list[str]:
        return table.get(host) or default_resolver(host, port)  # IP literals: what the C resolver reads

    def dial(address: tuple[str, int], *args: object) -> object:
        assert address[0] == "8.8.8.8", f"dialled a refused address {address}"
        import socket
        return socket.create_connection(("127.0.0.1", address[1]), *args)  # type: ignore[arg-type]

    return MediaLoader(MediaConfig(allowed_domains=allowed), resolver=resolve, dial=dial)  # type: ignore[arg-type]


def test_public_to_private_redirect_is_refused(port: int) -> None:
    loader = _fake_public()
    assert loader.load(f"http://public.test:{port}/img.png").size == (12, 8)  # control
    with pytest.raises(UnsupportedURLError, match=r"internal\.test.*does not resolve to a public address"):
        loader.load(f"http://public.test:{port}/to-internal")
    with pytest.raises(UnsupportedURLError, match=r"does not resolve to a public address"):
        loader.load(f"http://public.test:{port}/to-loopback")
    with pytest.raises(UnsupportedURLError, match="not in the allowed domains"):
        _fake_public(("public.test",)).load(f"http://public.test:{port}/to-loopback")


def test_redirect_limit_and_scheme(port: int) -> None:
    assert local().load(f"http://127.0.0.1:{port}/redirect/4").size == (12, 8)  # 5 redirects
    with pytest.raises(MediaError, match="redirects"):
        local().load(f"http://127.0.0.1:{port}/redirect/5")  # 6 redirects
    with pytest.raises(UnsupportedURLError, match="scheme 'file'"):
        local().load(f"http://127.0.0.1:{port}/to-file")


@pytest.mark.parametrize("path", ["/big", "/big-no-length"])
def test_byte_cap_on_fetch(port: int, path: str) -> None:
    with pytest.raises(MediaError, match="byte limit"):
        local(max_image_bytes=10_000).load(f"http://127.0.0.1:{port}{path}")


def test_http_errors_and_timeouts(port: int) -> None:
    with pytest.raises(MediaError, match="HTTP 404") as refused:
        local().load(f"http://127.0.0.1:{port}/nothing")
    cause = refused.value.__cause__
    while cause is not None and not isinstance(cause, urllib.error.HTTPError):
        cause = cause.__cause__
    assert cause is not None and cause.fp.closed  # NOTE: not the answer's socket held for as long as the error lives
    start = time.monotonic()
    with pytest.raises(MediaError, match="image 1: fetching"):
        local(fetch_timeout_s=0.2).load(f"http://127.0.0.1:{port}/slow")
    assert time.monotonic() - start < 0.9


def test_a_prompts_images_are_read_in_parallel_and_in_order(port: int) -> None:
    slow, fast = f"http://127.0.0.1:{port}/slow-counted", f"http://127.0.0.1:{port}/img.png"  # 1 s, and 0
    SLOW_READS.most = 0
    loader = local()
    images = [loader.decode(data, i) for i, data in enumerate(loader.read_all([slow, fast, slow, slow]), 1)]
    assert [im.size for im in images] == [(12, 8)] * 4
    assert SLOW_READS.most == 3  # the three slow reads at once, not one after another
    with pytest.raises(MediaError, match=r"image 2: .*HTTP 404"):  # the first refusal in prompt order
        list(local().read_all([fast, f"http://127.0.0.1:{port}/nothing", f"http://127.0.0.1:{port}/nope"]))


def test_a_refused_image_ends_its_prompts_other_fetches_at_once(port: int) -> None:
    """A cheap 400 must not leave the prompt's other reads running to their deadline (threads, sockets)."""
    drip = f"http://127.0.0.1:{port}/drip-counted"  # a byte every 50 ms for 3 s
    before = len(DRIPS_READ_TO_THE_END)
    start = time.monotonic()
    with pytest.raises(MediaError, match="image 1"):
        list(local(fetch_timeout_s=10).read_all(["data:text/plain,x", drip, drip, drip]))
    assert time.monotonic() - start < 1.0  # answered at once, not after the drips (3 s)
    assert_reads_end(before)


def assert_reads_end(drips_before: int) -> None:
    """The prompt's read threads end without reading their drips to the end (counted at the server)."""
    def reading() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("media")]

    start = time.monotonic()
    while reading() and time.monotonic() - start < 10:  # NOTE: a bound for a hang, not a timing
        time.sleep(0.02)
    assert not reading()
    assert len(DRIPS_READ_TO_THE_END) == drips_before, "the drips were read on to their end"


@pytest.mark.parametrize("urls", [1, 3])
def test_a_caller_that_left_ends_its_prompts_fetches_at_once(port: int, urls: int) -> None:
    """Its reads are not waited for to their end, one image or several (threads, sockets held for nobody)."""
    from concurrent.futures import CancelledError

    drip = f"http://127.0.0.1:{port}/drip-counted"  # a byte every 50 ms for 3 s
    before = len(DRIPS_READ_TO_THE_END)
    start = time.monotonic()
    with pytest.raises(CancelledError, match="image 1"):
        list(local(fetch_timeout_s=10).read_all([drip] * urls, cancelled=lambda: time.monotonic() - start > 0.2))
    assert time.monotonic() - start < 1.0  # answered at once, not after the drips (3 s)
    assert_reads_end(before)


@pytest.mark.parametrize("ip", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                "0.0.0.0", "224.0.0.1", "100.64.0.1", "240.0.0.1", "::1", "fe80::1%eth0",
                                "fc00::1", "::ffff:127.0.0.1", "::"])
def test_non_public_addresses(ip: str) -> None:
    assert not is_public_address(ip)


@pytest.mark.parametrize("ip", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses(ip: str) -> None:
    assert is_public_address(ip)


@pytest.mark.parametrize("path", ["/drip", "/slow-headers", "/slow-redirect/5"])
def test_one_deadline_covers_headers_redirects_and_body(port: int, path: str) -> None:
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"no complete answer within 0.5 s"):
        local(fetch_timeout_s=0.5).load(f"http://127.0.0.1:{port}{path}")
    assert time.monotonic() - start < 1.5  # the server goes on for 1.8-3 s; a socket timeout alone waits it out


# Loopback, link-local and NAT64 addresses as an attacker spells them; the C resolver reads each as what it
# dials, so the check sees the address itself.
HOSTILE_HOSTS = ["2130706433", "0177.0.0.1", "0x7f.0.0.1", "0x7f000001", "127.1", "0", "[::ffff:127.0.0.1]",
                 "[::ffff:7f00:1]", "[::1]", "[64:ff9b::7f00:1]", "[::ffff:169.254.169.254]", "169.254.169.254"]
# (URL, the rule that must refuse it): each case names its own rule, so that deleting that rule fails it (a name
# that does not resolve is refused too, for another reason: `public.test` resolves nowhere but in `_fake_public`)
SPELLING = "a backslash, a space, a control or a non-ASCII character"
HOSTILE_URLS = [("http://user@public.test:{port}/img.png", "user info"),
                ("http://public.test\\@127.0.0.1:{port}/img.png", SPELLING),
                ("http://127.0.0.1\\@public.test:{port}/img.png", SPELLING),
                ("http:\\\\127.0.0.1:{port}\\img.png", SPELLING), ("http://127.0.0.1 /img.png", SPELLING),
                ("http://public.test:{port}/img.png\r\nHost: 127.0.0.1", SPELLING),
                ("http://public.test:{port}/\u00e9.png", SPELLING)]
PUBLIC_ONLY = "does not resolve to a public address"


def _no_dial(*args: object) -> socket.socket:
    raise AssertionError(f"dialled {args[0]}")


@pytest.mark.parametrize(("url", "rule"), [(f"http://{h}:{{port}}/img.png", PUBLIC_ONLY) for h in HOSTILE_HOSTS]
                         + HOSTILE_URLS)
def test_hostile_spellings_are_refused_before_any_connection(port: int, url: str, rule: str) -> None:
    with pytest.raises(UnsupportedURLError, match=rule):
        MediaLoader(MediaConfig(), dial=_no_dial).load(url.format(port=port))


@pytest.mark.parametrize(("target", "rule"), [(f"http://{h}:{{port}}/img.png", PUBLIC_ONLY) for h in HOSTILE_HOSTS]
                         + HOSTILE_URLS[:3])
def test_hostile_spellings_are_refused_on_a_redirect_hop(port: int, target: str, rule: str) -> None:
    hop = urllib.parse.quote(target.format(port=port), safe="")
    with pytest.raises(UnsupportedURLError, match=rule):
        _fake_public().load(f"http://public.test:{port}/to?u={hop}")


def test_the_allowlist_is_checked_on_the_host_dialled(port: int) -> None:
    fetcher = _fake_public(("public.test",)).http
    with pytest.raises(UnsupportedURLError, match="not in the allowed domains"):
        fetcher.connect(("internal.test", port))  # whatever a URL parser made of the URL


@pytest.mark.parametrize("ip", ["64:ff9b::a00:1", "64:ff9b:1::7f00:1", "2002:7f00:1::1", "2002:a9fe:a9fe::1"])
def test_ipv6_carrying_a_private_ipv4_is_not_public(ip: str) -> None:
    assert not is_public_address(ip)  # NAT64 to 10.0.0.1 / 127.0.0.1, 6to4 of 127.0.0.1 / 169.254.169.254


def test_many_dead_addresses_do_not_multiply_the_deadline() -> None:
    dials: list[str] = []

    def blackhole(address: tuple[str, int], timeout: float | None, *args: object) -> socket.socket:
        dials.append(address[0])
        time.sleep(timeout or 0)  # as a connect to an address that never answers
        raise TimeoutError("timed out")

    loader = MediaLoader(MediaConfig(fetch_timeout_s=0.5), resolver=lambda host, port: [f"8.8.8.{i}" for i in range(9)],
                         dial=blackhole)
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"no complete answer within 0.5 s"):
        loader.load("http://many.test/img.png")
    assert time.monotonic() - start < 1.5 and len(dials) <= 3, dials
