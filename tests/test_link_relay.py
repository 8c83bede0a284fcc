"""bench/link_ttft.py's link: a relay on 127.0.0.1 that passes every byte both ways, unchanged,
over concurrent connections, and paces the server's bytes as one link of a fixed rate (each
block due when the link has sent everything before it and the block itself)."""

import importlib.util
import socket
import threading

from conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_link_ttft", REPO / "bench" / "link_ttft.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _payload_server(payload: bytes) -> int:
    """A server that answers each connection's request line with ``payload`` prefixed by the line."""
    srv = socket.create_server(("127.0.0.1", 0))

    def one(conn):
        with conn:
            line = b""
            while not line.endswith(b"\n"):
                line += conn.recv(1)
            conn.sendall(line + payload)

    def serve():
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def _fetch(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(request)
        out = bytearray()
        while data := s.recv(1 << 16):
            out += data
    return bytes(out)


def test_relay_passes_every_byte_of_concurrent_connections():
    payload = bytes(range(251)) * 12_007  # ~3 MB, not a multiple of the relay's block
    mod = _bench()
    relay = mod.PacedRelay(_payload_server(payload), rate=5e9)  # 40 Gbit/s: the test waits little
    threading.Thread(target=relay.serve, daemon=True).start()
    got = {}

    def client(i):
        got[i] = _fetch(relay.port, f"request {i}\n".encode())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        assert got[i] == f"request {i}\n".encode() + payload
    assert relay.sent == sum(len(g) for g in got.values())  # every byte from the server was paced
    assert relay.blocks >= 3


def test_pacing_is_one_link_shared_by_every_block():
    mod = _bench()
    relay = mod.PacedRelay(1, rate=1e9)  # (no connection is made)
    assert relay.schedule(100_000, now=10.0) == 10.0 + 1e-4
    # arriving while the link still sends the first: due when the link has sent both
    assert abs(relay.schedule(300_000, now=10.00005) - (10.0 + 4e-4)) < 1e-12
    # arriving at an idle link: due after its own time only
    assert abs(relay.schedule(1_000, now=20.0) - (20.0 + 1e-6)) < 1e-12
    assert relay.sent == 401_000 and abs(relay.busy - 401_000 / 1e9) < 1e-15
