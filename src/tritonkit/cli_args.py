"""What the commands' arguments share: shapes as the command line writes them (8192x4096)."""

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
