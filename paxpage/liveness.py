"""Liveness of the processes of a multi-host run: a TCP connection from every follower to process
0, beside jax.distributed, on which each side sends a heartbeat byte every `timeout_s / 4`.

A peer is lost when its connection closes (the process died: its kernel closes the socket) or
when nothing came from it for `timeout_s` (its host froze or the network went away, which closes
nothing, so a collective waiting for it would wait for as long as gloo's own timeout). The
watchdog thread then calls `on_lost(process_id, reason)` once. What to do about it is the caller's
(paxpage/multihost.py): a follower exits, process 0 fails its requests. A peer that ends the run
cleanly first says goodbye (`close(goodbye=True)`), and is no longer watched.

Process 0 listens on an ephemeral port of the coordinator's host and publishes "HOST:PORT" in
jax.distributed's key-value store; each follower reads it, connects and sends its process id.
Plain sockets and one thread per process; no jax here.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Callable

OnLost = Callable[[int, str], None]
BEAT, GOODBYE = b".", b"!"


class Liveness:
    """One process's side: process 0 holds one connection per follower, a follower one to
    process 0. `lost` is (process id, reason) once a peer is lost, else None."""

    def __init__(self, process_id: int, peers: dict[int, socket.socket], timeout_s: float, on_lost: OnLost):
        self.process_id = process_id
        self.timeout_s = timeout_s
        self.lost: tuple[int, str] | None = None
        self._peers = peers
        self._on_lost = on_lost
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="paxpage-liveness", daemon=True)
        self._thread.start()

    # ---- setting up ------------------------------------------------------------------------------
    @classmethod
    def leader(cls, host: str, num_processes: int, publish: Callable[[str], None], *, timeout_s: float,
               connect_timeout_s: float, on_lost: OnLost) -> "Liveness":
        """Process 0: listens, publishes its address, waits for every follower's hello."""
        server = _listen(host)
        try:
            publish(f"{host}:{server.getsockname()[1]}")
            peers: dict[int, socket.socket] = {}
            deadline = time.monotonic() + connect_timeout_s
            while len(peers) < num_processes - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, num_processes)) - set(peers))
                    raise TimeoutError(f"processes {missing} did not open their liveness connection to process 0 "
                                       f"within {connect_timeout_s:g} s")
                server.settimeout(left)
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                conn.settimeout(left)
                try:
                    hello = _read_line(conn)
                    pid = int(hello)
                except (OSError, ValueError):
                    conn.close()  # not one of ours
                    continue
                if not 1 <= pid < num_processes or pid in peers:
                    conn.close()
                    continue
                peers[pid] = conn
        finally:
            server.close()
        return cls(0, peers, timeout_s, on_lost)

    @classmethod
    def follower(cls, process_id: int, address: str, *, timeout_s: float, connect_timeout_s: float,
                 on_lost: OnLost) -> "Liveness":
        host, port = address.rsplit(":", 1)
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=connect_timeout_s)
        conn.sendall(f"{process_id}\n".encode())
        return cls(process_id, {0: conn}, timeout_s, on_lost)

    # ---- the watchdog ----------------------------------------------------------------------------
    def _watch(self) -> None:
        try:
            self._beat_and_listen()
        except (OSError, ValueError) as e:  # select on a socket close() just shut
            if not self._closed.is_set():
                self._lose(next(iter(self._peers)), f"its liveness connection failed ({e})")

    def _beat_and_listen(self) -> None:
        interval = self.timeout_s / 4
        now = time.monotonic()
        heard = {pid: now for pid in self._peers}
        for conn in self._peers.values():
            conn.setblocking(False)
        next_beat = now
        while not self._closed.is_set() and self.lost is None:
            now = time.monotonic()
            if now >= next_beat:
                for pid in heard:
                    try:
                        self._peers[pid].send(BEAT)
                    except BlockingIOError:
                        pass  # a full buffer: the peer is not reading, which its silence will show
                    except OSError as e:
                        return self._lose(pid, f"its liveness connection failed ({e.strerror or e})")
                next_beat = now + interval
            readable, _, _ = select.select([self._peers[pid] for pid in heard], [], [], max(0.0, next_beat - now))
            now = time.monotonic()
            for pid in list(heard):
                conn = self._peers[pid]
                if conn not in readable:
                    continue
                try:
                    data = conn.recv(4096)
                except BlockingIOError:
                    continue
                except ConnectionResetError:  # it ended with our heartbeats unread
                    return self._lose(pid, "its liveness connection closed (the process ended)")
                except OSError as e:
                    return self._lose(pid, f"its liveness connection failed ({e.strerror or e})")
                if GOODBYE in data:  # the peer ends the run: it is no longer watched
                    heard.pop(pid, None)
                    continue
                if not data:
                    return self._lose(pid, "its liveness connection closed (the process ended)")
                heard[pid] = now
            if not heard:
                return
            for pid, last in heard.items():
                if now - last > self.timeout_s:
                    return self._lose(pid, f"nothing came from it for {now - last:.1f} s "
                                           f"(the peer timeout is {self.timeout_s:g} s)")

    def _lose(self, pid: int, reason: str) -> None:
        if self._closed.is_set():
            return  # closing down: our own sockets closing is no loss
        self.lost = (pid, reason)
        self._on_lost(pid, reason)

    def close(self, goodbye: bool = False) -> None:
        """Stops the watchdog and closes the connections; `goodbye`: tells the peers first that
        this is the run's clean end, not a loss."""
        self._closed.set()
        for conn in self._peers.values():
            try:
                if goodbye:
                    conn.setblocking(True)
                    conn.settimeout(1.0)
                    conn.sendall(GOODBYE)
                conn.close()
            except OSError:
                pass


def _listen(host: str) -> socket.socket:
    """A listening socket on `host` (the coordinator's, reachable by the followers); all
    interfaces when `host` is not one of this machine's addresses."""
    for bind_host in (host.strip("[]"), ""):
        try:
            family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
            server = socket.socket(family, socket.SOCK_STREAM)
            server.bind((bind_host, 0))
        except OSError:
            server.close()
            continue
        server.listen(64)
        return server
    raise OSError(f"cannot listen for liveness connections on {host!r}")


def _read_line(conn: socket.socket, limit: int = 32) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk or len(data) > limit:
            raise ValueError("no hello")
        data += chunk
    return data.decode().strip()
