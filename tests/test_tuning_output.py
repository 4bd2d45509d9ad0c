"""What tuning tells the user: a debug line naming the config each new key runs, and nothing of the
candidates that failed to compile on the terminal. The fake tuner comes from test_tuning.py."""

from __future__ import annotations

import logging

import torch

import test_tuning
from test_tuning import CONFIGS, KEY, FakeKernel, make_tuner
from tritonkit import tuning

cache = test_tuning.cache  # the fixtures: a private cache directory (autouse), tuning as on a GPU
tuning_on = test_tuning.tuning_on


def test_a_new_key_logs_the_config_its_call_runs(caplog, device):
    """One debug line a new key (the memo answers the calls after it): which tuner, key and config."""
    import tritonkit

    tuning.forget_chosen()
    x = torch.randn(3, 50, device=device)
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        tritonkit.softmax(x, -1)
        tritonkit.softmax(x, -1)
    lines = [r.getMessage() for r in caplog.records if " runs {" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("tritonkit: softmax_fwd {"), lines


TRITON_PTXAS_FAILURE = (  # what Triton 3.6 prints when ptxas fails, before raising PTXASError
    "\n\n================================================================\n"
    "`ptxas` failed with error code 255\n"
    ".version 8.7\n.target sm_90a\n// the whole PTX listing\n"
    "================================================================\n"
    "please share the reproducer above with Triton project.\n"
)


def test_a_candidate_that_fails_to_compile_stays_off_the_terminal(tuning_on, cache, capsys, caplog):
    """Triton prints a failed compile's whole PTX to stdout: during tuning it is dropped (the
    rejection is a debug line); anything else printed meanwhile still reaches stdout."""
    fake = FakeKernel()

    def admit(config):
        if CONFIGS.index(config) == 0:
            print(TRITON_PTXAS_FAILURE, end="")
            raise RuntimeError("PTXASError: `ptxas` failed with error code 255")
        print(f"admitting {config['BLOCK']}")
        return fake.admit(config)

    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        winner = make_tuner().config(KEY, admit=admit, time_ms=fake.time_ms)
    out = capsys.readouterr().out
    assert winner != CONFIGS[0] and "ptxas" not in out and "reproducer" not in out
    assert out.count("admitting") == len(CONFIGS) - 1
    assert "left off stdout" in caplog.text and "PTXASError" in caplog.text
