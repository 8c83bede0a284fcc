"""An https store URL keeps certificate verification: a server whose certificate the client does not
trust is refused with the store's error, and the same server is read once its certificate is
trusted (``SSL_CERT_FILE``). (A plain-http client builds no TLS context at all.)"""

import http.server
import json
import shutil
import ssl
import subprocess
import threading

import pytest

from kdnctl.errors import RemoteError
from kdnctl.store import client as remote


@pytest.fixture()
def tls_server(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)

    class Documents(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"documents": []}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Documents)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    remote._tls_context.cache_clear()
    yield f"https://127.0.0.1:{server.server_address[1]}", cert
    server.shutdown()
    remote._tls_context.cache_clear()  # (the next client builds its context from the real environment)


def test_an_untrusted_certificate_is_refused(tls_server, monkeypatch):
    url, _ = tls_server
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with remote.RemoteStore(url, retries=0) as store:
        with pytest.raises(RemoteError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            store.list_documents()


def test_a_trusted_certificate_is_read(tls_server, monkeypatch):
    url, cert = tls_server
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    with remote.RemoteStore(url, retries=0) as store:
        assert store.list_documents() == []
