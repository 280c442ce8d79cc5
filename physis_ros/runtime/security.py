"""CurveZMQ authentication and encryption for sockets that leave the host.

A key directory (``physis-keys DIR``) holds the cluster's *server* key pair
(every bound socket: the engine's control and output sockets, each worker's
data socket), a *client* key pair (every connecting socket) and
``authorized/``, the client public keys that may connect. A peer without a
key, or with a key not in ``authorized/``, is refused by the ZAP handler
before any message reaches the application.

Loopback needs no keys; binding any other interface without them is refused
at configuration time (``EngineConfig.validate``, ``physis-worker``).

With ``engine.launcher: ray`` there is no key directory: :func:`ephemeral_keys`
makes a fresh set in memory at every engine start (one server pair for the
bound sockets, one client pair per worker slot) and the authenticators admit
exactly the granted client keys.
"""

from __future__ import annotations

import ipaddress
import shutil
from dataclasses import dataclass, field
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
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)
    authorized: Path | frozenset[bytes]   # a directory of public key files, or the z85 public keys themselves

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
        if isinstance(self.authorized, Path):
            auth.configure_curve(domain="*", location=str(self.authorized))
        else:
            auth.configure_curve_callback(domain="*", credentials_provider=_Granted(self.authorized))
        return auth


class _Granted:
    """ZAP credentials provider: admits exactly the (z85) public keys the engine granted, nothing else."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key in self.keys


def ephemeral_keys(workers: int) -> tuple[CurveKeys, list[CurveKeys]]:
    """Fresh keys for one engine run whose workers it hands their keys itself (``launcher: ray``).

    One server pair serves every bound socket (the engine's control and output sockets, each worker's
    data socket), so any connecting side knows the one server key it must expect. Each worker slot gets
    its own client pair, the engine one more. The engine admits only the workers' keys; a worker admits
    the engine's and its peers' (hidden states travel worker to worker). A re-created worker gets its
    slot's keys again, so the peers' authenticators never need to learn a new key mid-run.
    """
    server_public, server_secret = zmq.curve_keypair()
    engine_public, engine_secret = zmq.curve_keypair()
    pairs = [zmq.curve_keypair() for _ in range(workers)]
    worker_keys = frozenset(public for public, _ in pairs)
    engine = CurveKeys(server_public, server_secret, engine_public, engine_secret, worker_keys)
    peers = worker_keys | {engine_public}
    return engine, [CurveKeys(server_public, server_secret, public, secret, peers) for public, secret in pairs]
