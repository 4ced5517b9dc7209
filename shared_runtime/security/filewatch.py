"""Notice when files are replaced: the certificate and key files that cert-manager or an operator rotates.

`FileWatch.changed()` compares each file's (inode, size, mtime) with what it saw last; it follows
symlinks, so Kubernetes' atomic Secret updates (a `..data` symlink swap) count as a change. A stat of
a few files costs microseconds, so callers may ask on every new connection.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

_Stamp = tuple[int, int, int] | None


def _stamp(path: str) -> _Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class FileWatch:
    """Tracks a fixed list of files; `changed()` is True once per replacement of any of them."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = tuple(paths)
        self._seen = self._stamps()

    def _stamps(self) -> tuple[_Stamp, ...]:
        return tuple(_stamp(p) for p in self.paths)

    def changed(self) -> bool:
        stamps = self._stamps()
        if stamps == self._seen:
            return False
        self._seen = stamps
        return True

    def mark_seen(self) -> None:
        """Take the files as they are now as seen (after reading them for another reason)."""
        self._seen = self._stamps()
