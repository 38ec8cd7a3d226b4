"""A cluster on one machine: N "nodes" as Linux network namespaces on a private bridge.

Each node has its own network stack (loopback, an address on the bridge, `eth0`), its own
hostname (a UTS namespace: `socket.gethostname()` in the node says `grtc<pid>c<k>n<i>`), a hosts
file naming every node (/etc/netns/<ns>/hosts, bound over /etc/hosts for what runs there,
as `ip netns exec` does), and its own sshd (host and user keys made per cluster, root login by
key). The filesystem is shared, as on a cluster with a shared home/scratch. Nothing here
touches the machine's own network, /etc/hosts, ~/.ssh or a running sshd; /etc/netns and
/run/sshd (sshd's privilege separation directory) are removed by the last stop() if made here.

    cluster = NetnsCluster(workdir, nodes=2).start()   # raises ClusterUnavailable with the reason
    cluster.run(0, ["hostname"])                        # a command on node 0 (its env: cluster.env)
    proc = cluster.popen(1, ["python", ...])            # in the background on node 1
    cluster.stop()                                      # kills every process in the nodes, removes them

`ssh` resolves the nodes through the cluster's own ssh_config: `cluster.env` puts a wrapper
`ssh` (`ssh -F <workdir>/ssh/config`) first on PATH, which pdsh and mpirun use as they are.
Run it as root (docs/launching.md has the commands to rehearse a launch script by hand).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import IO

from slurm_cluster import SlurmCluster, _pid_alive, _tool

PREFIX = "grtc"  # namespaces, links and node names: grtc<owner pid>...
SSH_PORT = 2222
NETNS_ETC = "/etc/netns"


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be built here; the message says why (the tests' skip reason)."""


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (
        ("ip", "iproute2"),
        ("unshare", "util-linux"),
        ("nsenter", "util-linux"),
        ("sshd", "openssh-server"),
        ("ssh", "openssh-client"),
        ("ssh-keygen", "openssh-client"),
    ):
        if not os.path.exists(_tool(tool)):
            return f"{tool} not installed (Debian package {package})"
    name = f"{PREFIX}{os.getpid()}probe"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ClusterUnavailable(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in namespace `ns` (until none is left), then delete it."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)


def reap_stale() -> list[str]:
    """Remove namespaces, links and /etc/netns entries of clusters whose test process is gone
    (an entry outlives its namespace when a run dies between `ip netns del` and removing it)."""
    reaped = []
    pattern = re.compile(re.escape(PREFIX) + r"(\d+)")

    def stale(name: str) -> bool:
        m = pattern.match(name)
        return m is not None and not _pid_alive(int(m.group(1)))

    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if stale(ns):
            _kill_namespace(ns)
            reaped.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        link = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if stale(link):
            _ip("link", "del", link, check=False)
            reaped.append(link)
    for entry in os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []:
        if stale(entry):
            shutil.rmtree(os.path.join(NETNS_ETC, entry), ignore_errors=True)
            reaped.append(entry)
    return reaped


_clusters_made = 0  # in this process: part of the names, so that two clusters can be up at once
# The directories that clusters need and this process created (absent before): removed by the
# last cluster's stop, so that the machine is left as found. A directory that another process
# created stays (it cannot tell whether it was there before).
SHARED_DIRS = (NETNS_ETC, "/run/sshd")  # /run/sshd: sshd's privilege separation directory
_dirs_made: set[str] = set()


def _make_shared_dir(path: str) -> None:
    try:
        os.mkdir(path)
        _dirs_made.add(path)
    except FileExistsError:
        pass


def _remove_shared_dirs() -> None:
    """rmdir what this process made, once no cluster (of any process) is up: /run/sshd is empty
    while another cluster's sshd needs it."""
    if any(line.startswith(PREFIX) for line in _ip("netns", "list", check=False).stdout.splitlines()):
        return
    for path in list(_dirs_made):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:  # not empty: another tool's entries
            continue
        _dirs_made.discard(path)


class NetnsCluster:
    def __init__(self, workdir: str, nodes: int = 2):
        # <= 15 characters for every link name: grtc + pid (<= 7 digits) + c<k> + br / v<i>
        if not 1 <= nodes <= 10:
            raise ValueError(f"1 to 10 nodes (link names are limited to 15 characters), not {nodes}")
        self.dir = os.path.abspath(workdir)
        self.n = nodes
        global _clusters_made
        _clusters_made += 1
        self.prefix = f"{PREFIX}{os.getpid()}c{_clusters_made % 10}"
        # each cluster's bridge is a segment of its own: distinct subnets only for people reading logs
        self.net = ipaddress.ip_network(f"10.213.{(os.getpid() + _clusters_made) % 254 + 1}.0/24")
        self.bridge = f"{self.prefix}br"
        self.names = [f"{self.prefix}n{i}" for i in range(nodes)]  # hostnames, and the namespaces' names
        self.addrs: list[str] = []
        self.ssh_dir = os.path.join(self.dir, "ssh")
        self.bin_dir = os.path.join(self.dir, "bin")
        self.ssh_config = os.path.join(self.ssh_dir, "config")
        self.sshd: list[subprocess.Popen] = []
        self._logs: list[IO] = []  # the sshd logs, closed by stop()
        self._created: list[str] = []

    # ----------------------------------------------------------------- running things in a node
    @property
    def env(self) -> dict[str, str]:
        """This environment with the cluster's `ssh` wrapper first on PATH."""
        env = dict(os.environ)
        env["PATH"] = self.bin_dir + os.pathsep + env.get("PATH", "")
        return env

    def node_command(self, node: int, cmd: list[str]) -> list[str]:
        """`cmd` run on node `node`: in its network namespace, with its hostname (a UTS namespace)
        and its hosts file (bound over /etc/hosts in a mount namespace of its own). Not `ip netns
        exec`: that mounts a fresh /sys, without the cgroup hierarchy slurmd needs."""
        ns = self.names[node]
        return [
            "nsenter",
            f"--net=/run/netns/{ns}",
            "unshare",
            "--mount",
            "--propagation",
            "slave",
            "--uts",
            "sh",
            "-c",
            f'mount --bind {NETNS_ETC}/{ns}/hosts /etc/hosts && hostname "$0" && exec "$@"',
            self.names[node],
            *cmd,
        ]

    def popen(self, node: int, cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.node_command(node, cmd), env=env or self.env, **kw)

    def run(
        self,
        node: int,
        cmd: list[str],
        env: dict[str, str] | None = None,
        timeout: float = 60,
        check: bool = True,
        **kw,
    ) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        r = subprocess.run(self.node_command(node, cmd), env=env or self.env, text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise ClusterUnavailable(
                f"on {self.names[node]}: {' '.join(cmd)} exited {r.returncode}: {(r.stderr or '')[-2000:]}"
            )
        return r

    def pids(self, node: int) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.names[node], check=False).stdout.split()]

    def hostfile(self, slots: int = 1) -> str:
        """A DeepSpeed/OpenMPI hostfile naming every node (written into the cluster's dir)."""
        path = os.path.join(self.dir, "hostfile")
        with open(path, "w") as f:
            f.write("".join(f"{name} slots={slots}\n" for name in self.names))
        return path

    def link_down(self, node: int) -> None:
        """Cut node `node` off the network (its end of the link), as a failed NIC or switch port would."""
        _ip("-n", self.names[node], "link", "set", "eth0", "down")

    def link_up(self, node: int) -> None:
        _ip("-n", self.names[node], "link", "set", "eth0", "up")

    # ----------------------------------------------------------------- start / stop
    def start(self, timeout: float = 30) -> NetnsCluster:
        """Bring the nodes up; on any failure remove what was made, then raise."""
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        reap_stale()
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        hosts = list(self.net.hosts())
        self.addrs = [str(hosts[i + 1]) for i in range(self.n)]
        os.makedirs(self.dir, exist_ok=True)
        for path in SHARED_DIRS:
            _make_shared_dir(path)
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts_text = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(self.addrs, self.names))
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self._created.append(ns)
            os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                f.write(hosts_text)
            veth = f"{self.prefix}v{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/{self.net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        self._start_ssh(timeout)

    def _start_ssh(self, timeout: float) -> None:
        shutil.rmtree(self.ssh_dir, ignore_errors=True)  # a former cluster's keys: ssh-keygen would ask to overwrite
        os.makedirs(self.ssh_dir)
        os.makedirs(self.bin_dir, exist_ok=True)
        key = os.path.join(self.ssh_dir, "id_ed25519")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        shutil.copy(key + ".pub", os.path.join(self.ssh_dir, "authorized_keys"))
        known = []
        for i, name in enumerate(self.names):
            host_key = os.path.join(self.ssh_dir, f"host_{name}")
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key], check=True)
            pub = open(host_key + ".pub").read().split()[:2]
            known.append(f"[{name}]:{SSH_PORT},[{self.addrs[i]}]:{SSH_PORT} {' '.join(pub)}\n")
            conf = os.path.join(self.ssh_dir, f"sshd_{name}.conf")
            with open(conf, "w") as f:
                f.write(
                    f"Port {SSH_PORT}\nListenAddress {self.addrs[i]}\nHostKey {host_key}\n"
                    f"PidFile {self.ssh_dir}/sshd_{name}.pid\n"
                    f"AuthorizedKeysFile {self.ssh_dir}/authorized_keys\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                    # as many parallel logins as pdsh and mpirun open at once
                    "MaxStartups 100\nMaxSessions 100\n"
                )
            self._logs.append(open(os.path.join(self.ssh_dir, f"sshd_{name}.log"), "w"))
            self.sshd.append(
                self.popen(i, [_tool("sshd"), "-D", "-e", "-f", conf], stdout=self._logs[-1], stderr=subprocess.STDOUT)
            )
        with open(os.path.join(self.ssh_dir, "known_hosts"), "w") as f:
            f.writelines(known)
        with open(self.ssh_config, "w") as f:
            f.write(
                f"Host {' '.join(self.names)} {' '.join(self.addrs)}\n  User root\n  Port {SSH_PORT}\n"
                f"  IdentityFile {key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {self.ssh_dir}/known_hosts\n"
                "  StrictHostKeyChecking yes\n  BatchMode yes\n  LogLevel ERROR\n"
            )
        wrapper = os.path.join(self.bin_dir, "ssh")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {self.ssh_config} "$@"\n')
        os.chmod(wrapper, 0o755)
        for i, name in enumerate(self.names):  # `<dir>/bin/<node> CMD...`: CMD on that node, for people
            script = os.path.join(self.bin_dir, name)
            with open(script, "w") as f:
                f.write(
                    f'#!/bin/sh\nexport PATH={shlex.quote(self.bin_dir)}:"$PATH"\n[ $# -gt 0 ] || set -- bash\n'
                    f'exec {shlex.join(self.node_command(i, []))} "$@"\n'
                )
            os.chmod(script, 0o755)
        # every node reaches every node's sshd (and knows its name)
        deadline = time.time() + timeout
        for i in range(self.n):
            for j in range(self.n):
                while True:
                    r = self.run(i, ["ssh", self.names[j], "hostname"], check=False, timeout=timeout)
                    if r.returncode == 0 and r.stdout.strip() == self.names[j]:
                        break
                    if time.time() > deadline or self.sshd[j].poll() is not None:
                        raise ClusterUnavailable(
                            f"ssh from {self.names[i]} to {self.names[j]} failed: {r.stderr.strip()[-1000:]}"
                        )
                    time.sleep(0.2)

    def stop(self) -> None:
        """Kill every process in the nodes, delete the namespaces, their links and the bridge, and
        the directories that the cluster made (once no other cluster is up)."""
        for ns in reversed(self._created):
            if ns in self.names:
                _kill_namespace(ns)
        for p in self.sshd:  # SIGKILLed with their namespace; bounded: one stuck in the kernel must not hang stop()
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.sshd.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self.bridge in self._created:
            _ip("link", "del", self.bridge, check=False)
        self._created.clear()
        _remove_shared_dirs()


