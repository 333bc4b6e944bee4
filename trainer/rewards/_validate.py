"""Input checks shared by :mod:`syncd.trainer.rewards`.

Every bad *value* (NaN, out of range, negative count, mismatched arrays, β ≤ 0) raises
:class:`RewardInputError`, which is both a :class:`syncd.errors.SyncdError` and a :class:`ValueError`, so
callers that only know the standard library can catch ``ValueError``. A value of the wrong *type* (a string
where a number is expected, a judge that returns ``"yes"`` instead of a bool) raises :class:`TypeError`.
Messages name the offending argument and say what was expected.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from syncd.errors import SyncdError

__all__ = ["RewardInputError"]


class RewardInputError(SyncdError, ValueError):
    """A reward-library input has a bad value; the message names the argument and what is wrong."""


def real(name: str, x: object) -> float:
    """``x`` as a finite Python float; TypeError if it is not a real number, RewardInputError if NaN/inf."""
    if not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    v = float(x)
    if math.isnan(v):
        raise RewardInputError(f"{name} is NaN")
    if math.isinf(v):
        raise RewardInputError(f"{name} must be finite, got {v}")
    return v


def unit(name: str, x: object) -> float:
    """``x`` as a float in the closed interval [0, 1]."""
    v = real(name, x)
    if not 0.0 <= v <= 1.0:
        raise RewardInputError(f"{name} must be in [0, 1], got {v}")
    return v


def nonneg(name: str, x: object) -> float:
    """``x`` as a finite float ≥ 0."""
    v = real(name, x)
    if v < 0.0:
        raise RewardInputError(f"{name} must be >= 0, got {v}")
    return v


def positive(name: str, x: object) -> float:
    """``x`` as a finite float > 0."""
    v = real(name, x)
    if not v > 0.0:
        raise RewardInputError(f"{name} must be > 0, got {v}")
    return v


def beta(x: object) -> float:
    """A valid F_β weight: finite and > 0."""
    return positive("beta", x)


def step(name: str, x: object) -> int:
    """A training step: an integer ≥ 0 (bools are rejected)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(x).__name__} {x!r}")
    v = int(x)
    if v < 0:
        raise RewardInputError(f"{name} must be >= 0, got {v}")
    return v


def flag(name: str, x: object) -> bool:
    """A strict bool (Python or numpy); anything else, including truthy strings, is a TypeError."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(f"{name} must return/be a bool, got {type(x).__name__} {x!r}")


def float_array(name: str, x: object, *, ndim: int | None = None) -> np.ndarray:
    """``x`` as a float64 array with no NaN/inf (and the given number of dimensions, if any)."""
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of real numbers: {exc}") from None
    if ndim is not None and a.ndim != ndim:
        raise RewardInputError(f"{name} must be {ndim}-dimensional, got shape {a.shape}")
    if a.size and np.isnan(a).any():
        raise RewardInputError(f"{name} contains NaN")
    if a.size and np.isinf(a).any():
        raise RewardInputError(f"{name} contains inf; values must be finite")
    return a


def unit_array(name: str, x: object) -> np.ndarray:
    """``x`` as a float64 array of values in [0, 1]."""
    a = float_array(name, x)
    if a.size and ((a < 0.0).any() or (a > 1.0).any()):
        raise RewardInputError(f"{name} must lie in [0, 1], got values in [{a.min()}, {a.max()}]")
    return a


def nonneg_array(name: str, x: object) -> np.ndarray:
    """``x`` as a float64 array of values ≥ 0."""
    a = float_array(name, x)
    if a.size and (a < 0.0).any():
        raise RewardInputError(f"{name} must be >= 0, got minimum {a.min()}")
    return a


def scalar_or_array(a: np.ndarray) -> float | np.ndarray:
    """A 0-d result as a Python float, anything else unchanged."""
    return float(a) if a.ndim == 0 else a
