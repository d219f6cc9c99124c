"""Who may talk to whom: ZeroMQ CURVE keys of a cluster.

Security model.  Every ZeroMQ socket of the actor system (node daemons,
the scheduler's and engine's systems, every peer connection) uses CURVE:
traffic is encrypted, a client connects only to a server that proves it
holds the cluster's *server* secret key, and a server accepts only clients
whose public key is *allowed* (checked by a ZAP handler on every
connection).  A peer without the keys cannot connect, so it cannot ping,
register, place, run, read tensors or shut anything down.  Shared memory is
used only on authenticated connections (``transport.shm``).

Where keys come from (``ClusterKeys``):

* a key directory written by ``tessera keys DIR``: ``server.key_secret``,
  ``client.key_secret`` (the identity member processes use) and
  ``allowed/*.key`` (client public keys let in); ``tessera keys DIR
  --client NAME`` adds another allowed client;
* one shared secret file (``--secret FILE``, >= 16 bytes): both keypairs
  are derived from it;
* neither: a process makes ephemeral keys from a random secret at first use
  and exports them in its environment (``TESSERA_SECRET``), so the
  processes it starts itself (``LocalCluster``'s nodes, test children)
  share them and no other process does.

Environment variables (read here only): ``TESSERA_KEYS`` (a key directory),
``TESSERA_SECRET_FILE`` (a secret file), ``TESSERA_SECRET`` (the secret
itself, hex; set for children, never put on a command line),
``TESSERA_INSECURE=1`` (authentication off, as ``--insecure``).

Not covered: processes of the same user can read each other's memory and
environment (the OS boundary is the user); the torch.distributed links of
``--data-plane dist`` (TCPStore, gloo, NCCL) are not authenticated by this
module - keep that plane on a trusted network.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import stat
from pathlib import Path

import zmq
import zmq.auth

from tessera_actors.runtime.errors import ActorError

log = logging.getLogger("tessera_actors.auth")

ENV_KEYS, ENV_SECRET_FILE, ENV_SECRET, ENV_INSECURE = ("TESSERA_KEYS", "TESSERA_SECRET_FILE", "TESSERA_SECRET",
                                                       "TESSERA_INSECURE")
MIN_SECRET_BYTES = 16


class AuthError(ValueError):
    """Keys that cannot be used: missing, unreadable, too open, malformed."""


@dataclasses.dataclass(frozen=True)
class ClusterKeys:
    """CURVE keys of one cluster member (z85 bytes).  ``env`` are the
    environment variables that give a child process the same keys;
    ``origin`` says where they came from (for logs and errors)."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    allowed: frozenset
    origin: str
    env: tuple = ()

    def allows(self, client_public_z85: bytes) -> bool:
        return client_public_z85 in self.allowed

    @classmethod
    def from_dir(cls, path: str | os.PathLike, client: str = "client") -> "ClusterKeys":
        """Keys of a ``tessera keys`` directory; ``client`` names the client keypair to use."""
        root = Path(path)
        _check_private(root, directory=True)
        server_public, server_secret = _load_pair(root / "server.key_secret")
        client_public, client_secret = _load_pair(root / f"{client}.key_secret")
        allowed = set()
        for public in sorted((root / "allowed").glob("*.key")):
            key, _ = _load(public)
            allowed.add(key)
        if not allowed:
            raise AuthError(f"{root}: no allowed client keys in {root / 'allowed'}")
        return cls(server_public, server_secret, client_public, client_secret, frozenset(allowed),
                   f"key directory {root}", ((ENV_KEYS, str(root.resolve())),))

    @classmethod
    def from_secret(cls, secret: bytes, origin: str, env: tuple = ()) -> "ClusterKeys":
        """Both keypairs derived from one shared secret (the only allowed client is the derived one)."""
        if len(secret) < MIN_SECRET_BYTES:
            raise AuthError(f"{origin}: a cluster secret needs at least {MIN_SECRET_BYTES} bytes")
        server_public, server_secret = _derived_pair(secret, b"server")
        client_public, client_secret = _derived_pair(secret, b"client")
        return cls(server_public, server_secret, client_public, client_secret, frozenset([client_public]),
                   origin, env)

    @classmethod
    def from_secret_file(cls, path: str | os.PathLike) -> "ClusterKeys":
        p = Path(path)
        _check_private(p, directory=False)
        try:
            secret = p.read_bytes().strip()
        except OSError as e:
            raise AuthError(f"cannot read secret file {p}: {e.strerror}") from None
        return cls.from_secret(secret, f"secret file {p}", ((ENV_SECRET_FILE, str(p.resolve())),))


