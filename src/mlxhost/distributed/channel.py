"""Control messages between ranks over plain TCP: rank 0 broadcasts (set-up, step plans), the others
answer gathers and report each step, their phase and their errors.

No MLX arrays travel here. On MLX-CUDA the plans used to go over a second mx.distributed group (a CPU
ring beside NCCL): every plan then made `mx.array`s on the engine thread and ran a collective on a
CPU stream whose completion MLX signals with a kernel launch, next to the model's NCCL kernels; steps
stalled for tens of seconds and `mx.array(buf)` failed now and then with `cudaMemcpy ... invalid argument`
(docs/BENCHMARKS.md). Sockets keep every rank's MLX work to the model's own collectives on one thread.

A frame is an 8-byte little-endian length, a kind byte and a pickle (the ranks are one trusted
installation, as with the plans before). Each rank > 0 has one connection to rank 0, read by a thread
of its own, so a peer that dies is noticed at once (its connection closes) even while the main thread
waits inside an MLX collective that will never finish.
"""

from __future__ import annotations

import hmac
import logging
import pickle
import queue
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<QB")
_HELLO = struct.Struct("<I32s")  # rank, token: checked before anything on the connection is unpickled
BROADCAST, GATHER, STEP, PHASE, ERROR, BYE, LAST = b"BGSPEXL"
HEARTBEAT_S = 1.0  # a follower reports its phase this often, so rank 0 can say what it waits on
# A follower told to shut down has this long to close after rank 0 hung up (rank 0 waits 30 s for the ranks
# it started): then it ends as a rank that lost rank 0 does.
CLOSE_AFTER_LAST_S = 60.0


class LostRank(RuntimeError):
    """A peer's connection closed or it reported an error."""


def _send(sock: socket.socket, lock: threading.Lock, kind: int, obj: Any) -> None:
    data = pickle.dumps(obj)
    with lock:
        sock.sendall(_HEAD.pack(len(data), kind) + data)


