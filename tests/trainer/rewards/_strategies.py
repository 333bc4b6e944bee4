"""What the reward tests' properties draw from, and how they run: without hypothesis' deadline (a first call may
be slow on a busy machine)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

unit = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
betas = st.floats(min_value=0.05, max_value=20.0, allow_nan=False)
token_counts = st.integers(0, 100_000)


def reward_property(**strategies):
    """``@given(**strategies)`` with no deadline."""
    return lambda test: settings(deadline=None)(given(**strategies)(test))