def _derived_pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    raw = hashlib.sha256(b"tessera-curve-" + role + b"\0" + secret).digest()
    secret_z85 = zmq.utils.z85.encode(raw)
    return zmq.curve_public(secret_z85), secret_z85


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise AuthError(f"cannot load key {path}: {e}") from None


def _load_pair(path: Path) -> tuple[bytes, bytes]:
    _check_private(path, directory=False)
    public, secret = _load(path)
    if not secret:
        raise AuthError(f"{path} holds no secret key")
    return public, secret


def _check_private(path: Path, directory: bool) -> None:
    """Secrets must not be readable by other users (like ssh's rule)."""
    try:
        st = path.stat()
    except OSError as e:
        raise AuthError(f"{path}: {e.strerror}") from None
    if directory and not stat.S_ISDIR(st.st_mode):
        raise AuthError(f"{path} is not a key directory (create one with `tessera keys {path}`)")
    if st.st_mode & 0o077:
        raise AuthError(f"{path} is accessible by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod go-rwx it")


def create_key_dir(path: str | os.PathLike, clients: tuple[str, ...] = ("client",)) -> Path:
    """Write a new cluster key directory (mode 0700, secrets 0600): the
    server keypair, one keypair per name in ``clients``, all allowed."""
    root = Path(path)
    if (root / "server.key_secret").exists():
        raise AuthError(f"{root} already holds cluster keys")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    zmq.auth.create_certificates(str(root), "server")
    os.chmod(root / "server.key_secret", 0o600)
    for name in clients:
        add_client(root, name)
    return root


