"""The redesign changes no behaviour: tiny fixed-seed runs end in the very same weights and
metrics as the stored fingerprints (``tests/behaviour_lock.py``), and a ``last.pt`` written by
the trainer before the redesign still resumes, to the same weights as it did then."""

import json

import behaviour_lock as lock
import pytest
import torch


def stored() -> dict | None:
    return json.loads(lock.LOCK.read_text()).get(lock.machine_key())


def expected(name: str) -> dict:
    entry = stored()
    if entry is None:
        pytest.skip(
            f"no fingerprints for {lock.machine_key()}: record them from a reference commit "
            "with `python tests/behaviour_lock.py --record`"
        )
    return entry[name]


@pytest.mark.parametrize("name", list(lock.RUNS))
def test_a_tiny_run_is_bit_identical_to_its_fingerprint(name, tmp_path):
    want = expected(name)
    assert lock.run_fingerprint(lock.train_run(name, tmp_path)) == want


def test_a_last_pt_from_before_the_redesign_resumes(tmp_path):
    saved = torch.load(lock.FIXTURE, map_location="cpu", weights_only=True)
    assert saved["epoch"] == 1
    run_dir = lock.resume_fixture(tmp_path)  # on any machine: the format still loads
    state = torch.load(run_dir / "checkpoints/last.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == 2 and set(saved) <= set(state)
    assert all(isinstance(k, str) for k in state)  # the same plain-data layout
    if stored() is not None:  # and, where fingerprints were recorded, to the very same weights
        assert lock.run_fingerprint(run_dir) == stored()["resume"]
