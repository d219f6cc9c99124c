"""torch.distributed links: the byte path of the ``dist`` data plane.

A *link* is one direction between two node processes: a two-rank process
group (sender rank 0, receiver rank 1) of backend ``gloo`` (host bytes) or
``nccl`` (GPU to GPU; one GPU on each side), and one communication thread
per side that runs the link's operations in *sequence order*.  The sender
numbers what it sends on a link 0, 1, 2, ...; the header of each message
(``Incoming``: seq, size, destination) travels over ZeroMQ, and the receiver
posts its receives in the same seq order, whatever order headers arrive in.
So sends and receives pair up one to one, as NCCL's point-to-point
operations require; sends and receives of one direction never wait for the
other direction (that is its own link).

Rendezvous: the sending node hosts a ``TCPStore`` (one per node, on
``host``, any free port), or, where a launcher gives one (``rendezvous``:
torchrun's store, or one that rank 0 or the Ray driver hosts), every node
meets in that one store; the sender names it in every header and the
receiver joins on the first header of a link.  A link id is unique per link incarnation,
so a link that broke is replaced by a fresh one with fresh keys.

Failures never hang: reaching a rendezvous store is bounded by
``CONNECT_S`` (or ``timeout_s`` if shorter), joining the link and every
operation by ``timeout_s``; a gloo peer that dies fails pending operations
at once.  A link that fails is *broken*: its pending and later jobs
complete with the error (``done(None, reason)``); the sender's hub opens a
new link for the next message.  Headers come from authenticated peers but
name any store: a hub joins at most ``MAX_CONNECTING`` links at once and
holds at most ``MAX_LINKS`` receive links (one thread each); beyond that a
header's receive fails at once.  A thread blocked in torch.distributed's
C++ (a connect, a join) cannot be stopped: ``close`` does not wait for
those (the node daemon leaves without the interpreter's teardown).  ``done`` callbacks run on link threads (or, for a job
refused at once, on the caller's thread) and must not block.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

log = logging.getLogger("tessera_actors.links")

Done = Callable[["torch.Tensor | None", str], None]
WINDOW = 2   # operations in flight per link: staging/writing of one overlaps the wire of the next
CONNECT_S = 10.0      # reaching a link's rendezvous store (it exists before any header names it)
MAX_CONNECTING = 8    # receive links a hub joins at once
MAX_LINKS = 1024      # receive links a hub holds
_BROKEN_KEPT = 4096   # ids of broken receive links remembered, so their late headers fail at once
_POLL_S = 0.0002


class LinkError(RuntimeError):
    """A link could not connect or an operation on it failed or timed out."""


@dataclass
class Job:
    """One message on a link: ``data`` to send (stage: copy to host first),
    or ``nbytes`` to receive into a new tensor on ``device``."""
    seq: int
    nbytes: int
    done: Done
    data: torch.Tensor | None = None
    stage: bool = False
    device: torch.device | None = None


def backend_available(backend: str) -> bool:
    if not dist.is_available():
        return False
    return dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()


class Link:
    """One direction of a node pair; ``rank`` 0 sends, 1 receives.  Jobs are
    submitted from any thread; the link's thread connects, then runs them in
    seq order, at most ``WINDOW`` at a time."""

    def __init__(self, link_id: str, rank: int, store: Callable[[], dist.Store], backend: str, host: str,
                 timeout_s: float) -> None:
        """``store()`` gives the rendezvous store; it is called on the link's
        thread (reaching a remote store may take up to the timeout)."""
        self.id, self.rank, self.backend = link_id, rank, backend
        self.timeout_s = timeout_s
        self.broken = ""
        self.connected = False   # the process group is up (until then the thread may be stuck in C++)
        self.next_seq = 0   # sender side: the seq of the next submitted job
        self._store, self._host = store, host
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pg = None
        self._thread = threading.Thread(target=self._main, name=f"link-{'send' if rank == 0 else 'recv'}",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self.broken:
                self._jobs.put(job)
                return
            why = self.broken
        _call(job.done, None, why)

    def close(self) -> None:
        """Stop taking jobs; the thread ends after its current operation (see ``join``)."""
        self._break("link closed")
        self._jobs.put(None)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread to end (it must not outlive the
        interpreter while it tears down its process group); True if it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the link's thread ------------------------------------------------
    def _main(self) -> None:
        try:
            self._pg = self._connect()
            self.connected = True
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__   # (not C++'s stack)
            self._break(f"could not connect link {self.id} ({self.backend}): {first}")
            return
        pending: dict[int, Job] = {}
        inflight: deque = deque()
        next_seq = 0
        while not self.broken:
            if not self._take(pending, block=not inflight and next_seq not in pending):
                break
            try:
                while len(inflight) < WINDOW and next_seq in pending:
                    job = pending.pop(next_seq)
                    next_seq += 1
                    inflight.append((job, None, None))   # failed with the rest if posting raises
                    inflight[-1] = self._start(job)
                job, work, data = inflight[0]
                self._finish(work, data)
                inflight.popleft()
            except Exception as e:
                reason = f"link {self.id} ({self.backend}) failed at message {inflight[0][0].seq}: {e}"
                for j in [j for j, _, _ in inflight] + list(pending.values()):
                    _call(j.done, None, reason)
                self._break(reason)
                break
            _call(job.done, data, "")
        self._drop_pg()

    def _take(self, pending: dict[int, Job], block: bool) -> bool:
        """Move queued jobs into ``pending`` (waiting for one if ``block``);
        False once the link is closed."""
        try:
            item = self._jobs.get(block=block)
            while item is not None:
                pending[item.seq] = item
                item = self._jobs.get_nowait()
            return False
        except queue.Empty:
            return True

    def _connect(self):
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.PrefixStore(self.id + "/", self._store())
        if self.backend == "nccl":
            # on an error or timeout, abort the communicators and fail the work: do not kill the node
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, self.rank, 2, opts)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
        return dist.ProcessGroupGloo(store, self.rank, 2, opts)

    def _start(self, job: Job):
        """Post the job's operation; returns ``(job, work or None, tensor)``."""
        tag = job.seq & 0x7FFFFFFF
        if self.rank == 0:
            data = job.data.to("cpu") if job.stage else job.data
        else:
            data = torch.empty(job.nbytes, dtype=torch.uint8, device=job.device)
        if not job.nbytes:
            return job, None, data
        if data.is_cuda:
            torch.cuda.set_device(data.device)   # NCCL binds the communicator to the current device
        work = self._pg.send([data], 1, tag) if self.rank == 0 else self._pg.recv([data], 0, tag)
        return job, work, data

    def _finish(self, work, data: torch.Tensor) -> None:
        """Wait for ``work`` (bounded by the timeout); raises on failure."""
        if work is None:
            return
        if self.backend != "nccl":
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise LinkError(f"no completion within {self.timeout_s:g} s (peer lost?)")
            time.sleep(_POLL_S)
        work.wait()   # raises the error of a failed operation; orders this thread's stream after it
        torch.cuda.current_stream(data.device).synchronize()

    def _break(self, reason: str) -> None:
        with self._lock:
            if self.broken:
                return
            self.broken = reason
            jobs = []
            while True:
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
        if reason != "link closed":
            log.error("%s", reason)
        for job in jobs:
            if job is not None:
                _call(job.done, None, reason)

    @property
    def connecting(self) -> bool:
        return not self.connected and not self.broken

    def _drop_pg(self) -> None:
        pg, self._pg = self._pg, None
        abort = getattr(pg, "abort", None) if self.backend == "nccl" else None
        if abort is not None:
            try:
                abort()
            except Exception as e:  # already torn down by the watchdog
                log.debug("abort of link %s: %s", self.id, e)


