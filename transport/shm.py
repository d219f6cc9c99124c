"""Shared-memory path for large tensor frames between processes on one host.

A sender copies each tensor frame of ``ShmConfig.threshold`` bytes or more
into a segment of its ``SegmentPool`` (files in /dev/shm, created by this
process with mode 0600, reused) and sends a small descriptor instead of the
bytes.  The receiver's ``SegmentReader`` copies the bytes out into memory of
its own and reports the segment released at once, so the sender reuses it.

Safety (the segments live in a directory every local user can write):
the receiver never maps a peer's segment, it copies the bytes out with
``preadv`` on a descriptor, so a peer that truncates a segment makes a read
come up short (a ``CodecError``), never a SIGBUS.  It opens with
``O_NOFOLLOW`` and requires a regular file with one link owned by this user
(``st_uid``), of at least the described size and as many bytes of storage
(a sparse file would make the copy's pages out of nothing); it exists only
on authenticated servers (``transport.auth``).  Which segments a connection
may name: a pool draws a random secret, sent in its handshake (encrypted),
and names segment ``i`` ``tessera-PID-i-MAC``, ``MAC = HMAC(secret,
"PID-i")``; the reader takes from that connection only names whose MAC it
recomputes - not another process's segments (a confused deputy), whose
names /dev/shm shows.  Nobody can predict a pool's next names to create
them first (squatting); a name taken anyway is skipped, and a pool that
cannot create a segment sends that frame over ZeroMQ.  The handshake's
answer is a MAC of the nonce read, never bytes of a segment.

Frames of a message with shared-memory tensors (see ``transport.codec``)::

    0: header with FLAG_SHM set      1: body (unchanged)
    2..n: tensor frames; those moved to shared memory are empty
    n+1: table, msgpack [[tensor_index, segment_name, generation, nbytes], ...]

Same-host use is opt-in per link and proven, never guessed: only local
endpoints (``ipc://``, ``tcp://127.x.x.x``, ``tcp://localhost``, ``tcp://[::1]``)
try it, once the receiver proved it read a nonce the sender wrote into a
probe segment (``SegmentPool.probe``).  Otherwise tensors go as ZeroMQ frames.

Cleanup: a pool unlinks its files at ``close`` and at interpreter exit.
Files left by a process that was killed (SIGKILL, SIGTERM without handler)
are removed by the next pool created on the host (``sweep_stale``): names
carry the creator's pid.

Everything here is non-blocking except the copies into and out of a segment,
done on the caller's thread (about 10-20 ms per 64 MiB on the CI machine).
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import hmac
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable


from tessera_actors.runtime.errors import CodecError

log = logging.getLogger("tessera_actors.transport")

SHM_DIR = "/dev/shm"
PREFIX = "tessera-"
FLAG_SHM = 2   # header flag: the last frame is a shared-memory table
NONCE_BYTES = 16
SECRET_BYTES = 32
_NAME = re.compile(r"tessera-(\d+)-(\d+)-([0-9a-f]{32})\Z")   # pid, index, MAC
_CREATE_TRIES = 8    # names tried (each taken by someone else) before a frame goes over ZeroMQ
_GRAIN = 1 << 20   # segment sizes are multiples of this
_READER_CACHE = 64   # open segment descriptors a reader keeps
_MAX_PEERS = 4096    # handshakes a reader remembers (one per connection)
_SPARE_BYTES = 1 << 30   # idle receive buffers a reader keeps for reuse
_PAGE = 4096


@dataclasses.dataclass(frozen=True)
class ShmConfig:
    """Shared-memory transport settings of one ``ActorSystem``.

    ``threshold``: tensor frames of at least this many bytes use shared memory.
    ``max_bytes``: segment bytes one pool may hold; beyond it frames fall back
    to ZeroMQ (a receiver that keeps many received tensors alive keeps their
    segments busy).
    """
    enabled: bool = True
    threshold: int = 1 << 20
    max_bytes: int = 2 << 30

    def __post_init__(self):
        if not isinstance(self.threshold, int) or self.threshold < 1:
            raise ValueError(f"ShmConfig.threshold must be a positive int, got {self.threshold!r}")
        if not isinstance(self.max_bytes, int) or self.max_bytes < 0:
            raise ValueError(f"ShmConfig.max_bytes must be a non-negative int, got {self.max_bytes!r}")


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def is_local_endpoint(endpoint: str) -> bool:
    """True for endpoints that can only reach this host."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    return host in ("localhost", "[::1]") or re.fullmatch(r"127(\.\d{1,3}){3}", host) is not None


