"""The liveness watch over plain sockets on 127.0.0.1, in one process: a peer whose connection
closes is lost at once, a silent one after the timeout, one that says goodbye never."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from paxpage.liveness import Liveness

TIMEOUT_S = 0.6


class Seen:
    def __init__(self):
        self.lost = []
        self.event = threading.Event()

    def __call__(self, pid, reason):
        self.lost.append((pid, reason, time.monotonic()))
        self.event.set()


def _leader_and_peer(num_processes: int, connect):
    """Starts a leader in a thread; `connect(pid, address)` plays each follower."""
    seen, published, box = Seen(), threading.Event(), {}

    def publish(address):
        box["address"] = address
        published.set()

    thread = threading.Thread(target=lambda: box.setdefault("leader", Liveness.leader(
        "127.0.0.1", num_processes, publish, timeout_s=TIMEOUT_S, connect_timeout_s=10, on_lost=seen)))
    thread.start()
    assert published.wait(10)
    peers = [connect(pid, box["address"]) for pid in range(1, num_processes)]
    thread.join(10)
    return box["leader"], peers, seen


def _follower(seen):
    return lambda pid, address: Liveness.follower(pid, address, timeout_s=TIMEOUT_S, connect_timeout_s=10,
                                                  on_lost=seen)


def test_a_closed_connection_is_lost_at_once_and_named():
    follower_seen = Seen()
    leader, followers, seen = _leader_and_peer(3, _follower(follower_seen))
    time.sleep(TIMEOUT_S * 2)  # heartbeats keep both sides alive past the timeout
    assert seen.lost == [] and follower_seen.lost == []
    t0 = time.monotonic()
    followers[1]._closed.set()  # process 2 ends without a goodbye: its kernel closes the socket
    followers[1]._peers[0].close()
    assert seen.event.wait(5)
    pid, reason, at = seen.lost[0]
    assert pid == 2 and "closed" in reason and at - t0 < TIMEOUT_S / 2
    assert leader.lost == (2, reason)
    followers[0].close()
    leader.close()


def test_a_silent_peer_is_lost_after_the_timeout():
    def mute(pid, address):  # says hello, then never a heartbeat, and keeps the socket open
        host, port = address.rsplit(":", 1)
        conn = socket.create_connection((host, int(port)))
        conn.sendall(f"{pid}\n".encode())
        return conn

    t0 = time.monotonic()
    leader, conns, seen = _leader_and_peer(2, mute)
    assert seen.event.wait(5)
    pid, reason, at = seen.lost[0]
    assert pid == 1 and "nothing came from it" in reason
    assert TIMEOUT_S <= at - t0 < TIMEOUT_S * 3
    conns[0].close()
    leader.close()


def test_a_goodbye_is_no_loss():
    follower_seen = Seen()
    leader, followers, seen = _leader_and_peer(2, _follower(follower_seen))
    leader.close(goodbye=True)
    time.sleep(TIMEOUT_S * 2)
    followers[0].close()
    assert seen.lost == [] and follower_seen.lost == []


def test_a_stranger_is_turned_away():
    def stranger_then_follower(pid, address):
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"not a process id\n")
        return _follower(Seen())(pid, address)

    leader, followers, seen = _leader_and_peer(2, stranger_then_follower)
    assert sorted(leader._peers) == [1]
    followers[0].close()
    leader.close(goodbye=True)


def test_a_missing_follower_times_out_naming_it():
    with pytest.raises(TimeoutError, match=r"processes \[1\] did not open"):
        Liveness.leader("127.0.0.1", 2, lambda address: None, timeout_s=1, connect_timeout_s=0.3,
                        on_lost=Seen())
