"""A real Slurm cluster for tests: munged + slurmctld + slurmd on this machine (one node;
netns_cluster.NetnsSlurm runs one slurmd on each node of a namespace cluster).

Everything lives in one state directory (keys, config, logs, pid files; the Unix sockets and
slurmd's spool in a short directory of their own beside it) and uses its own munge socket and
free ports, so it neither needs nor touches /etc/munge, /etc/slurm or a Slurm that may already
run here.  Clients reach it through `SLURM_CONF` (see `env`).

    cluster = SlurmCluster(state_dir)   # kills daemons a previous run left in that dir
    cluster.start()                     # raises SlurmUnavailable with the reason if it can't
    subprocess.run(["sbatch", ...], env=cluster.env)
    cluster.stop()
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "scancel")
DAEMON_NAMES = ("munged", "slurmctld", "slurmd", "slurmstepd")


class SlurmUnavailable(RuntimeError):
    """The cluster cannot run here; the message says why (used as the skip reason)."""


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None and not os.path.exists(os.path.join("/usr/sbin", t))]


def _tool(name: str) -> str:
    return shutil.which(name) or os.path.join("/usr/sbin", name)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node_resources() -> dict[str, int]:
    cpus = os.cpu_count() or 1
    mem_mb = 1024
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_mb = int(line.split()[1]) // 1024
    except OSError:
        pass
    return {"cpus": cpus, "mem_mb": max(256, int(mem_mb * 0.8))}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class SlurmCluster:
    def __init__(self, state_dir: str, name: str = "grttest"):
        self.dir = os.path.abspath(state_dir)
        self.name = name
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.procs: dict[str, subprocess.Popen] = {}
        self.partition = "debug"
        # Unix socket paths may not exceed 108 bytes: munged's, and slurmstepd's in slurmd's spool
        # (<spool>/<node>/<node>_<job>.<step>). In pytest's deep tmp dirs they did now and then (the
        # length moved with the pytest run number, the worker and the pid in the node names): munged
        # did not start, or every batch launch failed ("Unix socket path ... is too long", the job held
        # as launch_failed_requeued_held). Both live in a short directory of their own.
        digest = hashlib.sha1(self.dir.encode()).hexdigest()[:10]
        self.sockets = os.path.join(tempfile.gettempdir(), f"grt-slurm-sockets-{digest}")
        self.munge_socket = os.path.join(self.sockets, "munge.socket")
        self.spool = os.path.join(self.sockets, "spool")

    # ----------------------------------------------------------------- environment
    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in list(env):
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")):
                del env[k]  # no allocation of an outer Slurm leaks in
        env["SLURM_CONF"] = self.conf
        return env

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.where("client", list(cmd)), env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    # ----------------------------------------------------------------- where things run
    def where(self, name: str, cmd: list[str]) -> list[str]:
        """The command line that runs `cmd` (daemon `name`, or a "client" command) on its node:
        here, all on this machine (netns_cluster.NetnsSlurm puts each on its own node)."""
        return cmd

    def node_addrs(self) -> dict[str, str]:
        """Node name -> address, one slurmd each; the first also runs slurmctld."""
        return {self.host: "127.0.0.1"}

    # ----------------------------------------------------------------- clean-up of old runs
    def _pidfiles(self) -> list[str]:
        return [
            os.path.join(self.dir, f"{n}.pid")
            for n in ["munged", "slurmctld"] + [f"slurmd-{node}" for node in self.node_addrs()]
        ]

    def kill_leftovers(self) -> None:
        """Stop daemons (and job steps) a previous run left behind in this state dir."""
        pids = []
        for pf in self._pidfiles():
            try:
                with open(pf) as f:
                    pids.append(int(f.read().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        # slurmstepd and daemons whose pid file was lost: match our own state dir only
        if os.path.isdir("/proc"):
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    cmd = _cmdline(int(entry))
                    if self.dir in cmd and any(n in cmd for n in DAEMON_NAMES):
                        pids.append(int(entry))
        pids = [
            p
            for p in dict.fromkeys(pids)
            if p != os.getpid() and _pid_alive(p) and any(n in _cmdline(p) for n in DAEMON_NAMES)
        ]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while time.time() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            if _pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ----------------------------------------------------------------- start / stop
    def _write_config(self) -> None:
        res = _node_resources()
        d = self.dir
        self.ctld_port, self.slurmd_port = _free_port(), _free_port()
        conf = f"""\
