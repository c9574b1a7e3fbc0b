"""Collective forensics: hang and desync findings from the ranks' newest heartbeats.

Every rank's shipper thread sends a heartbeat every few seconds (agent/heartbeat.py), also
while its training thread is blocked: its last finished step, its phase, per process group
the number of the last collective it launched and of the last that completed with the
newest calls (seq, op, elements, dtype, state, times), and, once it has not finished a step
for its stall threshold, the training thread's innermost frames. The server keeps each
rank's newest (server/heartbeats.py). From those rows alone:

* **hang**: some rank is stalled, and on some group ranks wait in a collective (launched,
  not completed: the oldest such seq) that other ranks never launched (their last launch
  on the group is below it). The finding names the collective (group, seq, op, size,
  since when), the ranks waiting in it, and its `ranks` are the ranks that are not in it:
  those that never launched it, grouped by identical stacks ("4,088 ranks wait ...; 8
  ranks on 1 node: stack B"), and the silent ones (no heartbeat for `silent_after_s`, or
  none at all).
* **desync**: ranks that report the same seq of a group with a different op, element
  count or dtype: their collectives no longer pair up (an extra or a missing call on
  some rank), which ends in a hang, a crash or wrong sums.

The checks are pure functions of the rows and the time; the cost follows the ranks that
sent heartbeats (one pass over each), not the steps.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from zerowatch.server.read.doctor_checks import Finding

#: Innermost frames that name a stack in a message (the evidence carries all it got).
_FRAMES_SHOWN = 3
#: Ranks listed by number in a message before "and N more".
_RANKS_SHOWN = 8


@dataclass(frozen=True, kw_only=True)
class ForensicsSettings:
    """Thresholds of the hang and desync findings."""

    silent_after_s: float = 45.0
    """A rank whose newest heartbeat is older than this (or that never sent one, while
    others did) is silent: its process is gone, or its shipper thread too is stuck."""

    def __post_init__(self) -> None:
        if not self.silent_after_s > 0:
            raise ValueError(f"silent_after_s: expected seconds > 0, got {self.silent_after_s!r}")


def ranks_text(ranks: list[int]) -> str:
    """A list of ranks for a message: "rank 3", "ranks 1, 2, 5", "ranks 0, 1, ... and
    4,080 more"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:_RANKS_SHOWN]))
    more = len(ranks) - _RANKS_SHOWN
    return f"ranks {shown}" + (f" and {more:,} more" if more > 0 else "")


def _where(beats: list[dict[str, Any]]) -> str:
    nodes = {(b.get("host") or "", int(b.get("node", -1))) for b in beats}
    nodes.discard(("", -1))
    if not nodes:
        return ""
    return f" on {len(nodes)} node{'s' if len(nodes) > 1 else ''}"


def _frames_text(stack: list[dict[str, Any]] | None) -> str:
    if not stack:
        return "no stack (the rank has not stalled by its own threshold)"
    return " < ".join(f"{f['function']} ({f['file']}:{f['line']})" for f in stack[:_FRAMES_SHOWN])


def _signature(stack: list[dict[str, Any]] | None) -> tuple[tuple[str, str, int], ...]:
    return tuple((f["file"], f["function"], int(f["line"])) for f in stack or ())


def _stalled(b: dict[str, Any]) -> bool:
    threshold = float(b.get("stall_after_s") or 0.0)
    return b.get("stack") is not None or (
        threshold > 0 and float(b.get("stalled_s", 0)) >= threshold
    )


def _call(b: dict[str, Any], group: str, seq: int) -> list[Any] | None:
    for c in (b.get("groups", {}).get(group) or {}).get("calls", []):
        if int(c[0]) == seq:
            return list(c)
    return None


def _torch_pending(b: dict[str, Any]) -> dict[str, Any] | None:
    """The oldest entry of a rank's torch flight recorder still in flight (not retired)."""
    return next((e for e in b.get("torch_flight") or () if not e.get("retired", True)), None)


