"""Native or torch per kind and size of step (pagedchat/native/paths.py PathChoice): measured on a simulated
machine where each path's per-token time is known, decided once, kept on disk for the next process."""

from __future__ import annotations

import json

import pytest

from pagedchat.native.paths import PathChoice, group_of


@pytest.fixture(autouse=True)
def measured(monkeypatch):
    """The measurement itself (tests/conftest.py makes every other test take the native step)."""
    monkeypatch.delenv("PAGEDCHAT_NATIVE", raising=False)


def drive(choice: PathChoice, cost: dict[str, float], steps: int, tokens: int = 16, seqs: int = 16) -> list[str]:
    """Run `steps` steps of one size; cost: path -> seconds per token. The paths taken, in order."""
    taken = []
    for _ in range(steps):
        native = choice.use_native(tokens, seqs, threads=1)
        path = "native" if native else "torch"
        choice.record(tokens, seqs, 1, native, cost[path] * tokens)
        taken.append(path)
    return taken


def test_the_faster_path_wins_after_a_few_alternating_steps(tmp_path):
    choice = PathChoice(tmp_path / "paths.json", "model-a")
    taken = drive(choice, {"native": 1.0, "torch": 2.0}, 40)
    trial = 2 * (PathChoice.TRIALS + 1)
    assert taken[:trial] == ["native", "torch"] * (PathChoice.TRIALS + 1) and set(taken[trial:]) == {"native"}
    slower = PathChoice(tmp_path / "other.json", "model-a")
    assert set(drive(slower, {"native": 3.0, "torch": 2.0}, 40)[trial:]) == {"torch"}  # never slower than torch


def test_each_size_of_step_is_measured_on_its_own_whatever_its_kind(tmp_path):
    choice = PathChoice(None, "model-a")
    drive(choice, {"native": 1.0, "torch": 2.0}, 20, tokens=1, seqs=1)
    assert set(drive(choice, {"native": 3.0, "torch": 2.0}, 20, tokens=64, seqs=64)[8:]) == {"torch"}
    assert choice.use_native(1, 1, threads=1) and not choice.use_native(40, 40, threads=1)  # 33-64 one group
    assert group_of(5, 1) == group_of(8, 8) == "tokens<=8" and group_of(9, 9) == "tokens<=16"
    assert group_of(1, 1) == "tokens<=1" and group_of(3, 1) == group_of(4, 4) == "tokens<=4"


def test_decisions_are_kept_for_the_next_process_and_per_model(tmp_path):
    store = tmp_path / "paths.json"
    drive(PathChoice(store, "model-a"), {"native": 3.0, "torch": 2.0}, 20)
    again = PathChoice(store, "model-a")
    assert drive(again, {"native": 1.0, "torch": 2.0}, 5) == ["torch"] * 5  # no trial: decided on disk
    assert drive(PathChoice(store, "model-b"), {"native": 1.0, "torch": 2.0}, 2) == ["native", "torch"]
    entry = json.loads(store.read_text())["model-a"]["tokens<=16/threads=1"]
    assert entry["use"] == "torch" and entry["native_ms_per_token"] > entry["torch_ms_per_token"]


def test_a_damaged_file_is_measured_again(tmp_path):
    store = tmp_path / "paths.json"
    store.write_text("{not json")
    assert drive(PathChoice(store, "m"), {"native": 1.0, "torch": 2.0}, 2) == ["native", "torch"]


def test_always_skips_the_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_NATIVE", "always")
    assert drive(PathChoice(tmp_path / "p.json", "m"), {"native": 3.0, "torch": 2.0}, 20) == ["native"] * 20
    assert not (tmp_path / "p.json").exists()
