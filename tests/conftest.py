"""Shared test set-up: decide GPU or interpreter before anything imports triton."""

import os

from tritonkit import _runtime

# Triton picks the interpreter for its own library functions when it is first imported, so the
# decision (which sets TRITON_INTERPRET) must come before any test module imports triton.
_runtime.interpret()

import pytest  # noqa: E402
import torch  # noqa: E402

if _runtime.interpret():  # Triton's interpreter made faster (its docstring); its casts rounded as the GPU's
    import fast_interpreter  # noqa: E402
    import tritonkit._triton  # noqa: E402, F401  (as a kernel module imports triton: installs the rounding)

    fast_interpreter.install()


@pytest.fixture
def device() -> str:
    """Where kernel inputs live: CUDA natively, the CPU under the interpreter."""
    return "cpu" if _runtime.interpret() else "cuda"


@pytest.fixture
def launches_faked():
    """Ops on CPU tensors as on a GPU, every launch doing nothing (``testing.launches_faked``)."""
    from tritonkit.testing import launches_faked

    with launches_faked():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # one worker runs the tests that hold gigabytes, in turn (with `--dist loadgroup`, as
        # `make test-gpu` runs): side by side, eight workers' of them overran the H200's memory
        for item in items:
            if "hbm" in item.keywords:
                item.add_marker(pytest.mark.xdist_group("hbm"))
        return
    needs_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_gpu)
    # the slow tests first (a stable sort): started last, one would run alone while the other worker
    # idles, and the suite would end that much later
    items.sort(key=lambda item: "slow" not in item.keywords)


@pytest.fixture(autouse=True)
def _gpu_memory_returned(request):
    """After a gpu test, the CUDA memory its process caches goes back to the device, for the other
    workers' tests: a worker's caching allocator otherwise keeps its largest test's blocks."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _autotune(request, monkeypatch):
    """Tuning on first use, as the suite was written for (where tuning can run: never under the
    interpreter). Users get it opt-in: tests marked ``tuning_default`` see the default, off."""
    if "tuning_default" in request.keywords:
        monkeypatch.delenv("TRITONKIT_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("TRITONKIT_AUTOTUNE", "1")


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test's calls record their own plans (``opdef``'s replays), under the module settings the
    test makes: a plan recorded by an earlier test would replay that test's launches."""
    from tritonkit.opdef import forget_plans

    forget_plans()


# TRITONKIT_TEST_FAILURES=FILE: each failure's report appended to FILE as it happens, so that a run
# stopped by a time limit (a GPU run's) keeps the messages pytest would print only at its end
FAILURES_FILE = os.environ.get("TRITONKIT_TEST_FAILURES")


def pytest_runtest_logreport(report):
    # (under xdist the controller writes: workers' reports reach it too)
    if FAILURES_FILE and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(FAILURES_FILE, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