def add_client(path: str | os.PathLike, name: str) -> bytes:
    """Create client keypair ``name`` in a key directory and allow it; returns its public key."""
    root = Path(path)
    if not name.replace("-", "").replace("_", "").isalnum() or name == "server":
        raise AuthError(f"bad client name {name!r} (letters, digits, - and _; not 'server')")
    if (root / f"{name}.key_secret").exists():
        raise AuthError(f"client {name!r} already exists in {root}")
    allowed = root / "allowed"
    allowed.mkdir(mode=0o700, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(str(root), name)
    os.chmod(secret_file, 0o600)
    os.replace(public_file, allowed / f"{name}.key")
    return _load(allowed / f"{name}.key")[0]


def keys_from_environment() -> ClusterKeys | None:
    """The keys the environment names (``TESSERA_KEYS``, ``TESSERA_SECRET_FILE``,
    ``TESSERA_SECRET``), or None when it names none."""
    if os.environ.get(ENV_KEYS):
        return ClusterKeys.from_dir(os.environ[ENV_KEYS])
    if os.environ.get(ENV_SECRET_FILE):
        return ClusterKeys.from_secret_file(os.environ[ENV_SECRET_FILE])
    if os.environ.get(ENV_SECRET):
        try:
            secret = bytes.fromhex(os.environ[ENV_SECRET])
        except ValueError:
            raise AuthError(f"{ENV_SECRET} must be hex") from None
        return ClusterKeys.from_secret(secret, "inherited ephemeral secret", ((ENV_SECRET, os.environ[ENV_SECRET]),))
    return None


def insecure_from_environment() -> bool:
    return os.environ.get(ENV_INSECURE, "") not in ("", "0")


_process_keys: ClusterKeys | None = None
generated_here = False   # True when process_keys() had to make ephemeral keys (nothing in the environment)


def process_keys() -> ClusterKeys:
    """This process's default keys: the environment's, or ephemeral ones
    made now and exported (``TESSERA_SECRET``) for the processes it starts."""
    global _process_keys
    if _process_keys is None:
        keys = keys_from_environment()
        if keys is None:
            global generated_here
            generated_here = True
            secret = secrets.token_hex(32)
            os.environ[ENV_SECRET] = secret
            keys = ClusterKeys.from_secret(bytes.fromhex(secret), "ephemeral keys of this process",
                                           ((ENV_SECRET, secret),))
        _process_keys = keys
    return _process_keys


def use_keys(keys: ClusterKeys) -> None:
    """Make ``keys`` this process's default (a daemon given --keys/--secret),
    and export them for the processes it starts."""
    global _process_keys, generated_here
    _process_keys, generated_here = keys, False
    for name in (ENV_KEYS, ENV_SECRET_FILE, ENV_SECRET):
        os.environ.pop(name, None)
    os.environ.update(dict(keys.env))


def secure_server(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Make ``sock`` a CURVE server of the cluster (call before bind)."""
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = b"tessera"
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)   # no ZAP handler in the context: refuse everyone, never accept all


def secure_client(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Make ``sock`` a CURVE client of the cluster (call before connect)."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class _Allowed:
    """ZAP credentials provider: allowed client keys; counts refusals."""

    def __init__(self, keys: ClusterKeys):
        self.keys = keys
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if self.keys.allows(key):
            return True
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("refused a connection from unknown client key %s... (%d refused so far)",
                        key[:8].decode(errors="replace"), self.refused)
        return False


class Authenticator:
    """ZAP handler of one ZeroMQ context (a thread, pyzmq's ThreadAuthenticator):
    servers of that context accept only the allowed client keys."""

    def __init__(self, ctx: zmq.Context, keys: ClusterKeys):
        from zmq.auth.thread import ThreadAuthenticator
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("tessera_actors.auth.zap"))
        self._allowed = _Allowed(keys)
        self._auth.start()
        self._auth.configure_curve_callback(domain="tessera", credentials_provider=self._allowed)

    @property
    def refused(self) -> int:
        return self._allowed.refused

    def stop(self) -> None:
        self._auth.stop()


class HandshakeFailed(ActorError):
    """The security handshake with a server failed (keys not allowed, wrong
    server key, or one side insecure): asks fail at once with this."""


_FAILURES = {
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "the server refused this process's client key (not allowed there)",
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "security handshake failed (protocol error: is one side --insecure?)",
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "security handshake failed (a wrong server key, or the server "
                                               "does not authenticate)",
}


class HandshakeWatch:
    """Watches the security handshakes of one client socket (a ZeroMQ
    monitor read on the event loop).  ``failure`` is the reason of the last
    failed handshake, None once one succeeded; ``on_failure(reason, first)``
    is called at each failure (``first``: the first since the last success).
    Loop thread only."""

    def __init__(self, sock: zmq.Socket, on_failure):
        from transport.channel import Channel
        events = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        for event in _FAILURES:
            events |= event
        self._sock = sock
        self._on_failure = on_failure
        self.failure: str | None = None
        self._chan = Channel(sock.get_monitor_socket(events), self._on_event)

    def _on_event(self, frames: list) -> None:
        from zmq.utils.monitor import parse_monitor_message
        try:
            event = parse_monitor_message([getattr(f, "bytes", f) for f in frames])["event"]
        except (ValueError, IndexError, KeyError):
            return
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failure = None
        elif int(event) in _FAILURES:
            first = self.failure is None
            self.failure = _FAILURES[int(event)]
            self._on_failure(self.failure, first)

    def close(self) -> None:
        """Stop watching (before the watched socket closes); idempotent."""
        from transport.channel import close_monitor
        close_monitor(self._sock, self._chan)
