"""A run's checkpoints mirrored in object storage (train.checkpoint_mirror=s3://bucket/run): the
bucket's layout, and its reads and writes through the data side's client (fsspec's s3fs or gcsfs,
data_pipeline/remote.py `object_filesystem`), with credentials and endpoint from the environment only
(boto3's chain: AWS_ACCESS_KEY_ID, AWS_PROFILE, an instance role; AWS_ENDPOINT_URL_S3): a URL that
carries any is refused, so nothing secret reaches config.json.

Layout under the mirror URL, a run directory's:
    <url>/checkpoints/stepNNNNNNNN/...       the checkpoint's files (DeepSpeed's, rank<r>_state.pt, config.json)
    <url>/checkpoints/stepNNNNNNNN/COMPLETE  put last, once every file is there
A checkpoint without COMPLETE (an upload cut off, or given up) is never taken; removal deletes
COMPLETE first. The training side (uploads, pruning) is pretrain/training/checkpoint/mirror.py; the
readers: a resume whose local copy is gone or older (`fetch_for_resume`), and `--branch-from`,
`grt eval`, `grt export` of a mirror URL (`local_copy`: a cached download, then the usual loaders).

Settings (environment): GRT_MIRROR_RETRY_S (default 300): how long one request is retried;
GRT_MIRROR_TIMEOUT_S (default 60): one request's connect/read timeout; GRT_MIRROR_CACHE (default
~/.cache/grt/mirror): where `local_copy` keeps what it downloads.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from data_pipeline.remote import is_credentials_error, object_filesystem
from grt_common.errors import ConfigError, one_line
from grt_common.files import is_temp
from pretrain.runs.checkpoint_files import TAG_RE, find_latest, step_of

SCHEMES = ("s3://", "gs://")
COMPLETE = "COMPLETE"
SKIPPED = ("export",)  # train.export_every's copy inside a checkpoint: derived from it, not mirrored
T = TypeVar("T")


class MirrorError(RuntimeError):
    """A request of the mirror that failed for good (its retries spent, access denied): one line."""


def is_mirror_url(text: str | Path) -> bool:
    return isinstance(text, str) and text.startswith(SCHEMES)


def url_problem(url: str, what: str = "train.checkpoint_mirror") -> str | None:
    """The one line that refuses mirror URL `url` (`what` names the setting), or None: one that names no
    bucket, is not s3:// or gs://, or carries credentials or a query (credentials come from the
    environment only: nothing secret is written to a run file)."""
    if not is_mirror_url(url):
        return f"{what}={url!r}: must be an s3:// or gs:// URL (s3://bucket/prefix)"
    bucket = url.split("://", 1)[1].partition("/")[0]
    if not bucket or any(c in url for c in "@?#") or any(c.isspace() for c in url):
        shown = url.split("://", 1)[0] + "://..." if "@" in url else url  # never a secret echoed back
        return (
            f"{what}={shown!r}: must be s3://bucket/prefix, without credentials or a query: credentials come from the "
            "environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role; "
            "AWS_ENDPOINT_URL_S3 for another endpoint)"
        )
    return None


def check_url(url: str, what: str = "train.checkpoint_mirror") -> str:
    """`url` without a trailing slash; ConfigError (`url_problem`'s line) for one that is refused."""
    problem = url_problem(url, what)
    if problem is not None:
        raise ConfigError(problem)
    return url.rstrip("/")


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not value >= 0:
        raise ConfigError(f"{name}={raw!r} must be >= 0")
    return value


class Mirror:
    """One run's checkpoints under `url` (module doc); each request retried with backoff for
    GRT_MIRROR_RETRY_S seconds, MirrorError after that or at once for denied access."""

    def __init__(self, url: str) -> None:
        self.url = check_url(url)
        self.protocol, self.path = self.url.split("://", 1)
        self.retry_s = _env_seconds("GRT_MIRROR_RETRY_S", 300.0)
        self.timeout = _env_seconds("GRT_MIRROR_TIMEOUT_S", 60.0)
        self._fs: Any = None

    @property
    def fs(self) -> Any:
        if self._fs is None:
            try:
                self._fs = object_filesystem(self.protocol, self.timeout)
            except ImportError as err:
                raise MirrorError(f"the checkpoint mirror {self.url}: {err}") from None
        return self._fs

    def tag_url(self, tag: str) -> str:
        return f"{self.url}/checkpoints/{tag}"

    def _key(self, tag: str, name: str = "") -> str:
        return f"{self.path}/checkpoints/{tag}" + (f"/{name}" if name else "")

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        deadline, delay, attempts = time.monotonic() + self.retry_s, 0.2, 0
        while True:
            attempts += 1
            try:
                return fn(*args)
            except FileNotFoundError:
                raise
            except Exception as exc:  # the clients' connection, timeout and 5xx errors have no common base
                if isinstance(exc, PermissionError) or is_credentials_error(exc):
                    raise MirrorError(f"{what}: access denied ({one_line(exc)}); check the credentials") from None
                if time.monotonic() + delay > deadline:
                    raise MirrorError(
                        f"{what}: {one_line(exc)}; gave up after {attempts} attempts in {self.retry_s:g}s "
                        "(GRT_MIRROR_RETRY_S)"
                    ) from None
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(2 * delay, 5.0)

    # -- reading -----------------------------------------------------------------------------
    def _objects(self) -> dict[str, list[str]]:
        """{tag: the names under it} of every checkpoint folder in the bucket."""
        root = f"{self.path}/checkpoints/"

        def find() -> list[str]:
            self.fs.invalidate_cache()  # s3fs caches listings: a resume or a prune needs the bucket's now
            try:
                return list(self.fs.find(root))
            except FileNotFoundError:
                return []

        found: dict[str, list[str]] = {}
        for key in self._call(f"listing {self.url}/checkpoints", find):
            tag, _, name = key[len(root) :].partition("/") if key.startswith(root) else ("", "", "")
            if TAG_RE.match(tag) and name:
                found.setdefault(tag, []).append(name)
        return found

    def tags(self) -> tuple[list[str], list[str]]:
        """(the complete checkpoints, the folders without COMPLETE), each oldest first."""
        objects = self._objects()
        complete = sorted(t for t, names in objects.items() if COMPLETE in names)
        return complete, sorted(set(objects) - set(complete))

    def newest(self) -> str | None:
        complete, _ = self.tags()
        return complete[-1] if complete else None

    def fetch(self, tag: str, dest_root: Path) -> Path:
        """Download complete checkpoint `tag` into `dest_root/tag`: into a temporary folder beside
        it, COMPLETE written last, then renamed into place (a process that loses the race to
        another's copy uses that one). MirrorError where it is not complete in the bucket."""
        dest = dest_root / tag
        if (dest / COMPLETE).is_file():
            return dest
        names = self._objects().get(tag, [])
        if COMPLETE not in names:
            raise MirrorError(f"{self.tag_url(tag)} is not a complete checkpoint (no {COMPLETE} object)")
        dest_root.mkdir(parents=True, exist_ok=True)
        tmp = dest_root / f".{tag}.fetch-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for name in sorted(n for n in names if n != COMPLETE):
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                self._call(
                    f"downloading {self.tag_url(tag)}/{name}", self.fs.get_file, self._key(tag, name), str(tmp / name)
                )
            (tmp / COMPLETE).write_text(f"{step_of(tag)}\n")
            if dest.is_dir() and not (dest / COMPLETE).is_file():
                shutil.rmtree(dest, ignore_errors=True)  # an interrupted save or fetch: never loadable
            try:
                tmp.rename(dest)
            except OSError:
                if not (dest / COMPLETE).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    # -- writing (the training side: pretrain/training/checkpoint/mirror.py) -------------------
    def upload(self, folder: Path, tag: str) -> int:
        """Put checkpoint `tag`'s files (`mirrored_files` of `folder`), then COMPLETE; the bytes put. A
        tag put before (a run resumed from an older checkpoint rewrites it) loses its COMPLETE first."""
        self._call(f"removing {self.tag_url(tag)}/{COMPLETE}", self._rm_missing_ok, self._key(tag, COMPLETE))
        sent = 0
        for path in mirrored_files(folder):
            rel = str(path.relative_to(folder))
            self._call(f"uploading {self.tag_url(tag)}/{rel}", self.fs.put_file, str(path), self._key(tag, rel))
            sent += path.stat().st_size
        marker = b"%d\n" % step_of(tag)
        self._call(f"uploading {self.tag_url(tag)}/{COMPLETE}", self.fs.pipe_file, self._key(tag, COMPLETE), marker)
        return sent

    def _rm_missing_ok(self, key: str, recursive: bool = False) -> None:
        try:
            self.fs.rm(key, recursive=recursive)
        except FileNotFoundError:
            pass

    def remove(self, tag: str) -> None:
        """Checkpoint `tag` out of the bucket, COMPLETE first: a removal cut off leaves no complete one."""
        self._call(f"removing {self.tag_url(tag)}/{COMPLETE}", self._rm_missing_ok, self._key(tag, COMPLETE))
        self._call(f"removing {self.tag_url(tag)}", self._rm_missing_ok, self._key(tag), True)

    def prune(self, tag: str, keep: int) -> list[str]:
        """store._complete's rule in the bucket: among the complete checkpoints up to `tag`, all but the
        newest `keep`, and the incomplete folders older than `tag` (uploads cut off); those removed."""
        complete, partial = self.tags()
        old = [t for t in complete if t <= tag][:-keep] + [t for t in partial if t < tag]
        for t in old:
            self.remove(t)
        return old


def mirrored_files(step_dir: Path) -> list[Path]:
    """The files of a checkpoint that its mirror holds: all but COMPLETE (put last, by itself),
    temporary files and train.export_every's copy."""
    return [
        p
        for p in sorted(step_dir.rglob("*"))
        if p.is_file()
        and p.relative_to(step_dir).parts[0] not in SKIPPED
        and p.name != COMPLETE
        and not is_temp(p.name)
    ]


def mirror_of_run(out: Path, given: str | None) -> str | None:
    """The mirror URL of run directory `out`: `given` (the command line's), else its config.json's."""
    if given:
        return given
    from pretrain.runs.checkpoint_files import read_json

    saved = read_json(out / "config.json") or {}
    url = (saved.get("train") or {}).get("checkpoint_mirror") if isinstance(saved.get("train"), dict) else None
    return url if isinstance(url, str) and url else None


def fetch_for_resume(out: Path, url: str, say: Callable[[str], None]) -> str | None:
    """A --resume of `out` with a mirror: where the mirror's newest complete checkpoint is newer than
    the newest complete one in `out/checkpoints` (or that is gone), download it there; and restore
    `out/config.json` from it where that is gone too. The tag fetched, else None. ConfigError (one
    line) where the mirror cannot be read."""
    root = out / "checkpoints"
    mirror = Mirror(url)
    try:
        newest = mirror.newest()
        local = find_latest(root)
        if newest is None or (local is not None and step_of(local) >= step_of(newest)):
            return None
        began = time.monotonic()
        step_dir = mirror.fetch(newest, root)
    except MirrorError as err:
        raise ConfigError(f"--resume: the checkpoint mirror {mirror.url}: {err}") from None
    if not (out / "config.json").is_file() and (step_dir / "config.json").is_file():
        shutil.copyfile(step_dir / "config.json", out / "config.json")  # the run's settings as that save had them
    say(
        f"fetched checkpoint {newest} from the mirror {mirror.tag_url(newest)} into {step_dir} in "
        f"{time.monotonic() - began:.1f} s (the newest complete there; {local or 'none'} here)"
    )
    return newest


def local_copy(url: str, what: str = "") -> Path:
    """The local folder of the complete checkpoint a mirror URL names (`<url>/checkpoints/stepN`, or
    `<url>` or `<url>/checkpoints` for its newest), downloaded once into GRT_MIRROR_CACHE; ConfigError
    (one line, `what` first) where it names none or cannot be read."""
    base = url.rstrip("/")
    tag: str | None = None
    last = base.rsplit("/", 1)[-1]
    if TAG_RE.match(last):
        base, tag = base.rsplit("/", 1)[0], last
    base = base.removesuffix("/checkpoints")
    mirror = Mirror(check_url(base, f"{what}the mirror"))
    cache = Path(os.environ.get("GRT_MIRROR_CACHE") or Path.home() / ".cache" / "grt" / "mirror")
    try:
        tag = tag or mirror.newest()
        if tag is None:
            raise ConfigError(f"{what}{url}: the mirror holds no complete checkpoint")
        return mirror.fetch(tag, cache / mirror.protocol / mirror.path / "checkpoints")
    except MirrorError as err:
        raise ConfigError(f"{what}{url}: {err}") from None
