"""What a launch does: files to write, environment to set, one command to run."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from types import FrameType


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
        """Run the command in the foreground, forwarding SIGINT/SIGTERM/SIGUSR1 to it."""
        env = {k: v for k, v in os.environ.items() if k not in self.unset}
        env.update(self.env)
        proc = subprocess.Popen(self.command, env=env)

        def forward(signum: int, _frame: FrameType | None) -> None:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:  # pragma: no cover
                pass

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            try:
                old[sig] = signal.signal(sig, forward)
            except ValueError:  # not the main thread
                pass
        try:
            rc = proc.wait()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        sys.stdout.flush()
        return rc
