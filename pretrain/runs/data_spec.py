"""What a run's `data` string names: one manifest or a mixture of them (data_pipeline/mixture.py),
its manifest paths, and the run's data loaded from it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.config import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from data_pipeline.manifest import Manifest
    from data_pipeline.mixture import DataMixture, SourceSpec


def load_manifest(data: str) -> Manifest | DataMixture:
    """The run's data: the manifest at `data`, or the mixture it writes (data_pipeline/mixture.py);
    a missing, foreign or malformed manifest, or sources that do not go together, is a
    ConfigError naming it."""
    from data_pipeline.manifest import Manifest
    from data_pipeline.mixture import DataMixture, MixtureError, parse_sources

    try:
        sources = parse_sources(data)
        if sources is not None:
            return DataMixture.load(data, sources)
    except MixtureError as err:
        raise ConfigError(str(err)) from None
    if not Path(data).is_file():
        raise ConfigError(f"data={data!r}: no such manifest (write one with `grt data prepare`)")
    try:
        return Manifest.load(data)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"data={data!r}: {err}") from None


def data_sources(data: str) -> list[SourceSpec] | None:
    """A mixture's sources (None: `data` is one manifest path); a mixture string that does not
    parse is a ConfigError naming what is wrong."""
    from data_pipeline.mixture import MixtureError, parse_sources

    try:
        return parse_sources(data)
    except MixtureError as err:
        raise ConfigError(str(err)) from None


def data_stages(text: str, names: list[str]) -> None:
    """train.data_stages against a mixture's source names: a ConfigError naming what does not parse."""
    from data_pipeline.mixture import MixtureError, parse_stages

    try:
        parse_stages(text, names)
    except MixtureError as err:
        raise ConfigError(str(err)) from None


def data_paths(data: str) -> list[str]:
    """The manifest paths a run's `data` names (one, or a mixture's sources'), for the launcher."""
    sources = data_sources(data)
    return [data] if sources is None else [s.path for s in sources]


def absolute(path: str) -> str:
    """A path made absolute against the working directory, so that every process reads the same file
    whatever its own (a URL as it is)."""
    return path if os.path.isabs(path) or "://" in path else os.path.abspath(path)


def with_data_paths(data: str, change: Callable[[str], str]) -> str:
    """`data` with each manifest path it names replaced by `change(path)` (e.g. made absolute)."""
    sources = data_sources(data)
    if sources is None:
        return change(data)
    return ",".join(f"{s.name}={_weight_text(s.weight)}:{change(s.path)}" for s in sources)


def _weight_text(weight: float) -> str:
    """A mixture weight as short as it reads back exactly (0.7, 1, 0.123456789)."""
    short = f"{weight:g}"
    return short if float(short) == weight else repr(weight)
