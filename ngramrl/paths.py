"""Output paths checked before any work starts: a bad path fails in seconds, and no output ever
overwrites an input.

    outputs = OutputPaths(inputs=traces)
    outputs.file(args.json, "--json")        # the checked absolute path
    outputs.directory(run.output_dir, "run.output_dir")
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from typing import BinaryIO

TAIL_CHUNK = 1 << 16  # bytes read at a time looking back for the last complete line


def cut_torn_tail(handle: BinaryIO) -> int:
    """A line-per-record file whose writer died in a write ends in a line without its newline; a
    record appended after would join it in one line that is no record. Cut the fragment off, back
    to the last complete line (``handle``: open for reading and writing, binary); returns the bytes
    cut, and leaves the handle at the end."""
    end = handle.seek(0, os.SEEK_END)
    if end == 0:
        return 0
    handle.seek(end - 1)
    if handle.read(1) == b"\n":
        return 0
    keep, position = 0, end
    while position > 0:
        start = max(0, position - TAIL_CHUNK)
        handle.seek(start)
        newline = handle.read(position - start).rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        position = start
    handle.truncate(keep)
    handle.seek(0, os.SEEK_END)
    return end - keep


class OutputPathError(ValueError):
    """An output path that cannot be written, or that would overwrite an input or another output."""


def _same(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _writable_directory(folder: str, what: str, shown: str) -> None:
    """``folder`` exists, is a directory, and a file can be created in it (tried, not guessed)."""
    if not os.path.exists(folder):
        raise OutputPathError(f"{what} {shown!r}: the directory {folder!r} does not exist")
    if not os.path.isdir(folder):
        raise OutputPathError(f"{what} {shown!r}: {folder!r} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise OutputPathError(f"{what} {shown!r}: cannot write in {folder!r} ({err.strerror or err})") from None


class OutputPaths:
    """The outputs of one command, checked against its inputs and against each other."""

    def __init__(self, inputs: Iterable[str] = ()) -> None:
        self.inputs = [os.path.expanduser(p) for p in inputs]
        self.outputs: list[tuple[str, str]] = []  # (path, what)

    def _not_taken(self, path: str, what: str, shown: str) -> None:
        for source in self.inputs:
            if _same(path, source):
                raise OutputPathError(f"{what} {shown!r} is also an input ({source}): it would be overwritten")
        for other, other_what in self.outputs:
            if _same(path, other):
                raise OutputPathError(f"{what} {shown!r} is also {other_what}: one would overwrite the other")

    def file(self, path: str | None, what: str, replace: bool = True) -> str | None:
        """A file this command will write (None: not asked for): its absolute path. ``replace``
        False: an existing file is refused (what it holds took long to make)."""
        if path is None:
            return None
        shown = path
        path = os.path.abspath(os.path.expanduser(path))
        if os.path.isdir(path):
            raise OutputPathError(f"{what} {shown!r} is a directory; give a file name")
        if not replace and os.path.exists(path):
            raise OutputPathError(f"{what} {shown!r} exists; name another file, or pass --overwrite to replace it")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise OutputPathError(f"{what} {shown!r} exists and is not writable")
        _writable_directory(os.path.dirname(path), what, shown)
        self._not_taken(path, what, shown)
        self.outputs.append((path, what))
        return path

    def directory(self, path: str, what: str) -> str:
        """A directory this command will write into (created later if missing): its absolute path."""
        shown = path
        path = os.path.abspath(os.path.expanduser(path))
        if os.path.exists(path) and not os.path.isdir(path):
            raise OutputPathError(f"{what} {shown!r} is a file, not a directory")
        existing = path
        while not os.path.exists(existing):  # the deepest part that exists must take a new directory
            existing = os.path.dirname(existing)
        _writable_directory(existing, what, shown)
        self._not_taken(path, what, shown)
        self.outputs.append((path, what))
        return path
