"""TLS in front of a plain-HTTP S3 server on 127.0.0.1: each client connection is
decrypted with a self-signed certificate and relayed, byte for byte, to the server."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path


def self_signed_certificate(folder: Path) -> tuple[Path, Path] | None:
    """A certificate and key for 127.0.0.1 made with the ``openssl`` command, or None without it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


class TLSProxy:
    """``https://127.0.0.1:port`` relayed to ``upstream_port``; ``connections`` counts the clients' connections."""

    def __init__(self, upstream_port: int, cert: Path, key: str | Path) -> None:
        self.upstream_port = upstream_port
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(str(cert), str(key))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.connections = 0
        accepting = threading.Thread(target=self._accept, name="tls-proxy", daemon=True)
        accepting.start()
        self._threads.append(accepting)

    @property
    def endpoint_url(self) -> str:
        return f"https://127.0.0.1:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                secure = self._context.wrap_socket(client, server_side=True)
            except (ssl.SSLError, OSError):
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self.connections += 1
                self._sockets += [secure, upstream]
                for a, b in ((secure, upstream), (upstream, secure)):
                    thread = threading.Thread(target=self._relay, args=(a, b), daemon=True)
                    thread.start()
                    self._threads.append(thread)

    @staticmethod
    def _relay(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop accepting, drop every connection and wait for every relay thread."""
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(timeout=10)
            if thread.is_alive():
                raise RuntimeError(f"the TLS proxy's {thread.name} did not end")
        for sock in sockets:
            sock.close()