def started_or_skip(workdir: str, nodes: int = 2) -> Iterator[NetnsCluster]:
    """A module fixture's body: a started cluster, stopped after the module; pytest.skip with
    the reason where this machine cannot run one."""
    import pytest

    cluster = NetnsCluster(workdir, nodes=nodes)
    try:
        cluster.start()
    except ClusterUnavailable as e:
        pytest.skip(f"no namespace cluster: {e}")
    yield cluster
    cluster.stop()


def netns_slurm(cluster: NetnsCluster, state_dir: str):
    """A Slurm cluster on the namespace nodes: munged and slurmctld on node 0, `slurmd -N <node>`
    on every node (own spool, pid and log files: SlurmdSpoolDir=<sockets>/spool/%n), clients on node 0.
    Its own state dir, SLURM_CONF, ports and munge socket: one-node test clusters are not touched."""

    class NetnsSlurm(SlurmCluster):
        def node_addrs(self) -> dict[str, str]:
            return dict(zip(cluster.names, cluster.addrs))

        def where(self, name: str, cmd: list[str]) -> list[str]:
            node = cluster.names.index(name[len("slurmd-") :]) if name.startswith("slurmd-") else 0
            return cluster.node_command(node, cmd)

    slurm = NetnsSlurm(state_dir, name="grtnetns")
    slurm.host = cluster.names[0]
    return slurm


