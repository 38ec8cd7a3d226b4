"""What a launch does: files to write, environment to set, one command to run."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import IO


@dataclass
class Plan:
    launcher: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set for the launching command only
    unset: list[str] = field(default_factory=list)  # removed from its environment
    files: dict[str, str] = field(default_factory=dict)  # path -> content, written first
    executable_files: list[str] = field(default_factory=list)
    summary: str = ""
    run_dir: str | None = None
    record: dict[str, object] = field(default_factory=dict)

    def shell_command(self) -> str:
        words = []
        if self.unset:
            words = ["env"] + [w for k in self.unset for w in ("-u", k)]
        words += [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join(words + [shlex.join(self.command)])

    def render(self) -> str:
        """The dry-run text: every file, then the command line (last line, shell-quoted)."""
        out = []
        if self.summary:
            out.append(f"# {self.summary}")
        for path, content in self.files.items():
            out.append(f"#### file: {path}")
            out.append(content.rstrip("\n"))
            out.append("#### end of file")
        out.append("#### command")
        out.append(self.shell_command())
        return "\n".join(out) + "\n"

    def write_files(self) -> None:
        for path, content in self.files.items():
            d = os.path.dirname(path)
            if d:
                os.makedirs(d, exist_ok=True)
            with open(path, "w") as f:
                f.write(content)
            if path in self.executable_files:
                os.chmod(path, 0o755)
        if self.run_dir:
            os.makedirs(self.run_dir, exist_ok=True)
            record = dict(self.record)
            from launcher.envvars import SECRET

            env = {k: ("<redacted>" if SECRET.search(k) else v) for k, v in self.env.items()}
            record.update(launcher=self.launcher, command=self.command, env=env, files=sorted(self.files))
            with open(os.path.join(self.run_dir, "launch.json"), "w") as f:
                json.dump(record, f, indent=2, sort_keys=True)
                f.write("\n")

    def execute(self) -> int:
        """Run the command in the foreground, in a session of its own, and end with the ranks'
        verdict (`verdict`). SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 go to the ranks: torchrun's workers
        (torchrun itself, signalled, would end in its own traceback and exit 1 while its ranks save
        and stop cleanly), else the command. A terminal's Ctrl-C reaches the launch only, which
        passes it on. torchrun's own report of a failed rank (its log lines and traceback) is left
        out of stderr: each rank says its one line, and the launch its verdict."""
        from pretrain.distributed.error_boundary import VERDICTS_ENV

        env = {k: v for k, v in os.environ.items() if k not in self.unset}
        env.update(self.env)
        verdicts = tempfile.mkdtemp(prefix="grt-launch-")
        env[VERDICTS_ENV] = verdicts
        torchrun = "torch.distributed.run" in self.command
        proc = subprocess.Popen(
            self.command, env=env, start_new_session=True, stderr=subprocess.PIPE if torchrun else None
        )
        copier = threading.Thread(target=_without_torchrun_report, args=(proc.stderr,), daemon=True)
        if torchrun:
            copier.start()

        def forward(signum: int, _frame: FrameType | None) -> None:
            for pid in _children(proc.pid) if torchrun else [proc.pid]:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:  # pragma: no cover - ended meanwhile
                    pass

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            try:
                old[sig] = signal.signal(sig, forward)
            except ValueError:  # not the main thread
                pass
        try:
            rc = proc.wait()
            if torchrun:
                copier.join()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            codes = _read_verdicts(verdicts)
            shutil.rmtree(verdicts, ignore_errors=True)
        sys.stdout.flush()
        return verdict(rc, codes)


def _children(pid: int) -> list[int]:
    """The processes `pid` started (its threads' children, from /proc)."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(c) for c in fh.read().split()]
    except OSError:
        pass
    return found


def _read_verdicts(folder: str) -> dict[int, int]:
    codes = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name)) as fh:
                codes[int(name.removeprefix("rank"))] = int(fh.read().strip())
        except (OSError, ValueError):
            continue
    return codes


# the ranks' codes, most telling first: a bug (1), a stop with the last checkpoint intact (3), a refusal (2)
_VERDICT_ORDER = (1, 3, 2)


def verdict(rc: int, codes: dict[int, int]) -> int:
    """The launch's exit code: its command's when it succeeded or no rank said anything (it never
    started one); else the ranks' (docs/reliability.md, exit codes): 0 when every rank that said one
    said 0 (a pre-emption saved), else the most telling of theirs, said in one line."""
    failed = {r: c for r, c in sorted(codes.items()) if c != 0}
    if rc == 0 or not codes:
        return rc
    if not failed:
        return 0
    code = next((c for c in _VERDICT_ORDER if c in failed.values()), max(failed.values()))
    ranks = ", ".join(f"rank {r} exit {c}" for r, c in failed.items())
    print(f"grt launch: the ranks ended: {ranks}; exit {code}", file=sys.stderr, flush=True)
    return code


_TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} .*torch/distributed/")


def _without_torchrun_report(stream: IO[bytes]) -> None:
    """Copy torchrun's stderr (and its ranks') to ours, less torchrun's own lines: its log lines, and
    its traceback (a traceback whose first frame past runpy's is in torch/distributed/run.py) to the end."""
    out = sys.stderr.buffer
    held: list[bytes] = []  # a traceback's first lines, until its first frame says whose it is
    for line in iter(stream.readline, b""):
        text = line.decode("utf-8", "replace")
        if held:
            held.append(line)
            if text.lstrip().startswith("File ") and "<frozen runpy>" not in text:
                if "torch/distributed/run.py" in text:
                    stream.read()  # torchrun's report, to its end
                    return
                out.writelines(held)
                out.flush()
                held = []
            continue
        if text.startswith("Traceback (most recent call last):"):
            held = [line]
        elif not _TORCHRUN_LOG.match(text):
            out.write(line)
            out.flush()
    out.writelines(held)
    out.flush()