def _fmt_call(op: str, numel: int, dtype: str) -> str:
    return f"{op} of {numel:,} {dtype} elements" if dtype else f"{op} of {numel:,} elements"


def hang(
    rows: list[tuple[float, dict[str, Any]]], *, world_size: int, now: float,
    settings: ForensicsSettings | None = None,
) -> list[Finding]:  # fmt: skip
    """The hang finding (module docstring) from each rank's newest (received at, heartbeat)."""
    s = settings or ForensicsSettings()
    if not rows:
        return []
    beats = {int(b["rank"]): b for _, b in rows}
    received = {int(b["rank"]): t for t, b in rows}
    silent = sorted(set(range(world_size)) - set(beats))
    silent += sorted(r for r, t in received.items() if now - t > s.silent_after_s)
    alive = {r: b for r, b in beats.items() if r not in set(silent)}
    stalled = [r for r, b in alive.items() if _stalled(b)]
    if not stalled:
        return []
    # The collective ranks wait in: per (group, oldest seq in flight), the ranks there.
    waits: dict[tuple[str, int], list[int]] = defaultdict(list)
    for r, b in alive.items():
        for name, g in (b.get("groups") or {}).items():
            if int(g.get("launched", 0)) > int(g.get("completed", 0)):
                waits[(name, int(g["completed"]) + 1)].append(r)
    if not waits:
        return []

    def since(key: tuple[str, int]) -> float:
        times = [c[5] for r in waits[key] if (c := _call(beats[r], *key)) is not None]
        return min(times) if times else now

    # The collective most ranks wait in; of two, the one waited in longer.
    group, seq = max(waits, key=lambda k: (len(waits[k]), -since(k)))
    waiting = sorted(waits[(group, seq)])
    never = sorted(r for r, b in alive.items()
                   if int(((b.get("groups") or {}).get(group) or {}).get("launched", 0)) < seq)  # fmt: skip
    call = next((c for r in waiting if (c := _call(beats[r], group, seq)) is not None), None)
    op, numel, dtype = (str(call[1]), int(call[2]), str(call[3])) if call else ("collective", 0, "")
    started = since((group, seq))
    # The ranks not in it, by identical stacks, the largest set first.
    by_stack: dict[tuple[tuple[str, str, int], ...], list[int]] = defaultdict(list)
    for r in never:
        by_stack[_signature(beats[r].get("stack"))].append(r)
    stacks: list[dict[str, Any]] = []
    for _sig, ranks in sorted(by_stack.items(), key=lambda kv: (-len(kv[1]), kv[1][0])):
        first = beats[ranks[0]]
        stacks.append({
            "ranks": ranks,
            "count": len(ranks),
            "nodes": sorted({f"{b.get('host', '')}#{b.get('node', -1)}"
                             for b in (beats[r] for r in ranks)}),
            "phase": first.get("phase"),
            "last_step": first.get("last_step"),
            "stack": first.get("stack"),
            "torch_flight": first.get("torch_flight"),
        })  # fmt: skip
    culprits = sorted(set(never) | set(silent))
    what = _fmt_call(op, numel, dtype)
    who = (f"{ranks_text(waiting)} waits" if len(waiting) == 1
           else f"{len(waiting):,} ranks ({ranks_text(waiting)}) wait")  # fmt: skip
    parts = [f"Hang: {who} in {what} #{seq} on group {group} for {max(now - started, 0.0):.0f} s"]
    for st in stacks:
        ranks = st["ranks"]
        n = len(ranks)
        parts.append(
            f"{n:,} rank{'s' if n > 1 else ''}{_where([beats[r] for r in ranks])} never "
            f"launched it ({ranks_text(ranks)}, {st['phase']}, last finished step "
            f"{st['last_step']}): {_frames_text(st['stack'])}"
        )
    pending = _torch_pending(beats[waiting[0]])
    if pending is not None:
        parts.append(f"torch's flight recorder on rank {waiting[0]}: {pending['op']} "
                     f"#{pending['seq']} on {pending['group']} {pending['state']}")  # fmt: skip
    if silent:
        parts.append(f"{ranks_text(silent)} silent (no heartbeat): the process or its host is gone")
    if not culprits:
        parts.append("every rank launched it: the collective itself does not complete "
                     "(a peer's network link, or the collective library)")  # fmt: skip
    steps = [int(b["last_step"]) for b in alive.values() if b.get("last_step") is not None]
    last = min(steps) if steps else 0
    return [
        Finding(
            kind="hang",
            severity="critical",
            ranks=tuple(culprits),
            steps=(last, max(steps) if steps else 0),
            message="; ".join(parts) + ".",
            suggestion="Look at where the ranks that never launched the collective are "
            "(their stacks): a data loader, I/O or a lock they wait on, or a code path that "
            "skips the collective on them. A silent rank's host and its logs say why it "
            "went away. Kill the job before the collective's timeout wastes more of it.",
            evidence={
                "collective": {
                    "group": group,
                    "seq": seq,
                    "op": op,
                    "elements": numel,
                    "dtype": dtype,
                    "since": started,
                },
                "waiting": {
                    "count": len(waiting),
                    "ranks": waiting[:256],
                    "torch_flight": beats[waiting[0]].get("torch_flight"),
                },
                "not_launched": stacks,
                "silent": silent,
                "stalled": len(stalled),
            },
            chart="breakdown",
        )
    ]


