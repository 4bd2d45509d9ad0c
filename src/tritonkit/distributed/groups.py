"""What every distributed op needs of its process group: the group from what a caller passes, and
input checked across ranks so that every rank raises the same error (none left waiting in a
collective for a rank that has already raised)."""

from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist


def process_group(group, what: str):
    """A process group from None (the default group), a group, or a one-dimensional DeviceMesh
    (``what`` names the op in the error for a mesh of more dimensions)."""
    if group is not None and hasattr(group, "get_group"):
        if group.ndim != 1:
            raise ValueError(
                f"a DeviceMesh for {what} must be one-dimensional, got {group.ndim} dimensions: pass "
                f"mesh[name] for the dimension it runs over"
            )
        return group.get_group()
    return group if group is not None else dist.group.WORLD


def gather_facts(local_error: str, facts: list[int], what: str, group) -> list[list[int]]:
    """Every rank's ``facts`` (integers, as many on each rank), in rank order; where any rank has a
    ``local_error`` every rank raises one ValueError naming each rank's. The ranks exchange a few
    integers (one all_gather and a copy to the host; all_gather_object took 0.7-0.9 ms a call on
    two H200); the messages travel only when some rank has one."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([int(bool(local_error)), *facts], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).tolist()
    if any(failed for failed, *_ in rows):
        messages = [None] * len(rows)
        dist.all_gather_object(messages, local_error, group=group)
        errors = [f"rank {rank}: {message}" for rank, message in enumerate(messages) if message]
        raise ValueError(f"{what}: bad input on " + "; ".join(errors))
    return [row[1:] for row in rows]


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as an integer the ranks can compare, one for each dtype (its size alone does not tell
    bf16 from fp16; a code for the floats alone let int32 meet int64, and gloo abort a process)."""
    return zlib.crc32(str(dtype).encode())


# each dtype torch names, by its code: what a disagreement on the dtype prints
_DTYPE_OF_CODE = {dtype_code(v): str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}


def float_code(value: float) -> int:
    """A float as the int64 of its bits, which the ranks compare exactly (a scale, say)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def same_on_every_rank(rows: list[list[int]], names: tuple[str, ...], what: str, advice: str) -> None:
    """Raise (on every rank alike: ``rows`` are every rank's) where the ranks' first len(names)
    facts differ, naming the fact and each rank's value."""
    for index, name in enumerate(names):
        values = [row[index] for row in rows]
        if len(set(values)) > 1 and name == "dtype":
            values = [_DTYPE_OF_CODE.get(value, value) for value in values]
        elif len(set(values)) > 1 and name == "softmax scale":
            values = [struct.unpack("<d", struct.pack("<q", value))[0] for value in values]
        if len(set(values)) > 1:
            raise ValueError(f"{what}: ranks disagree on the {name}: {values} (rank by rank); {advice}")
