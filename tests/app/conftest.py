"""The applications (syncd.app) are tested with the daemon's fixtures: a published store of a tiny model."""

from tests.daemon.conftest import published  # noqa: F401 (the fixture)
