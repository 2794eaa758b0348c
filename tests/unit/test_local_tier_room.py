"""The local tier's node memory: each user's own root by default. Real jobs in a mount namespace
(another user's folder, a full root): tests/integration/test_local_tier_room_runs.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer.checkpoint import LOCAL_TIER_ROOT_ENV, local_tier_root


def test_the_default_root_is_this_users_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOCAL_TIER_ROOT_ENV, raising=False)
    assert local_tier_root() == Path(f"/dev/shm/rfsdp-local-{os.geteuid()}")
