"""The durable on-disk spool: where events wait while the server cannot be reached.

Layout of one run's spool (written by every rank of the job, each in its own folder):

    <spool_root>/<run_id>/run.json                   the RunCreate (JSON)
    <spool_root>/<run_id>/rank-00003/00000000.jsonl  append-only segments, one event a line
    <spool_root>/<run_id>/rank-00003/00000001.jsonl

A rank appends to its newest segment and starts a new one past `segment_bytes`; the shipper
replays segments oldest first and deletes a segment once the server holds all of it, so what
is on disk is exactly what the server may still lack. `zerowatch upload` reads the same files.

The spool is bounded (`max_bytes` per rank). Past the bound, or when the disk refuses a write
(full, read-only), new events are dropped and counted (warned once), never raised: training
goes on. Lines reach the OS after every append and the disk (fsync) at least every
`fsync_interval_s`, at every segment end and at close; a line torn by a crash is skipped on
replay.

Standard library only; one thread writes and reads (the shipper), a lock guards the rare
hand-over at close.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zerowatch.agent.errors import AgentHealth

RUN_FILE = "run.json"
#: Part of the bound kept free for the rank's EndEvent.
RESERVE_BYTES = 4096
SEGMENT_SUFFIX = ".jsonl"


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def segments(rank_dir: Path) -> list[Path]:
    """The segment files of one rank's folder, oldest first."""
    if not rank_dir.is_dir():
        return []
    return sorted(p for p in rank_dir.iterdir() if p.suffix == SEGMENT_SUFFIX and p.is_file())


def read_events(path: Path) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """(raw line, parsed event) of one segment; torn or garbled lines are skipped."""
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield line, obj


