"""Real `grt train` jobs for the tests: tiny data, ranks started as a launcher would (`Job`), and
what a run leaves (losses, step records, checkpoint tags).

Every training run here is a real process (or two) running `python -m pretrain.cli train`
with the env:// rendezvous a launcher would set up, so signals, kills and exit codes are
the real ones. Each rank is the leader of its own session, so a test can kill one rank
(or its whole tree) by process id without touching anything it did not start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from commands import data_commands, manifest_of, train_command
from multiproc import start_ranks

from data_pipeline.loader import DIGEST_MOD

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "examples" / "data" / "tinyshakespeare.txt"

# The tiny job every test trains: micro-grt, 64-token samples, 4 sequences per micro-batch.
BASE_SETS = [
    "train.log_every=100",
    "train.eval_every=0",
    "train.warmup_steps=2",
    "train.lr=3e-3",
    "train.shuffle_buffer=64",
]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pretrain.cli", *args]


def build_data(root: Path) -> Path:
    """Tokenizer + shards of the demo text under `root`; returns the manifest path."""
    root.mkdir(parents=True, exist_ok=True)
    for args in data_commands(TEXT, root):
        subprocess.run(cli(*args), cwd=REPO, check=True, capture_output=True)
    return manifest_of(root)


def train_args(
    data: Path,
    out: Path,
    steps: int,
    *sets: str,
    resume: bool = False,
    ds_config: str = "ds_configs/zero3.json",
    micro_batch_size: int = 4,
) -> list[str]:
    args = train_command("micro-grt", data, out, steps, micro_batch_size, ds_config, (*BASE_SETS, *sets))
    if resume:
        args.append("--resume")
    return args


class Job:
    """`world` ranks of `grt <args>` started the way torchrun would start them.

    Output of rank r goes to `<logs>/rank<r>.<n>.log` (n counts the jobs sharing `logs`).
    `env` applies to every rank, `rank_env[r]` to rank r only.
    """

    def __init__(
        self,
        args: list[str],
        logs: Path,
        world: int = 2,
        env: dict | None = None,
        rank_env: dict[int, dict] | None = None,
    ):
        logs.mkdir(parents=True, exist_ok=True)
        n = len(list(logs.glob("rank0.*.log")))
        self.world = world
        self.logs = [logs / f"rank{r}.{n}.log" for r in range(world)]
        self.started = time.time()
        self.procs: list[subprocess.Popen] = start_ranks(
            ["-m", "pretrain.cli", *args], world, env=env, rank_env=rank_env, logs=self.logs
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def wait(self, timeout: float) -> list[int]:
        """Exit codes (rank order); on timeout every rank is killed and AssertionError raised."""
        deadline = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"job did not finish within {timeout:.0f} s:\n{self.output()}") from None
        return [p.returncode for p in self.procs]

    def signal(self, sig: int, ranks=None) -> None:
        for r in range(self.world) if ranks is None else ranks:
            if self.procs[r].poll() is None:
                os.kill(self.procs[r].pid, sig)

    def kill(self, ranks=None) -> None:
        """SIGKILL the given ranks (default all) and every process they started."""
        for r in range(self.world) if ranks is None else ranks:
            p = self.procs[r]
            for pid in [*descendants(p.pid), p.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for r in range(self.world) if ranks is None else ranks:
            self.procs[r].wait()

    def output(self, rank: int | None = None, tail: int = 4000) -> str:
        ranks = range(self.world) if rank is None else [rank]
        return "\n".join(f"--- rank {r} ---\n{self.logs[r].read_text(errors='replace')[-tail:]}" for r in ranks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if any(self.alive()):
            self.kill()


def run_job(args: list[str], logs: Path, timeout: float = 240, **kw) -> tuple[list[int], Job]:
    job = Job(args, logs, **kw)
    with job:
        return job.wait(timeout), job


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc; children first listed last)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def losses(out: Path, rank: int = 0) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a resumed run appends, so the last record of a step wins."""
    path = out / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl")
    result = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                result[rec["step"]] = rec["loss"]
    return result


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def wait_for(predicate, timeout: float, job: Job | None = None, what: str = "condition", poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if job is not None and not all(job.alive()):
            raise AssertionError(f"a rank exited while waiting for {what}:\n{job.output()}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f":\n{job.output()}" if job else ""))


def last_step(out: Path) -> int:
    recs = records(out)
    return recs[-1]["step"] if recs else 0


def ckpt_tags(out: Path) -> dict[str, bool]:
    """tag -> has a COMPLETE marker."""
    root = out / "checkpoints"
    if not root.is_dir():
        return {}
    return {
        p.name: (p / "COMPLETE").is_file() for p in sorted(root.iterdir()) if p.is_dir() and p.name.startswith("step")
    }


def latest(out: Path) -> str | None:
    marker = out / "checkpoints" / "latest"
    return marker.read_text().strip() if marker.is_file() else None


def fp32_state(ckpt_dir: Path, tag: str) -> dict:
    """The consolidated fp32 weights of a ZeRO checkpoint (DeepSpeed's zero_to_fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)


def stray_files(root: Path) -> list[str]:
    """Temporary files left behind by interrupted writes (names with .tmp)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp" in p.name)


def per_step(out: Path) -> dict[int, tuple[float, int]]:
    """step -> (loss, the step's data digest summed over the ranks that ran it), from every
    rank's metrics file; within a file the last record of a step wins (a resumed run appends)."""
    steps: dict[int, tuple[float, int]] = {}
    for path in sorted(out.glob("metrics*.jsonl")):  # rank 0's first: metrics.jsonl holds the loss
        mine = {}
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            mine[rec["step"]] = rec
        for step, rec in mine.items():
            loss, digest = steps.get(step, (rec["loss"], 0))
            steps[step] = (loss, (digest + rec["data_digest"]) % DIGEST_MOD)
    return steps
