"""Which DeepSpeed file a run's `ds_config` names: the caller's own file where it exists, else a
shipped one (`ds_configs/zero3.json`, or `zero3.json`) found from any directory. Read alike by
`grt train`, a saved config read back and `grt launch`."""

from __future__ import annotations

from pathlib import Path

from pretrain import PROJECT_ROOT

SHIPPED_DIR = PROJECT_ROOT / "ds_configs"


def resolve_ds_path(path: str | Path) -> Path:
    """The DeepSpeed file `path` names: as given when it exists (or is absolute), else one of
    the shipped configs (`ds_configs/zero3.json` or `zero3.json`), whatever the working directory."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return shipped_ds_path(p) or p


def shipped_ds_path(path: Path) -> Path | None:
    """The shipped config a relative name finds from any directory (None: it names none)."""
    names = [] if path.is_absolute() else [base / path for base in (PROJECT_ROOT, SHIPPED_DIR)]
    return next((p for p in names if p.is_file()), None)


def shipped_ds_file(path: str | Path) -> bool:
    """Whether `path` names a shipped config by its shipped name (`ds_configs/zero3.json` from the
    checkout, `zero3.json` from ds_configs/): a name that finds it from any directory."""
    p = Path(path)
    if p.is_absolute() or not p.exists():
        return False
    return any((base / p).is_file() and (base / p).samefile(p) for base in (PROJECT_ROOT, SHIPPED_DIR))
