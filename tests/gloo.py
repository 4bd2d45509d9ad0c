"""CPU processes on gloo for the tests that need several ranks: each rank's set-up (the kernels in
the interpreter, with the suite's speed-ups, before anything imports triton) and the parent's start
and wait, failing rather than hanging past a deadline."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.multiprocessing as mp


def join_group(rank: int, world: int, store: str, timeout_s: float) -> None:
    """In a spawned rank: choose the interpreter (on a GPU machine too) and join the gloo group."""
    os.environ["TRITONKIT_INTERPRET"] = "1"
    from tritonkit import _runtime

    _runtime.interpret()  # before torch.distributed (FSDP's modules import triton)
    import torch.distributed as dist

    import fast_interpreter

    fast_interpreter.install()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def run(worker, args: tuple, world: int, timeout_s: float, what: str) -> None:
    """Spawn ``world`` processes of ``worker(rank, *args)`` and wait for them, terminating them and
    failing the test if they have not finished in ``timeout_s``."""
    context = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    while not context.join(timeout=5):
        if datetime.datetime.now() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail(f"{what} on {world} processes did not finish in {timeout_s} s")


def all_finished(store: str, world: int, timeout_s: float) -> None:
    """Wait until every rank has come back from the last collective, counted in a file store of its
    own, not over gloo's connections: a rank that closed its group while another's gloo thread was
    still finishing that collective aborted the other ("terminate called without an active
    exception", seen under a loaded CI machine). Call it after the last collective, before closing
    the group: no rank then closes its connections while another still uses them."""
    import time

    import torch.distributed as dist

    finished = dist.FileStore(store + ".finished", world)
    finished.add("finished", 1)
    deadline = time.monotonic() + timeout_s
    while finished.add("finished", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)
