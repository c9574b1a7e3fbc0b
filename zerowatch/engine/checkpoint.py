"""Checkpoints: every rank saves its own part; consolidation gathers full fp32 weights on
rank 0, one segment at a time.

Layout of `save_checkpoint(dir, tag)` (tag defaults to `global_step<N>`):

    dir/latest                      the last tag written
    dir/<tag>/zero_rank<r>.pt       rank r: fp32 master parts, optimizer state, scheduler,
                                    loss scaler, step counters, and the layout they assume
    dir/<tag>/module_extra.pt       rank 0: buffers and frozen parameters

Loading needs the same stage and segment layout (a clear error otherwise); it restores the
masters and then rebuilds the compute-dtype parameters from them, exactly as after an
optimizer step, so a resumed run continues bit for bit. At another world size (more or
fewer ranks, the same config otherwise), every rank reads all the saved parts, joins each
segment's fp32 master and optimizer state back into whole vectors and takes its own part
of them under the new world size; keep the global batch (micro-batch × accumulation ×
ranks) to continue the same training.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from zerowatch.engine.engine import ZeroEngine


def _layout(engine: ZeroEngine) -> list[tuple[int, int, int]]:
    return [(s.numel, s.shards, s.group) for s in engine.parts.segments]


def _members(layout: list[Any]) -> list[tuple[int, int]]:
    """A layout without its shard counts: which segments, how large, in which group."""
    return [(int(numel), int(group)) for numel, _shards, group in layout]


def _extra_state(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    trained = {id(s.param) for seg in engine.parts.segments for s in seg.slots}
    out: dict[str, torch.Tensor] = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) not in trained:
            out[name] = t.detach().cpu().clone()
    return out


def save(engine: ZeroEngine, save_dir: str | Path, tag: str | None = None) -> str:
    tag = tag or f"global_step{engine.global_steps}"
    path = Path(save_dir) / tag
    path.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {
        "world_size": engine.world_size,
        "zero_stage": engine.zero_stage,
        "precision": engine.precision,
        "layout": _layout(engine),
        "masters": [m.param.detach().cpu().clone() for m in engine.masters.masters],
        "optimizer": engine.optimizer.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "scaler": engine.scaler.state_dict(),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
    }
    torch.save(state, path / f"zero_rank{engine.rank}.pt")
    if engine.rank == 0:
        torch.save(_extra_state(engine), path / "module_extra.pt")
        (Path(save_dir) / "latest").write_text(tag)
    engine.comm.barrier()
    return str(path)


def _read(engine: ZeroEngine, load_dir: str | Path, tag: str | None) -> tuple[Path, Any]:
    """This rank's checkpoint file, checked against the engine."""
    if tag is None:
        latest = Path(load_dir) / "latest"
        if not latest.exists():
            raise FileNotFoundError(f"load_checkpoint: no tag given and no {latest}")
        tag = latest.read_text().strip()
    path = Path(load_dir) / tag
    file = path / f"zero_rank{engine.rank}.pt"
    # A rank beyond the saving world reshards from every part: it starts from rank 0's.
    first = path / "zero_rank0.pt"
    if not file.exists() and first.exists():
        file = first
    if not file.exists():
        raise FileNotFoundError(f"load_checkpoint: {file} does not exist (rank {engine.rank})")
    state = torch.load(file, map_location="cpu", weights_only=False)
    if file == first and engine.rank > 0 and state["world_size"] > engine.rank:
        raise FileNotFoundError(f"load_checkpoint: {path / f'zero_rank{engine.rank}.pt'} does "
                                f"not exist (rank {engine.rank})")  # fmt: skip
    if state["zero_stage"] != engine.zero_stage:
        raise ValueError(f"load_checkpoint: zero_stage {state['zero_stage']} in {path}, "
                         f"engine has {engine.zero_stage}")  # fmt: skip
    if _members(state["layout"]) != _members(_layout(engine)):
        raise ValueError(f"load_checkpoint: {path} was saved for a different model or bucket "
                         "layout")  # fmt: skip
    if state["world_size"] != engine.world_size:
        state = _resharded(engine, path, state)
    elif state["layout"] != _layout(engine):
        raise ValueError(f"load_checkpoint: {path} was saved for a different shard layout")
    return path, state


