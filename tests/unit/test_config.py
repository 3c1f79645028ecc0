from __future__ import annotations

import pytest

from engine.config import EngineConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_sessions", 0), ("max_batch_rows", 0), ("startup_timeout_s", 0), ("worker_entry", "nocolon")],
)
def test_bounds_are_checked_at_construction_and_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
