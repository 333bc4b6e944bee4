"""The error types of the engine boundary that are not :mod:`syncd.errors` (those cross it too: the control
routes carry ``DeltaError``, ``IntegrityError``, ``LeaseHeld``, ``NotAuthorized`` ... by name)."""

from __future__ import annotations

__all__ = ["BadRequest", "RemoteEngineError", "EngineUnreachable"]


class BadRequest(ValueError):
    """A control request whose body is malformed (missing or mistyped member)."""


class RemoteEngineError(RuntimeError):
    """An engine process replied with an error of a type this side does not know; the message has it."""


class EngineUnreachable(ConnectionError):
    """The engine process did not answer (down, restarting, or not listening on that address)."""