def _hang_up(sock: socket.socket) -> None:
    """Closes a connection whose reader thread may be blocked in recv (a plain close would not wake it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[int, Any]:
    n, kind = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    return kind, pickle.loads(_recv_exact(sock, n))


@dataclass
class PeerStatus:
    """What rank 0 last heard from a follower (for the step timeline and the timeout message)."""

    phase: str = "connected"
    phase_since: float = 0.0  # monotonic, rank 0's clock
    heard: float = 0.0
    last_step: int = -1
    last_wait_s: float = 0.0
    last_run_s: float = 0.0

    def describe(self, now: float) -> str:
        return (f"{self.phase} for {now - self.phase_since:.1f} s (last step done: {self.last_step}, "
                f"last heard {now - self.heard:.1f} s ago)")


class Channel:
    """The API both sides share: `broadcast`, `gather`, `barrier`."""

    rank: int
    size: int

    def broadcast(self, obj: Any = None) -> Any:
        raise NotImplementedError

    def broadcast_last(self, obj: Any) -> None:
        """Rank 0's last broadcast (the shutdown plan): a follower that got it takes rank 0's hang-up
        that follows as the end, not as a loss, even while it is still closing its engine."""
        self.broadcast(obj)

    def gather(self, obj: Any) -> list[Any] | None:
        raise NotImplementedError

    def barrier(self) -> None:
        self.gather(None)
        self.broadcast(None)

    # Steps and phases: followers report them, rank 0 keeps them; both ends accept every call.
    def set_phase(self, phase: str) -> None:
        pass

    def report_step(self, step: int, wait_s: float, run_s: float, signature: int) -> None:
        pass

    def close(self) -> None:
        pass


class LeadChannel(Channel):
    """Rank 0's end: one connection per follower, each read by its own thread."""

    def __init__(self, conns: dict[int, socket.socket], size: int) -> None:
        self.rank, self.size = 0, size
        self._conns = conns
        self._locks = {r: threading.Lock() for r in conns}
        self._gathered: dict[int, queue.Queue] = {r: queue.Queue() for r in conns}
        self.peers = {r: PeerStatus(phase_since=time.monotonic(), heard=time.monotonic()) for r in conns}
        self.signatures: dict[int, dict[int, int]] = {r: {} for r in conns}  # rank -> step -> signature
        self.on_lost: Callable[[str], None] = lambda reason: None  # the supervisor's fatal
        self.closing = False
        self.last_sent = False  # the followers were told to shut down (they close by themselves)
        for rank, conn in conns.items():
            threading.Thread(target=self._read, args=(rank, conn), name=f"mlxhost-rank{rank}-reader",
                             daemon=True).start()

    def _read(self, rank: int, conn: socket.socket) -> None:
        peer = self.peers[rank]
        while True:
            try:
                kind, obj = _recv(conn)
            except (OSError, ConnectionError, EOFError, pickle.UnpicklingError) as exc:
                self._lost(rank, f"rank {rank} closed its connection ({exc})")
                return
            now = time.monotonic()
            peer.heard = now
            if kind == GATHER:
                self._gathered[rank].put(obj)
            elif kind == PHASE:
                if obj != peer.phase:
                    peer.phase, peer.phase_since = obj, now
            elif kind == STEP:
                step, wait_s, run_s, signature = obj
                peer.last_step, peer.last_wait_s, peer.last_run_s = step, wait_s, run_s
                self.signatures[rank][step] = signature
                log.debug("rank %d step %d: waited %.1f ms for the plan, ran %.1f ms", rank, step, wait_s * 1e3,
                          run_s * 1e3)
            elif kind == ERROR:
                self._lost(rank, f"rank {rank} failed: {obj}")
                return
            elif kind == BYE:
                return

    def _lost(self, rank: int, reason: str) -> None:
        self._gathered[rank].put(LostRank(reason))
        if not self.closing:
            self.on_lost(reason)

    def broadcast(self, obj: Any = None, kind: int = BROADCAST) -> Any:
        for rank, conn in self._conns.items():
            try:
                _send(conn, self._locks[rank], kind, obj)
            except OSError as exc:
                raise LostRank(f"sending to rank {rank} failed: {exc}") from exc
        return obj

    def broadcast_last(self, obj: Any) -> None:
        self.broadcast(obj, LAST)
        self.last_sent = True

    def gather(self, obj: Any, timeout_s: float | None = None) -> list[Any]:
        everyone = [obj]
        for rank in sorted(self._conns):
            try:
                got = self._gathered[rank].get(timeout=timeout_s)
            except queue.Empty:
                raise LostRank(f"rank {rank} did not answer within {timeout_s:.0f} s") from None
            if isinstance(got, LostRank):
                raise got
            everyone.append(got)
        return everyone

    def describe_peers(self) -> str:
        now = time.monotonic()
        return "; ".join(f"rank {r}: {p.describe(now)}" for r, p in sorted(self.peers.items()))

    def close(self) -> None:
        self.closing = True
        for conn in self._conns.values():
            _hang_up(conn)


