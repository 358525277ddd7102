"""Guarantees of the operator's one HTTP client stack (kvpersist.httptransport, through
kvpersist.httpclient) that tests/unit/test_hostile_peers.py does not cover: the environment's proxy
is never used for an in-cluster peer, a peer that keeps its connection open after a whole answer
holds nothing, a name lookup that hangs costs one deadline, a reason quoting a peer's garbage is
short and printable, a HEAD's Content-Length is not a body over the cap, and a TLS peer (the Hub's
way in) that stalls its handshake or trickles its body costs one deadline.

Against raw loopback sockets; every server thread is joined and every wait is bounded."""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2
import pytest

from kvpersist import httpclient, httptransport
from tests.unit.test_hostile_peers import Peer

DEADLINE = 1.0
SLACK = 0.6
BODY = b'{"ok": true}'
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


class Raw(Peer):
    """A loopback listener (test_hostile_peers.Peer's) whose every connection gets
    `behave(sock, request head)` on the raw socket; counts the connections and keeps the heads it
    read (read_head False: nothing is read first, e.g. for a TLS handshake that never comes)."""

    def __init__(self, behave: Callable[[socket.socket, bytes], None], read_head: bool = True) -> None:
        self.raw_behave, self.read_head = behave, read_head
        self.heads: list[bytes] = []
        self.connections = 0
        super().__init__(lambda conn, path: None)

    def _serve(self, sock: socket.socket) -> None:
        with self.lock:
            self.connections += 1
        with sock:
            sock.settimeout(5)
            head = b""
            try:
                while self.read_head and b"\r\n\r\n" not in head and (chunk := sock.recv(4096)):
                    head += chunk
                self.heads.append(head)
                self.raw_behave(sock, head)
            except OSError:
                pass


@contextmanager
def raw(behave: Callable[[socket.socket, bytes], None]) -> Iterator[Raw]:
    server = Raw(behave)
    try:
        yield server
    finally:
        server.close()


def test_the_environments_proxy_is_never_used_for_a_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY and ALL_PROXY name a listener that would answer too: the call still goes
    straight to the pod's address, even with the shared transport built under that environment."""
    with raw(lambda sock, head: sock.sendall(ANSWER)) as peer, raw(lambda sock, head: sock.sendall(ANSWER)) as proxy:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.port}")
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        # built now, under this environment
        monkeypatch.setattr(httpclient, "_transport", functools.cache(httpclient._transport.__wrapped__))
        reply = httpclient.get("127.0.0.1", peer.port, "/status", timeout=DEADLINE)
    assert (reply.status, reply.body) == (200, BODY)
    assert (peer.connections, proxy.connections) == (1, 0)
    assert peer.heads[0].startswith(b"GET /status HTTP/1.1\r\n")


def test_a_peer_that_keeps_its_connection_open_holds_nothing() -> None:
    """The answer is whole once Content-Length bytes came: the call ends then, not when the peer
    closes; the request said Connection: close, the client hung up itself, and the next call opens
    a connection of its own."""
    hung_up: list[float] = []

    def keep_open(sock: socket.socket, head: bytes) -> None:
        sock.sendall(ANSWER)
        sent = time.monotonic()
        if sock.recv(1) == b"":  # waits for the client to close (at most the socket's 5 s)
            hung_up.append(time.monotonic() - sent)

    with raw(keep_open) as peer:
        for _ in range(2):
            start = time.monotonic()
            assert httpclient.get("127.0.0.1", peer.port, "/status", timeout=3.0).body == BODY
            assert time.monotonic() - start < 1.0
        deadline = time.monotonic() + 5
        while len(hung_up) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert peer.connections == 2 and all(b"\r\nconnection: close\r\n" in h.lower() for h in peer.heads)
    assert len(hung_up) == 2 and max(hung_up) < 1.0


def test_a_name_lookup_that_hangs_costs_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """getaddrinfo has no timeout of its own: a resolver that never answers costs the call its
    deadline, not the resolver's patience."""
    release = threading.Event()
    real = socket.getaddrinfo

    def stuck(host: str, *args: object, **kwargs: object) -> object:
        if host == "stuck.example":
            release.wait(10)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    try:
        start = time.monotonic()
        with pytest.raises(httpclient.PeerError, match="timed out"):
            httpclient.get("stuck.example", 80, "/status", timeout=DEADLINE)
        assert time.monotonic() - start < DEADLINE + SLACK
    finally:
        release.set()


def test_a_reason_quoting_a_peers_garbage_is_short_and_printable() -> None:
    garbage = b"\x1b[31mHTTP/9 \x00\x07" + b"\xff" * 5000 + b"\r\n\r\n"
    with raw(lambda sock, head: sock.sendall(garbage)) as peer, \
            pytest.raises(httpclient.PeerError, match="not an HTTP response") as caught:
        httpclient.get("127.0.0.1", peer.port, "/status", timeout=DEADLINE)
    reason = str(caught.value)
    assert len(reason) <= 300 and reason.isprintable(), reason


def test_a_heads_content_length_is_not_a_body_over_the_cap() -> None:
    """A HEAD's answer declares the size of what a GET would get; nothing follows it."""
    with raw(lambda sock, head: sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")) as peer:
        reply = httpclient.request("HEAD", "127.0.0.1", peer.port, "/model.safetensors", timeout=DEADLINE, max_bytes=10)
    assert (reply.status, reply.body) == (200, b"")


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made here (an EC key: quick)."""
    import datetime

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    return tmp / "cert.pem", tmp / "key.pem"


@pytest.mark.parametrize("stage", ["handshake", "body"])
def test_a_tls_peer_trickling_its_handshake_or_body_costs_one_deadline(tmp_path: Path, stage: str) -> None:
    """The Hub's way in (https): a server that takes the connection and never finishes the TLS
    handshake, or finishes it and then sends its body a byte at a time, is cut at the deadline."""
    cert, key = _self_signed(tmp_path)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    stop = threading.Event()

    def behave(sock: socket.socket, head: bytes) -> None:
        with server_side.wrap_socket(sock, server_side=True) as tls:
            tls.recv(4096)
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
            while not stop.wait(0.1):
                tls.sendall(b" ")

    def never(sock: socket.socket, head: bytes) -> None:  # reached once the client gave up: the ClientHello is never answered
        stop.wait(5)

    server = Raw(behave if stage == "body" else never, read_head=stage != "body")
    transport = httptransport.BoundedTransport("the Hub", lambda: DEADLINE, lambda: 1000,
                                               verify=ssl.create_default_context(cafile=str(cert)))
    try:
        with httpx2.Client(transport=transport) as client:
            start = time.monotonic()
            with pytest.raises(httptransport.DeadlineExceeded, match=f"did not answer within {DEADLINE:g}s"):
                client.get(f"https://127.0.0.1:{server.port}/api/buckets/x")
            assert time.monotonic() - start < DEADLINE + SLACK
    finally:
        stop.set()
        server.close()
