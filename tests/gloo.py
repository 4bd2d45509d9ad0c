"""CPU processes on gloo for the tests that need several ranks: each rank's set-up (the kernels in
the interpreter, with the suite's speed-ups, before anything imports triton) and the parent's start
and wait, failing rather than hanging past a deadline."""

from __future__ import annotations

import datetime
import json
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


def run_ranks(results_of, world: int, timeout_s: float, tmp_path, what: str) -> list[dict]:
    """Each of ``world`` spawned ranks joins the gloo group and writes ``results_of(rank)`` (a dict
    of JSON values; every rank calls it, so it may make subgroups); the ranks' results, in rank
    order."""
    store, out_dir = str(tmp_path / "store"), str(tmp_path)
    files = [tmp_path / f"rank{rank}.json" for rank in range(world)]
    try:
        run(_rank, (results_of, world, store, out_dir, timeout_s), world, timeout_s, what)
    except mp.ProcessExitedException as error:
        # every rank writes its results before the last barrier, so an abort once they all exist is
        # the teardown's (gloo's "terminate called without an active exception" aborted a rank of
        # test_fsdp2_trains_as_one_process once in a CI run, all_finished notwithstanding): the results
        # stand. Any other exit, or an abort before every rank's results, fails.
        if error.signal_name != "SIGABRT" or not all(f.exists() for f in files):
            raise
    return [json.loads(f.read_text()) for f in files]


def _rank(rank: int, results_of, world: int, store: str, out_dir: str, timeout_s: float) -> None:
    join_group(rank, world, store, timeout_s // 2)
    import torch.distributed as dist

    try:
        results = results_of(rank)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
            json.dump(results, out)
        dist.barrier()
        all_finished(store, world, timeout_s // 2)
    finally:
        dist.destroy_process_group()


def assert_comparisons_passed(run: list[dict], counts) -> None:
    """Each rank's results under each key of ``counts(rank)`` (a dict: key -> how many) hold that
    many comparisons (``{"name", "passed", "text"}``), every one passed."""
    for rank, results in enumerate(run):
        for key, count in counts(rank).items():
            comparisons = [r for r in results[key] if "name" in r]
            assert len(comparisons) == count, (key, rank, results)
            failing = [r["text"] for r in comparisons if not r["passed"]]
            assert not failing, (key, rank, failing)