def desync(rows: list[tuple[float, dict[str, Any]]]) -> list[Finding]:
    """The desync finding: one per group, at the first seq where ranks report different
    collectives (module docstring)."""
    found: list[Finding] = []
    seen: dict[str, dict[int, dict[tuple[str, int, str], list[int]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for _, b in rows:
        for name, g in (b.get("groups") or {}).items():
            for c in g.get("calls", []):
                seen[name][int(c[0])][(str(c[1]), int(c[2]), str(c[3]))].append(int(b["rank"]))
    for name in sorted(seen):
        split = sorted(seq for seq, variants in seen[name].items() if len(variants) > 1)
        if not split:
            continue
        seq = split[0]
        variants = sorted(seen[name][seq].items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        counts = Counter({k: len(v) for k, v in variants})
        top = variants[0][1]
        tie = len(variants) > 1 and counts[variants[0][0]] == counts[variants[1][0]]
        culprits = sorted(r for _, ranks in variants for r in ranks) if tie else sorted(
            r for _, ranks in variants[1:] for r in ranks)  # fmt: skip
        says = "; ".join(f"{ranks_text(sorted(ranks))}: {_fmt_call(op, n, dt)}"
                         for (op, n, dt), ranks in variants)  # fmt: skip
        found.append(
            Finding(
                kind="desync",
                severity="critical",
                ranks=tuple(culprits),
                steps=(0, 0),
                message=f"Desync on group {name} at collective #{seq}: {says}. The ranks "
                "issue different collectives at the same point, so their calls no longer "
                "pair up" + (f" ({len(split)} seqs differ)." if len(split) > 1 else "."),
                suggestion="A collective issued on some ranks only (a rank-dependent branch, "
                "an extra all-reduce for logging or a metric, an uneven number of batches): "
                "make every rank issue the same collectives in the same order.",
                evidence={
                    "group": name,
                    "seq": seq,
                    "variants": [
                        {
                            "op": op,
                            "elements": n,
                            "dtype": dt,
                            "ranks": sorted(r)[:256],
                            "count": len(r),
                        }
                        for (op, n, dt), r in variants
                    ],
                    "seqs_differing": split[:64],
                    "majority_ranks": len(top),
                },
                chart="breakdown",
            )
        )
    return found


def findings(
    rows: list[tuple[float, dict[str, Any]]], *, world_size: int, now: float,
    settings: ForensicsSettings | None = None,
) -> list[Finding]:  # fmt: skip
    """Hang and desync findings of a run from its ranks' newest heartbeats."""
    return hang(rows, world_size=world_size, now=now, settings=settings) + desync(rows)


__all__ = ["ForensicsSettings", "desync", "findings", "hang", "ranks_text"]