def sweep_stale() -> list[str]:
    """Unlink segments whose creating process is gone; returns their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segment(s) of exited processes", len(removed))
    return removed


def _mac(secret: bytes, pid: int, index: int) -> str:
    return hmac.new(secret, f"{pid}-{index}".encode(), hashlib.sha256).hexdigest()[:32]


def probe_proof(secret: bytes, nonce: bytes) -> bytes:
    """What a reader answers for a probe holding ``nonce``: proof that it read
    the segment, from which the segment's bytes cannot be recovered."""
    return hmac.new(secret, b"tessera-shm-probe" + nonce, hashlib.sha256).digest()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Segment:
    """One segment file of a pool: its descriptor and the sender's own
    mapping of it (only the receiver must never map a peer's segment)."""

    __slots__ = ("name", "size", "fd", "mm", "generation", "busy")

    def __init__(self, name: str, size: int, fd: int):
        self.name, self.size, self.fd = name, size, fd
        self.mm = mmap.mmap(fd, size)
        self.generation = 0
        self.busy = False

    def write(self, data, offset: int = 0) -> None:
        """Copy ``data`` (a buffer) into the segment at ``offset``."""
        view = memoryview(data).cast("B")
        self.mm[offset:offset + len(view)] = view

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass   # a write in progress on another thread holds an export; the mapping goes with it
        os.close(self.fd)


