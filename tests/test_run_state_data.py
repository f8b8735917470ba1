"""The saved policy state of a resumable run is data: JSON round trip, pickles and foreign objects refused."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from gyre.real.run_state import RunStateError, decode_state, encode_state, saved_policy_state


def test_policy_state_round_trips_as_json_with_tuples_and_non_string_keys(tmp_path):
    """Lists, tuples, int-keyed dicts, inf and numpy scalars come back equal (and of the same container types)."""
    state = {"segs": [1, 2, 3], "last_counts": (0.5, 7.0), "seen_step": [0.25, np.int64(3)], "by_id": {3: (1, "a")},
             "max_ctx": float("inf"), "none": None}
    back = decode_state(json.loads(json.dumps(encode_state(state))))
    assert back == {**state, "seen_step": [0.25, 3]}, back
    assert isinstance(back["last_counts"], tuple) and isinstance(back["by_id"][3], tuple), "tuples lost"


def test_a_state_that_is_not_data_is_refused_on_save():
    """An object (here a function) in the state is a TypeError naming where it sits."""
    with pytest.raises(TypeError, match=r"state\['hook'\] is a \w+, not data"):
        encode_state({"hook": len})


def test_a_pickled_or_foreign_policy_state_is_refused_in_one_line(tmp_path):
    """A .policy.pkl beside the checkpoint is never unpickled; a JSON file with an unknown tag is refused too."""
    ck = str(tmp_path / "trainer.pt")
    (tmp_path / "trainer.pt.policy.pkl").write_bytes(pickle.dumps({"policy": "elastic", "state": {}}))
    with pytest.raises(RunStateError) as err:
        saved_policy_state(ck)
    assert "trainer.pt.policy.pkl" in str(err.value) and "\n" not in str(err.value), str(err.value)
    (tmp_path / "trainer.pt.policy.pkl").unlink()
    (tmp_path / "trainer.pt.policy.json").write_text(json.dumps({"policy": "elastic", "state": {"__reduce__": 1}}))
    with pytest.raises(RunStateError, match=r"trainer.pt.policy.json: state: .* is not encoded policy state"):
        saved_policy_state(ck)
    (tmp_path / "trainer.pt.policy.json").write_text(json.dumps({"policy": "elastic", "state": encode_state({"a": (1,)})}))
    assert saved_policy_state(ck) == {"policy": "elastic", "state": {"a": (1,)}}, "a good file must load"
