"""Split rows: a row far longer than one program should walk, taken by several programs side by side.

Each program of a row takes one SEGMENT of it. Pass 1 reduces the segment and publishes its partial
result; once every segment of the row has published (a per-row counter), each program combines the
row's partials and makes pass 2 over its own segment, which L2 still holds because the segments in
flight together are far smaller than L2. So the row is read from memory once, where a program that
walks the whole row misses L2 in its second pass on long rows, and a few rows still fill every SM.
The programs wait for each other: PHASE 0 (the GPU) needs them all resident at once, a cooperative
launch (``cooperative_programs``). PHASE 1 then PHASE 2, two launches, do the same work without
waiting (the interpreter runs programs one after another). The softmax family and the norms use it.
"""

from __future__ import annotations

from tritonkit._runtime import sm_count
from tritonkit._triton import tl, triton


def cooperative_programs(launcher, per_sm: int, args: tuple, meta: dict, device) -> int:
    """Programs a PHASE 0 launch may run at once: ``per_sm`` an SM, or fewer where the compiled
    kernel's occupancy (registers, shared memory) lets an SM hold fewer; a cooperative launch of
    more fails (``launch_cooperative_grid``), where a plain one would hang in its waits."""
    if meta.get("PHASE", 0) == 0:
        per_sm = min(per_sm, launcher.programs_per_sm(*args, **meta))
    return per_sm * sm_count(device)


@triton.jit
def _segment_of_program(N, segments, SEGMENT, BLOCK_N: tl.constexpr):
    """This program's place: (its first row, rows in flight at once, its segment, the segment's first
    entry, its chunks). A row's programs are adjacent; every program walks every groups-th row."""
    pid = tl.program_id(0)
    segment = pid % segments
    first = segment * SEGMENT
    return (
        pid // segments,
        tl.num_programs(0) // segments,
        segment,
        first,
        tl.cdiv(tl.minimum(N - first, SEGMENT), BLOCK_N),
    )


@triton.jit
def _publish_and_wait(arrived_ptr, row, segments):
    """Count this program's segment of ``row`` as published, then wait until every segment is.

    The barriers order every thread's partial-result stores before the count, and the loads of the
    partials after it; the count is released and read with acquire at GPU scope."""
    tl.debug_barrier()
    count = tl.atomic_add(arrived_ptr + row, 1, sem="acq_rel", scope="gpu") + 1
    while count < segments:
        count = tl.atomic_add(arrived_ptr + row, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
