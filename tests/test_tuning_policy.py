"""Tuning is opt-in: a key's first call runs its default at once unless tuning is turned on
(TRITONKIT_AUTOTUNE, ``tuning.enabled()``, ``tritonkit tune``), and a default chosen while it is
off is final until it is turned on."""

from __future__ import annotations

import pytest

from tritonkit import tuning

pytestmark = [pytest.mark.tuning, pytest.mark.tuning_default]

KEY = {"N": 64}
DEFAULT = {"BLOCK": 16}
CONFIGS = [{"BLOCK": 8}, DEFAULT]
TIMES = {8: 1.0, 16: 2.0}  # BLOCK 8 is the faster: a tuning picks it


@pytest.fixture(autouse=True)
def gpu_like(tmp_path, monkeypatch):
    """A private cache, and tuning as on a GPU (not the interpreter's one config)."""
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "_single_config", lambda: False)


class Counting(tuning.Tuned):
    """A Tuned over a fake kernel: its problem is a dict, and its admission and timing are counted."""

    def __init__(self):
        tuner = tuning.Tuner("policy-fake", CONFIGS, sources=("v1",), default=lambda key: DEFAULT)
        super().__init__(tuner, launches=None, calibrate=None, reference=None, outputs=())
        self.trials = 0

    def admit(self, problem, config):
        self.trials += 1
        return True

    def time_ms(self, problem, config):
        return TIMES[config["BLOCK"]]

    def precompile(self, problem, configs):
        pass


@pytest.fixture
def tuned():
    counting = Counting()
    yield counting
    tuning.TUNED.remove(counting)


def test_a_first_call_runs_the_default_at_once_and_keeps_it(tuned):
    assert not tuning.autotune_on() and not tuning.tuning_possible() and tuning.choices_settled()
    assert tuned.choose(KEY, {}) == (DEFAULT, True)  # final: later calls of the key skip the lookup
    assert tuned.trials == 0


def test_enabled_tunes_a_key_the_first_call_of_which_ran_the_default(tuned):
    assert tuned.choose(KEY, {})[0] == DEFAULT
    with tuning.enabled():
        assert tuning.autotune_on() and tuning.tuning_possible()
        assert tuned.choose(KEY, {}) == ({"BLOCK": 8}, True)
    assert tuned.choose(KEY, {})[0] == {"BLOCK": 8} and tuned.trials == 2


def test_the_environment_variable_turns_tuning_on(tuned, monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_VARIABLE, "1")
    assert tuned.choose(KEY, {}) == ({"BLOCK": 8}, True)
    monkeypatch.setenv(tuning.AUTOTUNE_VARIABLE, "0")
    assert not tuning.autotune_on()
    for off in ("false", "Off", "no", ""):  # "false" once counted as on: anything but "" and "0" did
        monkeypatch.setenv(tuning.AUTOTUNE_VARIABLE, off)
        assert not tuning.autotune_on()
    monkeypatch.setenv(tuning.AUTOTUNE_VARIABLE, "ture")
    with pytest.raises(ValueError, match="TRITONKIT_AUTOTUNE must be 1 or 0"):
        tuning.autotune_on()


def test_a_paused_tuning_chooses_a_stand_in_not_a_final_config(tuned, monkeypatch):
    """With tuning on but unable to run now (disabled(), a capture, a trace), the default is a
    stand-in: not kept, and not settled (an op records no plan over it)."""
    monkeypatch.setenv(tuning.AUTOTUNE_VARIABLE, "1")
    with tuning.disabled():
        assert not tuning.choices_settled()
        assert tuned.choose(KEY, {}) == (DEFAULT, False)
    assert tuning.choices_settled() and tuned.choose(KEY, {}) == ({"BLOCK": 8}, True)
