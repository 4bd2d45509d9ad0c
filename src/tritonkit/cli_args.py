"""What the commands' arguments share: shapes as the command line writes them (8192x4096), and
checked against an op's."""

from __future__ import annotations


def parse_shape(parts: list[str]) -> tuple[int, ...]:
    """``--shape``'s words (``8192x4096``, or ``8192 4096``) as a tuple of ints >= 0; a message and
    exit where they are not (argparse's way with a malformed flag)."""
    try:
        dims = tuple(int(d) for part in parts for d in part.lower().split("x") if d)
    except ValueError:
        raise SystemExit(f"--shape takes integers like 8192x4096, got {' '.join(parts)}") from None
    if not dims or any(d < 0 for d in dims):
        raise SystemExit(f"--shape needs non-negative dimensions, got {' '.join(parts)}")
    return dims


def workload_shape(workload, parts: list[str], command: str) -> tuple[int, ...]:
    """--shape for ``workload``: as many dimensions as its benchmark shapes have, each >= 1 (an empty
    tensor moves nothing and launches nothing), or ValueError giving one of its shapes."""
    shape, given = parse_shape(parts), " ".join(parts)
    example = workload.shape_list("quick")[0][0]
    if len(shape) != len(example):
        raise ValueError(
            f"{command} {workload.name} takes shapes of {len(example)} dimensions, like "
            f"{'x'.join(map(str, example))}; got {given}"
        )
    if 0 in shape:
        raise ValueError(f"{command} needs dimensions >= 1 (an empty tensor moves nothing), got {given}")
    return shape
