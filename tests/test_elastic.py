"""``gcomp.elastic.init_process_group``: a clear error outside torchrun; inside, each attempt on its own keys."""
from __future__ import annotations

import pytest

import gcomp.elastic


def test_outside_torchrun_the_missing_variables_are_named(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set: start the script "
                                           "with torchrun"):
        gcomp.elastic.init_process_group()


def test_the_attempt_is_torchruns_restart_count(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert gcomp.elastic.attempt() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert gcomp.elastic.attempt() == 3