# generated by tests/slurm_cluster.py: a test cluster
ClusterName={self.name}
SlurmctldHost={self.host}({self.node_addrs()[self.host]})
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={self.spool}/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
PlugStackConfig={d}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
SchedulerParameters=sched_interval=1
JobRequeue=1
PartitionName={self.partition} Nodes={",".join(self.node_addrs())} Default=YES MaxTime=INFINITE State=UP \
OverSubscribe=NO
"""
        conf += "".join(
            f"NodeName={name} NodeAddr={addr} CPUs={res['cpus']} RealMemory={res['mem_mb']} State=UNKNOWN\n"
            for name, addr in self.node_addrs().items()
        )
        with open(self.conf, "w") as f:
            f.write(conf)
        open(os.path.join(d, "plugstack.conf"), "w").close()

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.dir, f"{name}.stdout"), "w")
        proc = subprocess.Popen(
            self.where(name, cmd), stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        self.procs[name] = proc
        with open(os.path.join(self.dir, f"{name}.pid"), "w") as f:
            f.write(f"{proc.pid}\n")

    def _wait(self, what: str, ok, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(
                        f"{name} exited with {proc.returncode} while waiting for {what}: {self._log_tail(name)}"
                    )
            if ok():
                return
            time.sleep(0.3)
        raise SlurmUnavailable(
            f"timed out waiting for {what}: {self._log_tail('slurmctld')} "
            + " ".join(self._log_tail(f"slurmd-{n}") for n in self.node_addrs())
        )

    def diagnosis(self, lines: int = 25) -> str:
        """What a timed-out wait prints: why nodes are down or drained, and the daemons' last
        log lines (a batch launch that failed on a node is said only in that node's slurmd log)."""
        parts = [self.run("sinfo", "-h", "-N", "-o", "%N %T %E", check=False, timeout=15).stdout.strip()]
        for name in ["slurmctld"] + [f"slurmd-{n}" for n in self.node_addrs()]:
            try:
                with open(os.path.join(self.dir, name + ".log"), errors="replace") as f:
                    tail = f.readlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {name}.log\n" + "".join(tail).rstrip())
        return "\n".join(parts)

    def _log_tail(self, name: str, n: int = 1500) -> str:
        text = ""
        for suffix in (".log", ".stdout"):
            try:
                with open(os.path.join(self.dir, name + suffix), errors="replace") as f:
                    text += f.read()[-n:]
            except OSError:
                pass
        return text.strip()

    def start(self, timeout: float = 60) -> SlurmCluster:
        missing = missing_tools()
        if missing:
            raise SlurmUnavailable(
                "Slurm/munge not installed (missing: " + ", ".join(missing) + "; Debian packages slurm-wlm and munge)"
            )
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test Slurm cluster runs its daemons as root")
        reap_stale()
        os.makedirs(self.dir, exist_ok=True)
        self.kill_leftovers()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(os.path.join(self.dir, "state"))
        shutil.rmtree(self.sockets, ignore_errors=True)
        for node in self.node_addrs():
            os.makedirs(os.path.join(self.spool, node))
        node = max(self.node_addrs(), key=len)
        longest = len(os.path.join(self.spool, node, f"{node}_4294967295.4294967295"))
        if longest > SOCKET_PATH_MAX:
            raise SlurmUnavailable(f"slurmstepd's socket paths under {self.spool} would exceed {SOCKET_PATH_MAX} bytes")
        os.chmod(self.sockets, 0o755)
        os.chmod(self.dir, 0o755)
        key = os.path.join(self.dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self._write_config()
        d = self.dir
        self._spawn(
            "munged",
            [
                _tool("munged"),
                "-F",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--log-file={d}/munged.log",
                f"--pid-file={d}/munged.run.pid",
                f"--seed-file={d}/munged.seed",
            ],
        )
        self._wait("munged", lambda: os.path.exists(self.munge_socket), 15)
        self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-c", "-i", "-f", self.conf])
        names = list(self.node_addrs())
        for node in names:
            self._spawn(f"slurmd-{node}", [_tool("slurmd"), "-D", "-f", self.conf, "-N", node])

        def idle() -> bool:
            r = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=10)
            return r.returncode == 0 and r.stdout.split() == ["idle"] * len(names)

        self._wait("the node to become idle", idle, timeout)
        return self

    def stop(self) -> None:
        if self.procs:
            # end jobs first so that slurmd cleans up their steps
            self.run("scancel", "--full", f"--partition={self.partition}", check=False, timeout=20)
        for name in [f"slurmd-{n}" for n in self.node_addrs()] + ["slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self.procs.clear()
        self.kill_leftovers()
        shutil.rmtree(self.sockets, ignore_errors=True)

    # ----------------------------------------------------------------- jobs
    def job_state(self, job_id: str) -> dict[str, str]:
        r = self.run("scontrol", "show", "job", "-o", job_id, check=False, timeout=15)
        fields: dict[str, str] = {}
        for token in r.stdout.split():
            if "=" in token:
                k, v = token.split("=", 1)
                fields.setdefault(k, v)
        return fields

    def wait_job(
        self,
        job_id: str,
        timeout: float = 300,
        states=(
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "BOOT_FAIL",
            "DEADLINE",
            "PREEMPTED",
        ),
    ) -> dict[str, str]:
        deadline = time.time() + timeout
        info: dict[str, str] = {}
        while time.time() < deadline:
            info = self.job_state(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout}s: {info}\n{self.diagnosis()}")

    def wait_for(self, predicate, timeout: float = 120, what: str = "condition") -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            time.sleep(0.3)
        raise TimeoutError(f"timed out waiting for {what}\n{self.diagnosis()}")

    def sbatch(self, script: str, *extra: str) -> str:
        r = self.run("sbatch", "--parsable", *extra, script)
        return r.stdout.strip().split(";")[0]


STATE_PREFIX = "grt-test-slurm-"


def default_state_dir() -> str:
    """<tmp>/grt-test-slurm-<uid>-<pid>: one cluster per test process, so that two test runs
    at once do not share daemons; `reap_stale()` stops what runs of dead processes left."""
    return os.path.join(tempfile.gettempdir(), f"{STATE_PREFIX}{os.getuid()}-{os.getpid()}")


def reap_stale() -> list[str]:
    """Stop the daemons of test clusters whose test process is gone, and remove their dirs."""
    reaped = []
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        m = re.fullmatch(re.escape(STATE_PREFIX) + r"(\d+)(?:-(\d+))?", name)
        if not m or int(m.group(1)) != os.getuid():
            continue
        owner = int(m.group(2)) if m.group(2) else None
        if owner is not None and (owner == os.getpid() or _pid_alive(owner)):
            continue
        path = os.path.join(base, name)
        stale = SlurmCluster(path)
        stale.kill_leftovers()
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(stale.sockets, ignore_errors=True)
        reaped.append(path)
    return reaped


def try_start(state_dir: str | None = None) -> SlurmCluster:
    cluster = SlurmCluster(state_dir or default_state_dir())
    try:
        return cluster.start()
    except Exception:
        cluster.stop()
        raise