def _call(done: Done, data, error: str) -> None:
    try:
        done(data, error)
    except Exception:  # a callback must not take a link thread down
        log.exception("link completion callback failed")


class LinkHub:
    """The links of one node process; used from one thread (the transfer
    actor's event loop).  ``send`` and ``receive`` never block."""

    def __init__(self, host: str, timeout_s: float, rendezvous: str = "", host_rendezvous: bool = False) -> None:
        """``rendezvous``: ``host:port`` of a shared store (created here when
        ``host_rendezvous``); empty: this hub hosts its own."""
        self.host, self.timeout_s = host, timeout_s
        self.rendezvous, self.host_rendezvous = rendezvous, host_rendezvous
        self._store: dist.TCPStore | None = None
        self._send: dict[tuple, Link] = {}
        self._recv: dict[str, Link] = {}
        self._broken: OrderedDict[str, str] = OrderedDict()   # broken receive link id -> why

    @property
    def store_address(self) -> str:
        """The rendezvous named in this hub's headers (connecting or creating its store on first use)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self._store is None and self.rendezvous:
            host, _, port = self.rendezvous.rpartition(":")
            self._store = dist.TCPStore(host, int(port), is_master=self.host_rendezvous, wait_for_workers=False,
                                        timeout=timeout)
        elif self._store is None:
            self._store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        return self.rendezvous or f"{self.host}:{self._store.port}"

    def send(self, peer: str, backend: str, data: torch.Tensor, stage: bool, done: Done,
             key: tuple = ()) -> tuple[str, int]:
        """Queue ``data`` (flat uint8) for ``peer`` on its ``backend`` link
        (``key`` separates links further, e.g. one per GPU pair); returns the
        link id and the message's seq for the header."""
        k = (peer, backend, *key)
        link = self._send.get(k)
        if link is None or link.broken:
            address = self.store_address
            store = self._store
            link = Link(f"{address}>{peer}/{backend}/{uuid.uuid4().hex[:12]}", 0, lambda: store, backend,
                        self.host, self.timeout_s)
            self._send[k] = link
        seq = link.next_seq
        link.next_seq += 1
        link.submit(Job(seq, data.numel(), done, data=data, stage=stage))
        return link.id, seq

    def receive(self, link_id: str, seq: int, nbytes: int, store: str, backend: str, device: torch.device,
                done: Done) -> None:
        """Post the receive of message ``seq`` of ``link_id`` (joining the link
        on its first header); ``done(tensor, "")`` once the bytes are here."""
        link = self._recv.get(link_id)
        if link is None and link_id in self._broken:
            _call(done, None, self._broken[link_id])
            return
        if link is None:
            if not backend_available(backend):
                _call(done, None, f"this node's torch has no {backend} backend")
                return
            host, _, port = store.rpartition(":")
            if not port.isdigit():
                _call(done, None, f"link {link_id}: bad rendezvous address {store!r}")
                return
            refused = self._refuse_new()
            if refused:
                _call(done, None, f"link {link_id}: {refused}")
                return
            timeout = datetime.timedelta(seconds=self.timeout_s)
            connect = datetime.timedelta(seconds=min(self.timeout_s, CONNECT_S))

            def client(host=host, port=int(port)) -> dist.Store:
                store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=connect)
                store.set_timeout(timeout)   # connected: its operations get the link's timeout
                return store
            link = self._recv[link_id] = Link(link_id, 1, client, backend, self.host, self.timeout_s)
        link.submit(Job(seq, nbytes, done, device=device if backend == "nccl" else torch.device("cpu")))

    def _refuse_new(self) -> str:
        """Why a new receive link cannot be made now ("" if it can); forgets broken ones."""
        for link_id, link in list(self._recv.items()):
            if link.broken:
                del self._recv[link_id]
                self._broken[link_id] = link.broken
                while len(self._broken) > _BROKEN_KEPT:
                    self._broken.popitem(last=False)
        if sum(link.connecting for link in self._recv.values()) >= MAX_CONNECTING:
            return f"{MAX_CONNECTING} links are connecting already: refused"
        if len(self._recv) >= MAX_LINKS:
            return f"this node holds {MAX_LINKS} receive links already: refused"
        return ""

    def links(self) -> list[str]:
        """``backend:send`` / ``backend:recv`` for every live link."""
        return sorted([f"{link.backend}:send" for link in self._send.values() if not link.broken] +
                      [f"{link.backend}:recv" for link in self._recv.values() if not link.broken])

    def close(self, timeout: float = 5.0) -> None:
        """Close every link and wait (up to ``timeout`` s in all) for the
        threads of connected ones (a thread still connecting is blocked in
        C++ and ends when its connect does); blocking, so an event loop
        calls it in a thread."""
        links = [*self._send.values(), *self._recv.values()]
        self._send.clear()
        self._recv.clear()
        connected = [link for link in links if link.connected]
        for link in links:
            link.close()
        deadline = time.monotonic() + timeout
        stuck = [link.id for link in connected if not link.join(max(0.0, deadline - time.monotonic()))]
        if stuck:
            log.warning("links still busy at close: %s", stuck)
        self._store = None
