"""What the commands' arguments share: shapes as the command line writes them (8192x4096), and
checked against an op's."""

from __future__ import annotations


def parse_shape(parts: list[str], flag: str = "--shape") -> tuple[int, ...]:
    """``flag``'s words (``8192x4096``, or ``8192 4096``) as a tuple of ints >= 0, else ValueError
    naming the flag (the CLI prints it as one line)."""
    given = " ".join(parts)
    try:
        dims = tuple(int(d) for part in parts for d in part.lower().split("x") if d)
    except ValueError:
        dims = ()
    if not dims:
        raise ValueError(f"{flag} takes integers like 8192x4096, got {given}")
    if any(d < 0 for d in dims):
        raise ValueError(f"{flag} needs non-negative dimensions, got {given}")
    return dims


def workload_shape(workload, parts: list[str], command: str) -> tuple[int, ...]:
    """--shape for ``workload``: as many dimensions as its benchmark shapes have, each >= 1 (an empty
    tensor moves nothing and launches nothing), or ValueError giving one of its shapes."""
    shape, given = parse_shape(parts), " ".join(parts)
    example = workload.shape_list("quick")[0][0]
    if len(shape) != len(example):
        raise ValueError(
            f"{command} {workload.name} takes shapes of {len(example)} dimensions "
            f"({' x '.join(workload.op.dims)}), like {'x'.join(map(str, example))}; got {given}"
        )
    if 0 in shape:
        raise ValueError(f"{command} needs dimensions >= 1 (an empty tensor moves nothing), got {given}")
    return shape


def workload_dtype(workload, name: str):
    """The torch dtype ``name`` (fp32, fp16, bf16) if ``workload``'s op has kernels for it, else
    ValueError naming those it has."""
    from tritonkit.dtypes import DTYPE_OF, NAME_OF

    dtype = DTYPE_OF[name]
    if dtype not in workload.op.dtypes:
        supported = ", ".join(NAME_OF[d] for d in workload.op.dtypes)
        raise ValueError(f"{workload.name} takes {supported}, not {name}")
    return dtype
