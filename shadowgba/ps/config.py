"""`PSConfig`, the `sync.ps` section, under the path the documentation names (docs/gba.md): it is
defined in `shadowgba.job.config`, which every job reads, with or without servers."""

from shadowgba.job.config import PSConfig

__all__ = ["PSConfig"]