def main(argv=None) -> int:
    """`python tests/netns_cluster.py DIR [--nodes N] [--slurm]`: bring a cluster up until Ctrl-C."""
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python tests/netns_cluster.py",
        description="A cluster of network namespaces on this machine (as root), up until Ctrl-C; docs/launching.md",
    )
    p.add_argument("dir", help="the cluster's directory (keys, configs, hostfile, logs)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--slurm", action="store_true", help="also slurmctld on node 0 and a slurmd on every node")
    args = p.parse_args(argv)
    cluster = slurm = None
    # a signal ends the loop below as Ctrl-C does, also while the cluster comes up: stop() runs
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    try:
        cluster = NetnsCluster(args.dir, args.nodes)
        cluster.start()
        if args.slurm:
            slurm = netns_slurm(cluster, os.path.join(cluster.dir, "slurm")).start()
        print(
            f"nodes: {', '.join(f'{n} ({a})' for n, a in zip(cluster.names, cluster.addrs))}\n"
            f"hostfile: {cluster.hostfile()}\n"
            f"a shell on node 0: {os.path.join(cluster.bin_dir, cluster.names[0])}  (a command: ... CMD ARGS)"
            + (f"\nSlurm: export SLURM_CONF={slurm.conf}" if slurm else "")
            + "\nCtrl-C tears it down.",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        return 0
    except (ClusterUnavailable, RuntimeError, ValueError) as e:  # slurm_cluster.SlurmUnavailable; --nodes
        print(f"netns_cluster: {e}", file=sys.stderr)
        return 1
    finally:
        if slurm is not None:
            slurm.stop()
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