class FollowerChannel(Channel):
    """A follower's end: a reader thread queues rank 0's broadcasts; a heartbeat thread reports the
    phase. Rank 0 gone (connection closed) calls `on_lost`, by default ending this process: its main
    thread may be inside a collective that rank 0 will never join."""

    def __init__(self, sock: socket.socket, rank: int, size: int, on_lost: Callable[[str], None]) -> None:
        self.rank, self.size = rank, size
        self._sock = sock
        self._lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._phase = "connected"
        self._stop = threading.Event()
        self._ended = False  # rank 0's last broadcast came: its hang-up is the end, not a loss
        self.on_lost = on_lost
        threading.Thread(target=self._read, name="mlxhost-rank0-reader", daemon=True).start()
        threading.Thread(target=self._beat, name="mlxhost-heartbeat", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                kind, obj = _recv(self._sock)
            except (OSError, ConnectionError, EOFError, pickle.UnpicklingError) as exc:
                # Before the last broadcast the main thread may be stuck in a collective that rank 0
                # will never join; after it, the main thread is only closing its engine (and exits 0), given
                # a while to do so: a rank that hangs while closing still ends (nobody else ends a launcher's).
                reason = f"rank 0 closed its connection ({exc})"
                if not self._stop.is_set() and not self._ended:
                    self.on_lost(reason)
                elif not self._stop.is_set():
                    timer = threading.Timer(CLOSE_AFTER_LAST_S, self._late, args=(reason,))
                    timer.daemon = True
                    timer.start()
                self._inbox.put(LostRank(reason))
                return
            if kind in (BROADCAST, LAST):
                self._ended = kind == LAST
                self._inbox.put(obj)

    def _late(self, reason: str) -> None:
        if not self._stop.is_set():
            self.on_lost(f"{reason}, and this rank did not finish closing within {CLOSE_AFTER_LAST_S:.0f} s")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                _send(self._sock, self._lock, PHASE, self._phase)
            except OSError:
                return

    def broadcast(self, obj: Any = None) -> Any:
        got = self._inbox.get()
        if isinstance(got, LostRank):
            raise got
        return got

    def gather(self, obj: Any) -> None:
        _send(self._sock, self._lock, GATHER, obj)
        return None

    def set_phase(self, phase: str) -> None:
        if phase != self._phase:
            self._phase = phase
            try:
                _send(self._sock, self._lock, PHASE, phase)
            except OSError:
                pass

    def report_step(self, step: int, wait_s: float, run_s: float, signature: int) -> None:
        try:
            _send(self._sock, self._lock, STEP, (step, wait_s, run_s, signature))
        except OSError:
            pass  # rank 0 hung up: the reader thread tells a loss from the end (after the last broadcast)

    def report_error(self, reason: str) -> None:
        try:
            _send(self._sock, self._lock, ERROR, reason)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        try:
            _send(self._sock, self._lock, BYE, None)
        except OSError:
            pass
        _hang_up(self._sock)


class ControlServer:
    """Rank 0's listening socket, open before the other ranks start (they connect to it first). A
    connection must open with this start's random token: the frames after it are pickles."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None) -> None:
        self.sock = socket.create_server((host, port), backlog=64)
        self.host = advertise or host
        self.port = self.sock.getsockname()[1]
        self.token = secrets.token_hex(16)

    @property
    def address(self) -> str:
        """`host:port/token`: what a rank needs to connect."""
        return f"{self.host}:{self.port}/{self.token}"

    def accept(self, size: int, timeout_s: float, dead: Callable[[], str | None] = lambda: None) -> LeadChannel:
        """Waits for ranks 1..size-1; `dead()` names a rank process that exited (checked between tries)."""
        conns: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout_s
        self.sock.settimeout(0.2)
        try:
            while len(conns) < size - 1:
                gone = dead()
                if gone is not None:
                    raise LostRank(f"{gone} before it connected")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, size)) - set(conns))
                    raise LostRank(f"rank(s) {missing} did not connect within {timeout_s:.0f} s")
                try:
                    conn, _ = self.sock.accept()
                except socket.timeout:
                    continue
                conn.settimeout(10)
                try:
                    rank, token = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
                except (OSError, ConnectionError, struct.error):
                    conn.close()
                    continue
                if not hmac.compare_digest(token, self.token.encode()) or not 0 < rank < size or rank in conns:
                    log.warning("refused a connection to the control port (rank %d, wrong token or rank)", rank)
                    conn.close()
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[rank] = conn
        finally:
            self.sock.close()
        return LeadChannel(conns, size)


def connect(address: str, rank: int, size: int, on_lost: Callable[[str], None],
            timeout_s: float = 120.0) -> FollowerChannel:
    """A follower's connection to rank 0's control port, `host:port/token` (retried while rank 0 is
    not listening yet)."""
    where, token = address.rsplit("/", 1)
    host, port = where.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(_HELLO.pack(rank, token.encode()))
    return FollowerChannel(sock, rank, size, on_lost)
