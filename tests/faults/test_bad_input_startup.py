"""Start-up of the process group with a bad rendezvous (issue 27, part 6), and the tests' port picker.

The rendezvous store is the TCPStore that torch.distributed's env:// start opens on rank 0 at
MASTER_ADDR:MASTER_PORT before NCCL or gloo exist. When another process holds MASTER_PORT,
rank 0 must say so in one line naming the port and MASTER_PORT, and the other ranks must stop
within the start-up timeout (train.dist_timeout_s) saying they could not reach rank 0's store,
instead of waiting for ever: before, rank 0 died with a traceback and rank 1, connected to
whatever listened on the port, waited for torch's handshake without any limit.

The ports of every multi-process test come from multiproc.free_port(), which reserves each
port it hands out, so that two concurrent tests are never given the same one (tested below).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from commands import train_command
from multiproc import TEST_PORTS, free_port, release_port, start_ranks

from pretrain.distributed import DistInfo, RendezvousError, discover

TESTS = Path(__file__).resolve().parents[1]

# Ports outside TEST_PORTS for the picker's own tests, so that they never take one from a test
# running beside them; each test uses its own small slice.
HELD_BY_CHILD = range(14900, 14912)
SHARED_BY_THREE = range(14920, 14944)
IN_USE = range(14960, 14970)

# A child that reserves N ports of range(LO, HI), prints them, and keeps them until stdin closes.
RESERVE = (
    "import sys; sys.path.insert(0, sys.argv[1]); from multiproc import free_port; "
    "lo, hi, n = map(int, sys.argv[2:5]); "
    "print(' '.join(str(free_port(range(lo, hi))) for _ in range(n)), flush=True); sys.stdin.read()"
)


def reserve_in_child(ports: range, n: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RESERVE, str(TESTS), str(ports.start), str(ports.stop), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def child_ports(proc: subprocess.Popen) -> set[int]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip(), f"the child reserved nothing (exit {proc.wait()})"
    return {int(p) for p in line.split()}


@contextmanager
def listening(port: int) -> Iterator[socket.socket]:
    """A socket of another program listening on `port` on every address (it never accepts)."""
    s = socket.socket()
    s.bind(("0.0.0.0", port))
    s.listen()
    try:
        yield s
    finally:
        s.close()


# --------------------------------------------------------------------------- the port picker


@pytest.fixture
def picker_ranges() -> Iterator[None]:
    """The ranges above to this test alone: a test session running beside this one (another
    checkout's) waits here instead of reserving ports of the same slices."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 120
    while True:
        try:
            lock.bind("\0grt-test-port-picker-tests")
            break
        except OSError:
            assert time.monotonic() < deadline, "another test session held the port picker's test ranges for 120 s"
            time.sleep(0.2)
    try:
        yield
    finally:
        for port in (*HELD_BY_CHILD, *SHARED_BY_THREE, *IN_USE):
            release_port(port)
        lock.close()


@pytest.mark.usefixtures("picker_ranges")
def test_free_port_never_hands_out_a_port_another_process_reserved():
    """A port reserved by one test process is skipped by every other, until that process
    ends (here: SIGKILL, which runs no clean-up: the kernel drops the reservation)."""
    child = reserve_in_child(HELD_BY_CHILD, 8)
    try:
        theirs = child_ports(child)
        assert len(theirs) == 8 and theirs <= set(HELD_BY_CHILD)
        mine = set()
        with pytest.raises(RuntimeError, match="no free port left"):
            for _ in range(len(HELD_BY_CHILD)):
                mine.add(free_port(HELD_BY_CHILD))
        assert not mine & theirs
        assert mine == {p for p in HELD_BY_CHILD if p not in theirs and _bindable(p)}
    finally:
        child.kill()
        child.wait()
    # the child's ports are free again, and this process still never gives one of its own twice
    again = set()
    with pytest.raises(RuntimeError):
        for _ in range(len(HELD_BY_CHILD)):
            again.add(free_port(HELD_BY_CHILD))
    assert again == theirs


@pytest.mark.usefixtures("picker_ranges")
def test_free_port_concurrent_processes_never_share_a_port():
    """Three processes that start at once, each taking 8 ports of the same 24, get 24 different ports."""
    children = [reserve_in_child(SHARED_BY_THREE, 8) for _ in range(3)]
    try:
        sets = [child_ports(c) for c in children]
    finally:
        for c in children:
            c.kill()
            c.wait()
    assert [len(s) for s in sets] == [8, 8, 8]
    assert len(set().union(*sets)) == 24 and set().union(*sets) == set(SHARED_BY_THREE)


@pytest.mark.usefixtures("picker_ranges")
def test_free_port_skips_a_port_in_use_and_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:  # the kernel's, not this machine's
        low, high = map(int, f.read().split())
    assert not set(TEST_PORTS) & set(range(low, high + 1)) and 29500 not in TEST_PORTS
    port = next(p for p in IN_USE if _bindable(p))
    with listening(port), pytest.raises(RuntimeError, match="no free port left"):
        free_port(range(port, port + 1))


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- in-process checks


@pytest.mark.parametrize("value", ["abc", "70000", "-1", "29500x"])
def test_bad_master_port_is_one_line(value):
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": value}
    with pytest.raises(RendezvousError) as err:
        discover(env)
    assert str(err.value) == (f"MASTER_PORT={value!r}: not a port number; set MASTER_PORT to a free port in 1-65535")


def test_rank0_on_a_taken_port_is_one_line_naming_it():
    from pretrain.distributed import open_store

    port = free_port()
    with listening(port):
        with pytest.raises(RendezvousError) as err:
            open_store(DistInfo(rank=0, world_size=2, master_port=port, launcher="torchrun/deepspeed"), 5)
    assert str(err.value) == (
        f"rank 0 cannot listen on MASTER_PORT={port} for the process group's store: address already in use "
        "(another process holds the port); set MASTER_PORT to a free port"
    )
    with pytest.raises(RendezvousError, match="MASTER_PORT=0: the 2 ranks need one port that they all know"):
        open_store(DistInfo(rank=0, world_size=2, master_port=0, launcher="torchrun/deepspeed"), 5)


@pytest.mark.parametrize("held", [True, False], ids=["port held by another program", "nothing listening"])
def test_other_rank_gives_up_within_the_timeout(held):
    from pretrain.distributed import reach_store

    port = free_port()
    info = DistInfo(rank=1, world_size=2, master_port=port, launcher="torchrun/deepspeed")
    with listening(port) if held else _nothing():
        start = time.monotonic()
        with pytest.raises(RendezvousError) as err:
            reach_store(info, 2.0)
        took = time.monotonic() - start
    why = "the port accepts connections but no store answers there" if held else "Connection refused"
    assert str(err.value) == (
        f"rank 1 could not reach rank 0's store at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 2 s "
        f"(the start-up timeout, train.dist_timeout_s in grt train): {why}; "
        "check that rank 0 started and that MASTER_PORT is free on its host"
    )
    assert 1.9 <= took < 6.0, took


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# --------------------------------------------------------------------------- real ranks

TIMEOUT_S = 10


def _train_args(manifest: Path, out: Path) -> list[str]:
    return [
        "-m",
        "pretrain.cli",
        *train_command("micro-grt", manifest, out, 2, None, None, [f"train.dist_timeout_s={TIMEOUT_S}"]),
    ]


@pytest.mark.slow
def test_taken_master_port_is_one_line_and_every_rank_stops(shards, tmp_path):
    """Two `grt train` ranks, MASTER_PORT held by a listening socket of this test: rank 0
    exits 2 at once with one line naming the port and MASTER_PORT; rank 1 exits 2 within
    train.dist_timeout_s of it, naming rank 0's store at host:port. (Before: rank 0 a
    traceback, rank 1 waiting for ever; this test then failed on its own time limit.)"""
    port = free_port()
    with listening(port):
        start = time.monotonic()
        procs = start_ranks(_train_args(shards, tmp_path / "run"), world=2, port=port)
        ended = {}
        try:
            while len(ended) < 2 and time.monotonic() - start < TIMEOUT_S + 120:
                for r, p in enumerate(procs):
                    if r not in ended and p.poll() is not None:
                        ended[r] = time.monotonic() - start
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
            outs = [p.communicate()[0] for p in procs]
    assert len(ended) == 2, f"rank(s) {sorted(set(range(2)) - set(ended))} still waiting:\n" + "\n----\n".join(outs)
    for r, out in enumerate(outs):
        assert procs[r].returncode == 2, out
        assert "Traceback" not in out, out
        errors = [line for line in out.splitlines() if "error" in line.lower()]
        assert len(errors) == 1, out
        assert errors[0] == out.strip().splitlines()[-1]
    assert outs[0].strip().splitlines()[-1] == (
        f"grt train: error: rank 0 cannot listen on MASTER_PORT={port} for the process group's store: "
        "address already in use (another process holds the port); set MASTER_PORT to a free port"
    )
    assert (
        outs[1]
        .strip()
        .splitlines()[-1]
        .startswith(
            f"grt train: error: rank 1 could not reach rank 0's store at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) "
            f"within {TIMEOUT_S} s"
        )
    )
    # both reach the store after the same imports: rank 1 gives up one timeout after rank 0 failed
    assert ended[1] - ended[0] < TIMEOUT_S + 8, ended
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    print(f"STARTUP taken port {port}: rank 0 exit 2 after {ended[0]:.1f} s, rank 1 exit 2 after {ended[1]:.1f} s")