class Spool:
    """One rank's spool: append lines, read them back in order, forget what was sent."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        *,
        max_bytes: int,
        segment_bytes: int,
        fsync_interval_s: float,
        health: AgentHealth,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / rank_dir_name(rank)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.fsync_interval_s = fsync_interval_s
        self._health = health
        self.lock = threading.Lock()
        # Segments left by an earlier process of this run are pending too.
        self._segments: list[Path] = segments(self.dir)
        self.bytes_on_disk = sum(p.stat().st_size for p in self._segments)
        self._next_index = int(self._segments[-1].stem) + 1 if self._segments else 0
        self._run_create: bytes | None = None
        self._writer: Any = None
        self._writer_path: Path | None = None
        self._writer_size = 0
        self._last_fsync = time.monotonic()
        # Read position: an index into _segments and a byte offset into that file.
        self._read_offset = 0
        self.written = 0

    # -- writing ---------------------------------------------------------------------

    def set_run(self, run_create_json: bytes) -> None:
        """The RunCreate to store next to the segments once this rank spools anything."""
        self._run_create = run_create_json

    def write_run(self, run_create_json: bytes) -> None:
        """Store the RunCreate next to the segments (atomically; same on every rank)."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            target = self.run_dir / RUN_FILE
            tmp = self.run_dir / f".{RUN_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_bytes(run_create_json)
            os.replace(tmp, target)
        except OSError as e:
            self._health.error(f"writing the spool's {RUN_FILE} in {self.run_dir}", e)

    def _open_segment(self) -> Any:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._run_create is not None:
            self.write_run(self._run_create)
        path = self.dir / f"{self._next_index:08d}{SEGMENT_SUFFIX}"
        self._next_index += 1
        f = open(path, "ab", buffering=0)  # noqa: SIM115 (kept open across appends)
        self._segments.append(path)
        self._writer, self._writer_path, self._writer_size = f, path, 0
        return f

    def _close_writer(self) -> None:
        f, self._writer, self._writer_path = self._writer, None, None
        if f is None:
            return
        try:
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            pass
        with contextlib.suppress(OSError):
            f.close()

    def append(self, lines: list[bytes], *, final: bool = False) -> int:
        """Append encoded events (one per line); returns how many were stored.

        Those that do not fit under `max_bytes`, or that the disk refuses, are dropped and
        counted in the shared health counters. The last `RESERVE_BYTES` of the bound are
        kept for the `final` append (the rank's EndEvent, which reports the drops).
        """
        stored = 0
        limit = self.max_bytes if final else max(self.max_bytes - RESERVE_BYTES, 0)
        with self.lock:
            for i, line in enumerate(lines):
                size = len(line) + 1
                if self.max_bytes and self.bytes_on_disk + size > limit:
                    self._health.drop(
                        len(lines) - i,
                        f"the spool is full (max_spool_bytes={self.max_bytes}) in {self.dir}",
                    )
                    break
                try:
                    f = self._writer
                    if f is None or self._writer_size >= self.segment_bytes:
                        self._close_writer()
                        f = self._open_segment()
                    data = line + b"\n"
                    written = f.write(data)  # unbuffered: the disk's answer, per event
                    if written != len(data):
                        raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes)")
                except OSError as e:
                    # A torn line may remain (skipped on replay): a fresh segment next time.
                    self._close_writer()
                    self._health.drop(len(lines) - i, f"cannot write the spool in {self.dir}: {e}")
                    break
                self._writer_size += size
                self.bytes_on_disk += size
                stored += 1
            self.written += stored
            self._sync()
        return stored

    def _sync(self) -> None:
        f = self._writer
        if f is None:
            return
        try:
            f.flush()
            now = time.monotonic()
            if now - self._last_fsync >= self.fsync_interval_s:
                os.fsync(f.fileno())
                self._last_fsync = now
        except OSError as e:
            self._close_writer()
            self._health.error(f"flushing the spool in {self.dir}", e)

    # -- reading back ----------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether anything on disk has not been sent yet."""
        if not self._segments:
            return False
        if len(self._segments) > 1:
            return True
        try:
            return self._segments[0].stat().st_size > self._read_offset
        except OSError:
            return False

    def read_batch(self, max_events: int) -> tuple[list[bytes], int]:
        """Up to `max_events` oldest unsent lines (from one segment) and the offset after them.

        Pass the offset to `commit` once the server holds them.
        """
        with self.lock:
            if self._writer is not None:
                self._writer.flush()
            while self._segments:
                path = self._segments[0]
                lines: list[bytes] = []
                try:
                    with open(path, "rb") as f:
                        f.seek(self._read_offset)
                        offset = self._read_offset
                        while len(lines) < max_events:
                            line = f.readline()
                            if not line:
                                break
                            offset += len(line)
                            if not line.endswith(b"\n"):
                                continue  # torn by a failed write (full disk, crash)
                            line = line.strip()
                            if line:
                                lines.append(line)
                except OSError as e:
                    self._health.error(f"reading the spool segment {path}", e)
                    self._forget_head()
                    continue
                if lines:
                    return lines, offset
                if path == self._writer_path:
                    return [], self._read_offset  # caught up with the writer
                self._forget_head()  # an old segment fully sent (or empty): delete it
            return [], 0

    def commit(self, offset: int) -> None:
        """The server holds everything up to `offset` of the oldest segment."""
        with self.lock:
            self._read_offset = offset
            if not self._segments:
                return
            head = self._segments[0]
            try:
                done = head.stat().st_size <= offset
            except OSError:
                done = True
            if done:
                if head == self._writer_path:
                    self._close_writer()
                self._forget_head()

    def _forget_head(self) -> None:
        path = self._segments.pop(0)
        self._read_offset = 0
        try:
            size = path.stat().st_size
            path.unlink()
            self.bytes_on_disk = max(self.bytes_on_disk - size, 0)
        except OSError:
            pass

    def close(self) -> None:
        with self.lock:
            self._close_writer()
            # Remove an empty rank folder (everything was sent); the run's folder too when
            # no rank left anything (run.json alone stays for ranks that still have events).
            try:
                if self._segments:
                    if self._run_create is not None:  # another rank may have tidied it away
                        self.write_run(self._run_create)
                    return
                if self.dir.is_dir() and not any(self.dir.iterdir()):
                    self.dir.rmdir()
                if self.run_dir.is_dir() and not any(
                    p.name.startswith("rank-") for p in self.run_dir.iterdir()
                ):
                    (self.run_dir / RUN_FILE).unlink(missing_ok=True)
                    self.run_dir.rmdir()
            except OSError:
                pass


__all__ = ["RUN_FILE", "Spool", "rank_dir_name", "read_events", "segments"]
