"""What a run's `data` string names: one manifest or a mixture of them (data_pipeline/mixture.py),
its manifest paths, and the run's data loaded from it."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grt_common.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from data_pipeline.manifest import Manifest
    from data_pipeline.mixture import DataMixture, SourceSpec


@dataclass(frozen=True)
class DataSpec:
    """A run's `data` string parsed: one manifest path (`sources` None) or a mixture's sources. The
    string is what a run saves (config.json); this is what every reader of it uses."""

    text: str
    sources: tuple[SourceSpec, ...] | None

    @property
    def paths(self) -> list[str]:
        """The manifest paths it names (one, or a mixture's sources'), for the launcher."""
        return [self.text] if self.sources is None else [s.path for s in self.sources]

    def with_paths(self, change: Callable[[str], str]) -> str:
        """The data string with each manifest path replaced by `change(path)` (e.g. made absolute)."""
        if self.sources is None:
            return change(self.text)
        return ",".join(f"{s.name}={_weight_text(s.weight)}:{change(s.path)}" for s in self.sources)

    def load(self) -> Manifest | DataMixture:
        """The run's data: the manifest, or the mixture it writes (data_pipeline/mixture.py); a
        missing, foreign or malformed manifest, or sources that do not go together, is a
        ConfigError naming it."""
        from data_pipeline.manifest import Manifest
        from data_pipeline.mixture import DataMixture, MixtureError

        if self.sources is not None:
            try:
                return DataMixture.load(self.text, list(self.sources))
            except MixtureError as err:
                raise ConfigError(str(err)) from None
        data = self.text
        if not Path(data).is_file():
            raise ConfigError(f"data={data!r}: no such manifest (write one with `grt data prepare`)")
        try:
            return Manifest.load(data)
        except (ValueError, KeyError) as err:
            raise ConfigError(f"data={data!r}: {err}") from None


@functools.lru_cache(maxsize=64)
def parse_data(data: str) -> DataSpec:
    """`data` parsed, once per string (a run config reads it as `data_spec`); a mixture string that
    does not parse is a ConfigError naming what is wrong."""
    from data_pipeline.mixture import MixtureError, parse_sources

    try:
        sources = parse_sources(data)
    except MixtureError as err:
        raise ConfigError(str(err)) from None
    return DataSpec(data, None if sources is None else tuple(sources))


def callers_data(texts: list[str]) -> list[str]:
    """Data strings the command line gives, each manifest path made absolute against the caller's
    working directory (`absolute`), so that the config.json a run saves names the same files from any
    directory (a --resume, `grt eval`, `grt analyze` read it again)."""
    return [parse_data(text).with_paths(absolute) for text in texts]


def absolute(path: str) -> str:
    """A path made absolute against the working directory, so that every process reads the same file
    whatever its own (a URL as it is)."""
    return path if os.path.isabs(path) or "://" in path else os.path.abspath(path)


def load_manifest(data: str) -> Manifest | DataMixture:
    """The data a `data` string names, loaded (DataSpec.load)."""
    return parse_data(data).load()


def data_stages(text: str, names: list[str]) -> None:
    """train.data_stages against a mixture's source names: a ConfigError naming what does not parse."""
    from data_pipeline.mixture import MixtureError, parse_stages

    try:
        parse_stages(text, names)
    except MixtureError as err:
        raise ConfigError(str(err)) from None


def _weight_text(weight: float) -> str:
    """A mixture weight as short as it reads back exactly (0.7, 1, 0.123456789)."""
    short = f"{weight:g}"
    return short if float(short) == weight else repr(weight)
