"""CurveZMQ authentication and encryption for sockets that leave the host.

A key directory (``physis-keys DIR``) holds the cluster's *server* key pair
(every bound socket: the engine's control and output sockets, each worker's
data socket), a *client* key pair (every connecting socket) and
``authorized/``, the client public keys that may connect. A peer without a
key, or with a key not in ``authorized/``, is refused by the ZAP handler
before any message reaches the application.

Loopback needs no keys; binding any other interface without them is refused
at configuration time (``EngineConfig.validate``, ``physis-worker``).
"""

from __future__ import annotations

import ipaddress
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.thread import ThreadAuthenticator


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def generate_keys(directory: str | Path, client_name: str = "client") -> Path:
    """Create (or add to) a key directory: server pair once, a client pair per ``client_name``."""
    d = Path(directory)
    (d / "authorized").mkdir(parents=True, exist_ok=True)
    if not (d / "server.key_secret").exists():
        zmq.auth.create_certificates(str(d), "server")
    if not (d / f"{client_name}.key_secret").exists():
        public, _ = zmq.auth.create_certificates(str(d), client_name)
        shutil.copy(public, d / "authorized" / f"{client_name}.key")
    for secret in d.glob("*.key_secret"):
        secret.chmod(0o600)
    return d


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    authorized: Path

    @classmethod
    def load(cls, directory: str | Path, client_name: str = "client") -> CurveKeys:
        d = Path(directory)
        try:
            spub, ssec = zmq.auth.load_certificate(str(d / "server.key_secret"))
            cpub, csec = zmq.auth.load_certificate(str(d / f"{client_name}.key_secret"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load CurveZMQ keys from {d}: {exc}; generate them with 'physis-keys {d}'") \
                from None
        if not (d / "authorized").is_dir():
            raise ValueError(f"{d}/authorized/ is missing: it must hold the client public keys allowed in")
        return cls(spub, ssec, cpub, csec, d / "authorized")

    def server(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def client(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public

    def authenticator(self, ctx: zmq.Context):
        """Start the ZAP handler on ``ctx`` (call before binding); stop() it when done."""
        auth = AsyncioAuthenticator(ctx) if isinstance(ctx, zmq.asyncio.Context) else ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=str(self.authorized))
        return auth
