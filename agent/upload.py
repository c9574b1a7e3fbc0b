"""`zerowatch upload SPOOL_DIR`: send a spool written by agents that had no server.

The spool folder is either one run's (`<root>/<run_id>/`, holding `run.json`) or a root
holding several runs. For each run the RunCreate is posted first (idempotent), then every
rank's segments oldest first, in batches, so each rank's events arrive in seq order. The
server keeps one copy per (run, rank, seq): an upload repeated, or one of a spool the agent
had partly sent, stores every step exactly once. The spool is left in place.

Standard library plus the ingest client; no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from zerowatch.agent import codec
from zerowatch.agent.client import IngestClient, IngestError, PayloadTooLarge
from zerowatch.agent.spool import RUN_FILE, read_events, segments


@dataclass
class UploadResult:
    """What an upload did."""

    server: str
    runs: list[str] = field(default_factory=list)
    events: int = 0
    accepted: int = 0
    duplicates: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every run found was created and every event was taken by the server."""
        return bool(self.runs) and not self.errors

    def summary(self) -> str:
        """One line per outcome, for the CLI."""
        head = (
            f"uploaded {len(self.runs)} run(s) to {self.server}: {self.events} events, "
            f"{self.accepted} stored, {self.duplicates} already there"
        )
        return "\n".join([head, *(f"error: {e}" for e in self.errors)])


def _run_dirs(spool_dir: Path) -> list[Path]:
    if (spool_dir / RUN_FILE).is_file():
        return [spool_dir]
    if not spool_dir.is_dir():
        return []
    return sorted(p for p in spool_dir.iterdir() if (p / RUN_FILE).is_file())


def _send(client: IngestClient, run_id: str, lines: list[bytes], result: UploadResult) -> None:
    try:
        res = client.post_events(run_id, codec.batch_body(run_id, lines))
    except PayloadTooLarge:
        if len(lines) == 1:
            raise
        half = len(lines) // 2
        _send(client, run_id, lines[:half], result)
        _send(client, run_id, lines[half:], result)
        return
    result.events += len(lines)
    result.accepted += res.accepted
    result.duplicates += res.duplicates


def upload_spool(
    spool_dir: str | Path,
    server: str,
    token: str | None = None,
    *,
    batch_max_events: int = 256,
    timeout_s: float = 30.0,
) -> UploadResult:
    """Send every run under `spool_dir` to `server`.

    Args:
        spool_dir: one run's spool folder, or a folder of them.
        server: the server URL.
        token: the ingest token, when the server requires one.
        batch_max_events: events per POST.
        timeout_s: timeout of one POST (each is retried with backoff).

    Returns:
        The counts, and an error per run that could not be sent completely (`ok` False).
    """
    root = Path(spool_dir)
    result = UploadResult(server=server)
    runs = _run_dirs(root)
    if not runs:
        result.errors.append(
            f"no {RUN_FILE} found in {root} or its subfolders: not a zerowatch spool"
        )
        return result
    # A busy server's Retry-After (up to a minute) is waited out, not given up on.
    client = IngestClient(
        server, token, timeout_s=timeout_s, attempts=5, max_wait_s=5.0, max_retry_after_s=60.0
    )
    try:
        for run_dir in runs:
            try:
                raw = (run_dir / RUN_FILE).read_bytes()
                run_id = str(json.loads(raw)["run_id"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                result.errors.append(f"{run_dir / RUN_FILE}: unreadable RunCreate ({e})")
                continue
            try:
                client.create_run(raw)
                for rank_dir in sorted(p for p in run_dir.iterdir() if p.is_dir()):
                    batch: list[bytes] = []
                    for segment in segments(rank_dir):
                        for line, obj in read_events(segment):
                            if obj.get("kind") not in ("step", "end"):
                                continue
                            batch.append(line)
                            if len(batch) >= batch_max_events:
                                _send(client, run_id, batch, result)
                                batch = []
                    if batch:
                        _send(client, run_id, batch, result)
            except IngestError as e:
                result.errors.append(f"run {run_id}: {type(e).__name__}: {e}")
                continue
            result.runs.append(run_id)
    finally:
        client.close()
    return result


__all__ = ["UploadResult", "upload_spool"]