class SegmentPool:
    """Sender side: segments this process created, handed out one message at
    a time and reused once the receiver released them.  Loop thread only."""

    _swept = False

    def __init__(self, max_bytes: int):
        if not SegmentPool._swept:
            SegmentPool._swept = True
            sweep_stale()
        self.max_bytes = max_bytes
        self._pid = os.getpid()
        self._secret = secrets.token_bytes(SECRET_BYTES)   # per pool, so per connection
        self._count = 0
        self.collisions = 0   # names found taken when creating a segment
        self._segments: dict[str, _Segment] = {}
        self._bytes = 0
        self.closed = False
        _live_pools.add(self)

    def name(self, index: int) -> str:
        """The name of this pool's ``index``-th segment (for this connection's reader only)."""
        return f"{PREFIX}{self._pid}-{index}-{_mac(self._secret, self._pid, index)}"

    def _create(self, size: int) -> _Segment:
        """A new segment; ``OSError`` when none could be made (every name tried
        taken, /dev/shm full, no descriptors left)."""
        for _ in range(_CREATE_TRIES):
            self._count += 1
            name = self.name(self._count)
            try:
                fd = os.open(os.path.join(SHM_DIR, name),
                             os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:   # somebody made it first: never ours to use or unlink
                self.collisions += 1
                if self.collisions <= 10:
                    log.warning("shared-memory segment %s already exists (not made by this pool): skipped", name)
        else:
            raise FileExistsError(f"{_CREATE_TRIES} shared-memory segment names in a row were taken")
        try:
            os.ftruncate(fd, size)
            seg = _Segment(name, size, fd)
        except BaseException:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        self._segments[name] = seg
        self._bytes += size
        return seg

    def _drop(self, seg: _Segment) -> None:
        del self._segments[seg.name]
        self._bytes -= seg.size
        _unlink(seg.name)
        seg.close()

    def probe(self) -> tuple[list, bytes]:
        """For the handshake: the hello to send (``[probe segment name,
        secret]``; the probe, a fresh segment, holds a random nonce) and the
        answer a reader that read the probe gives (``probe_proof``)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        seg = self._create(_PAGE)
        seg.write(nonce)
        seg.busy = True
        return [seg.name, self._secret], probe_proof(self._secret, nonce)

    def discard(self, name: str) -> None:
        """Unlink one segment now (the probe once the handshake is over)."""
        seg = self._segments.get(name)
        if seg is not None:
            self._drop(seg)

    def acquire(self, nbytes: int) -> _Segment | None:
        """A free segment of at least ``nbytes``, marked busy; None when the
        pool would outgrow ``max_bytes``."""
        if self.closed:
            return None
        best = None
        for seg in self._segments.values():
            if not seg.busy and seg.size >= nbytes and (best is None or seg.size < best.size):
                best = seg
        if best is None:
            size = -(-nbytes // _GRAIN) * _GRAIN
            while self._bytes + size > self.max_bytes:
                idle = [s for s in self._segments.values() if not s.busy]
                if not idle:
                    return None
                self._drop(min(idle, key=lambda s: s.size))
            try:
                best = self._create(size)
            except OSError as exc:
                log.info("no shared-memory segment of %d bytes (%s): the frame goes over ZeroMQ", size, exc)
                return None
        best.busy = True
        best.generation += 1
        return best

    def release(self, name: str, generation: int) -> bool:
        """Mark a segment free again; False for unknown or stale tokens."""
        seg = self._segments.get(name)
        if seg is None or not seg.busy or seg.generation != generation:
            return False
        seg.busy = False
        return True

    def close(self) -> None:
        """Unlink and unmap every segment; idempotent."""
        if self.closed:
            return
        self.closed = True
        _live_pools.discard(self)
        for seg in list(self._segments.values()):
            _unlink(seg.name)
            seg.close()
        self._segments.clear()
        self._bytes = 0


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


_live_pools: "weakref.WeakSet[SegmentPool]" = weakref.WeakSet()


@atexit.register
def _close_pools_at_exit() -> None:
    for pool in list(_live_pools):
        pool.close()


class SegmentReader:
    """Receiver side: copies tensor bytes out of other processes' segments.

    ``on_release(owner, tokens)`` is called on the loop thread with the
    ``(name, generation)`` tokens that were read (or refused); ``owner`` is
    what ``read`` was given (the sender's identity).  A segment is accepted
    only when its name carries the MAC of the secret that owner sent in its
    handshake (see the module docstring).
    """

    def __init__(self, on_release: Callable[[Any, list], None], loop):
        self._on_release = on_release
        self._loop = loop
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._secrets: dict[Any, bytes] = {}   # owner -> the secret of its handshake
        self._freed: deque = deque()
        self._flush_scheduled = False
        self._lock = threading.Lock()
        self._spare: dict[int, list[mmap.mmap]] = {}   # free receive buffers by size
        self._spare_bytes = 0
        self.closed = False

    def _open(self, name: str, nbytes: int) -> int:
        """A checked descriptor of segment ``name`` holding at least ``nbytes``."""
        fd = self._fds.get(name)
        if fd is None:
            if _NAME.match(name) is None:
                raise CodecError(f"bad shared-memory segment name {name!r}")
            try:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as exc:
                raise CodecError(f"cannot open shared-memory segment {name!r}: {exc.strerror}") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    raise CodecError(f"shared-memory segment {name!r} is not a plain file")
                if st.st_uid != os.geteuid():
                    raise CodecError(f"shared-memory segment {name!r} belongs to uid {st.st_uid}, not to this user")
            except BaseException:
                os.close(fd)
                raise
            self._fds[name] = fd
            while len(self._fds) > _READER_CACHE:
                os.close(self._fds.popitem(last=False)[1])
        else:
            self._fds.move_to_end(name)
        st = os.fstat(fd)
        if nbytes > st.st_size:
            raise CodecError(f"descriptor wants {nbytes} bytes of {st.st_size}-byte segment {name!r}")
        if nbytes > st.st_blocks * 512:   # a sender wrote every byte it describes: its pages exist
            raise CodecError(f"segment {name!r} stores {st.st_blocks * 512} of the {nbytes} bytes described "
                             "(a sparse file): refused")
        return fd

    def _check_name(self, owner, name: str, secret: bytes | None = None) -> None:
        """Refuse a segment ``owner``'s pool did not name for this connection."""
        secret = secret if secret is not None else self._secrets.get(owner)
        match = _NAME.match(name)
        if secret is None or match is None or not hmac.compare_digest(
                match.group(3), _mac(secret, int(match.group(1)), int(match.group(2)))):
            raise CodecError(f"segment {name!r} was not made for this connection by its peer")

    def _forget(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def _receive_buffer(self, nbytes: int) -> mmap.mmap:
        """Private memory for received bytes: a recycled buffer of the size
        class when one is free (no page faults), else a new populated one."""
        size = -(-nbytes // _GRAIN) * _GRAIN
        with self._lock:
            free = self._spare.get(size)
            if free:
                self._spare_bytes -= size
                return free.pop()
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))

    def _recycle(self, mm: mmap.mmap) -> None:
        """A receive buffer nobody uses any more (any thread)."""
        with self._lock:
            if not self.closed and self._spare_bytes + len(mm) <= _SPARE_BYTES:
                self._spare.setdefault(len(mm), []).append(mm)
                self._spare_bytes += len(mm)
        # else dropped: unmapped once the dying array released its export (closing now would raise)

    def read_probe(self, owner, hello) -> bytes:
        """The answer to a handshake ``hello`` (``SegmentPool.probe``): the
        proof of the nonce read from its probe segment, which must carry the
        hello's secret; from then on ``owner`` may describe segments of that
        secret only.  Raises ``CodecError``."""
        if self.closed:
            raise CodecError("shared-memory reader is closed")
        if not (isinstance(hello, list) and len(hello) == 2 and type(hello[0]) is str and type(hello[1]) is bytes
                and len(hello[1]) == SECRET_BYTES):
            raise CodecError("malformed shared-memory hello (expected [probe name, secret])")
        name, secret = hello
        self._check_name(owner, name, secret)
        try:
            fd = self._open(name, NONCE_BYTES)
            nonce = os.pread(fd, NONCE_BYTES, 0)
        except OSError as exc:
            raise CodecError(f"cannot read shared-memory probe {name!r}: {exc.strerror}") from None
        finally:
            self._forget(name)
        if len(nonce) != NONCE_BYTES:
            raise CodecError(f"shared-memory probe {name!r} holds no nonce")
        self._secrets.pop(owner, None)
        self._secrets[owner] = secret
        while len(self._secrets) > _MAX_PEERS:   # connections come and go: forget the oldest handshakes
            self._secrets.pop(next(iter(self._secrets)))
        return probe_proof(secret, nonce)

    def read(self, owner, name: str, generation: int, nbytes: int):
        """A new uint8 numpy array holding the first ``nbytes`` of the
        segment (a private copy); the segment is released either way, unless
        it is none of this connection's (then nothing about it goes back)."""
        import numpy as np
        if self.closed:
            raise CodecError("shared-memory reader is closed")
        self._check_name(owner, name)
        try:
            fd = self._open(name, nbytes)
            mm = self._receive_buffer(nbytes)
            got = 0
            with memoryview(mm) as dst:
                while got < nbytes:
                    n = os.preadv(fd, [dst[got:nbytes]], got)
                    if n <= 0:
                        self._recycle(mm)
                        raise CodecError(f"shared-memory segment {name!r} shrank to {got} bytes while being read")
                    got += n
            out = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
            weakref.finalize(out, self._recycle, mm)   # derived views keep ``out`` (their base) alive
            return out
        except OSError as exc:
            self._forget(name)
            raise CodecError(f"cannot read shared-memory segment {name!r}: {exc.strerror}") from None
        except CodecError:
            self._forget(name)
            raise
        finally:
            self._released(owner, (name, generation))   # the sender may reuse it now

    def _released(self, owner, token) -> None:
        self._freed.append((owner, token))
        with self._lock:
            if self._flush_scheduled or self.closed:
                return
            self._flush_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:
            pass   # loop closed: the sender's pool is unlinked at its close anyway

    def _flush(self) -> None:
        with self._lock:
            self._flush_scheduled = False
        by_owner: dict = {}
        freed = self._freed
        while freed:
            owner, token = freed.popleft()
            by_owner.setdefault(owner, []).append(token)
        if self.closed:
            return
        for owner, tokens in by_owner.items():
            try:
                self._on_release(owner, tokens)
            except Exception:
                log.exception("sending shared-memory releases failed")

    def close(self) -> None:
        """Close the cached segment descriptors; idempotent."""
        with self._lock:
            self.closed = True
            spare, self._spare, self._spare_bytes = self._spare, {}, 0
        for buffers in spare.values():
            for mm in buffers:
                try:
                    mm.close()
                except BufferError:
                    pass   # an array being freed still holds it; it goes with the array
        while self._fds:
            os.close(self._fds.popitem()[1])