def _resharded(engine: ZeroEngine, path: Path, first: dict[str, Any]) -> dict[str, Any]:
    """This rank's state under the engine's world size, from every part of a checkpoint
    saved at another world size (`first` is one of them)."""
    saved_world = int(first["world_size"])
    parts = []
    for r in range(saved_world):
        file = path / f"zero_rank{r}.pt"
        if not file.exists():
            raise FileNotFoundError(
                f"load_checkpoint: {file} does not exist (the checkpoint was saved by "
                f"{saved_world} ranks; resharding to {engine.world_size} reads all of them)"
            )
        parts.append(torch.load(file, map_location="cpu", weights_only=False))
    masters = engine.masters.masters
    segments = [m.seg for m in masters]
    by_segment = {seg.index: i for i, seg in enumerate(engine.parts.segments)}
    saved_shards = [int(first["layout"][by_segment[seg.index]][1]) for seg in segments]

    def mine(i: int, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Master i's part on this rank, from the saved ranks' parts."""
        seg = segments[i]
        whole = torch.cat(pieces) if saved_shards[i] > 1 else pieces[0]
        whole = whole[: seg.numel]
        padded = torch.zeros(seg.padded, dtype=whole.dtype)
        padded[: seg.numel] = whole
        return seg.shard_of(padded).clone() if seg.sharded else padded[: seg.numel].clone()

    state = dict(first)
    state["masters"] = [mine(i, [p["masters"][i] for p in parts]) for i in range(len(masters))]
    # The optimizer numbers its tensors in the order of its param groups; map each number
    # to its master to find the part sizes.
    master_of = {id(m.param): i for i, m in enumerate(masters)}
    order = [master_of[id(t)] for g in engine.optimizer.param_groups for t in g["params"]]
    optim = dict(first["optimizer"])
    optim["state"] = {}
    for pid, entry in first["optimizer"]["state"].items():
        i = order[pid]
        part_numel = parts[0]["masters"][i].numel()
        optim["state"][pid] = {
            key: mine(i, [p["optimizer"]["state"][pid][key] for p in parts])
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == part_numel
            else value
            for key, value in entry.items()
        }
    state["optimizer"] = optim
    state["world_size"] = engine.world_size
    state["layout"] = _layout(engine)
    return state


def load(engine: ZeroEngine, load_dir: str | Path, tag: str | None = None) -> str:
    # The ranks agree on whether every one of them could read its file before any goes on:
    # a rank that raised alone would leave the others waiting in the next collective.
    error: Exception | None = None
    try:
        path, state = _read(engine, load_dir, tag)
    except Exception as e:
        error = e
    errors = engine.comm.all_gather_object(None if error is None else str(error))
    if error is not None:
        raise error
    failed = [(r, msg) for r, msg in enumerate(errors) if msg is not None]
    if failed:
        rank, msg = failed[0]
        raise RuntimeError(f"load_checkpoint: rank {rank} could not load: {msg}")
    with torch.no_grad():
        for m, saved in zip(engine.masters.masters, state["masters"], strict=True):
            m.param.copy_(saved)
    engine.optimizer.load_state_dict(state["optimizer"])
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.scaler.load_state_dict(state["scaler"])
    engine.global_steps = state["global_steps"]
    engine.micro_steps = state["micro_steps"]
    engine.skipped_steps = state["skipped_steps"]
    engine.masters.copy_to_params()
    for o in engine.parts.owners:
        o.after_step()
    extra = torch.load(path / "module_extra.pt", map_location="cpu", weights_only=False)
    current = engine.module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, t in extra.items():
            if name in current:
                current[name].copy_(t)
    engine.comm.barrier()
    return str(path)


def consolidated_state_dict(engine: ZeroEngine,
                            dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:  # fmt: skip
    """The full weights (from the fp32 masters, cast to `dtype`) and buffers, by the
    module's state-dict names, on rank 0's host; {} on the other ranks.

    A collective. Segments are all-gathered one at a time into a transient buffer on the
    training device (a segment: a reduce bucket or a stage-3 unit) and only rank 0 copies
    its parameters to the host, so rank 0 ends with the model once and the other ranks
    never hold more than one segment.
    """
    keep = engine.rank == 0
    full: dict[int, torch.Tensor] = {}
    for m in engine.masters.masters:
        seg = m.seg
        part = m.param.detach().to(engine.device, torch.float32)
        if seg.sharded:
            whole = torch.empty(seg.padded, dtype=torch.float32, device=engine.device)
            engine.comm.all_gather(whole, part, purpose="other").wait()
        else:
            whole = part
        if keep:
            for s in seg.slots:
                view = whole.narrow(0, s.offset, s.numel).view(s.shape)
                full[id(s.param)] = view.to("cpu", dtype, copy=True)
        del whole, part
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in full:
            out[name] = full[id(t)]
        else:
            v = t.detach()
            out[name] = v.to("cpu", dtype if v.is_floating_point() else v.dtype, copy=True)
    return out


__all__ = ["consolidated_state_dict", "load", "save"]
