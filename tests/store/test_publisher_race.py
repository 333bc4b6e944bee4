"""Two publishers racing for one version, on every store (``any_store``): the store's create-if-absent put of
the manifest decides which one owns it, the loser fails with :class:`VersionConflict` and removes its shards."""

from __future__ import annotations

import pytest

from syncd import manifest as mf
from syncd.errors import PublishError, VersionConflict
from syncd.publish.publisher import WeightPublisher
from syncd.versions import read_manifest

from ._models import trajectory
from .conftest import KEY

RUN = "race"


def test_conditional_put_makes_the_second_publisher_lose(any_store):
    state = trajectory(1)[0]
    a = WeightPublisher(any_store, RUN, signing_key=KEY)
    b = WeightPublisher(any_store, RUN, signing_key=KEY)
    a.publish(state, 0)
    a.flush()
    b.publish(state, 0)  # b lists after a committed: takes version 1
    b.flush()
    a.publish(state, 1)  # a still believes version 1 is free
    with pytest.raises(PublishError) as err:
        a.close()
    assert isinstance(err.value.__cause__, VersionConflict)
    b.close()
    assert read_manifest(any_store, RUN, 1, signing_key=KEY).session == b.session
    keys = [o.key for o in any_store.list(mf.versions_prefix(RUN) + "000000000001/")]
    assert all(a.session not in k for k in keys), "the loser's shards were removed"
