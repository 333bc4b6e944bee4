"""syncd.engine.vllm.ranks: the names and merged answers of a tensor-parallel vLLM engine (pure functions; no vLLM)."""

from __future__ import annotations

import pytest
import torch

from syncd.engine.vllm import ranks
from syncd.engines.params import identity_specs


def test_names_split_by_rank_and_unknown_names_refused():
    assert ranks.names_by_rank(["a.w", "b"], 1) == [["a.w", "b"]]
    assert ranks.names_by_rank(["tp1.a.w", "tp0.b", "tp1.c"], 2) == [["b"], ["a.w", "c"]]
    for bad in ("a.w", "tp2.a", "tpx.a", "tp1"):
        with pytest.raises(KeyError, match="tp<rank>"):
            ranks.names_by_rank([bad], 2)


def test_specs_and_checksums_named_per_rank():
    specs = identity_specs({"w": torch.zeros(2, 2, dtype=torch.bfloat16)})
    assert [s.name for s in ranks.merge_specs([specs])] == ["w"]
    assert [s.name for s in ranks.merge_specs([specs, specs])] == ["tp0.w", "tp1.w"]
    assert ranks.merge_checksums([{"w": "5"}, {"w": "7"}]) == {"tp0.w": 5, "tp1.w": 7}


def test_results_merge_and_disagreeing_versions_raise():
    a = dict(version=3, words=10, bytes=100, seconds=0.5, prepare_s=0.1)
    b = dict(version=3, words=5, bytes=40, seconds=0.7, prepare_s=0.2)
    m = ranks.merge_stage([a, b])
    assert (m["version"], m["words"], m["bytes"], m["seconds"], m["prepare_s"]) == (3, 15, 140, 0.7, 0.2)
    assert ranks.merge_stage([a]) == a
    w = ranks.merge_write([dict(version=3, words=1, write_s=0.1, derive_s=0.0, swapped=2, rebuilt=0),
                           dict(version=3, words=2, write_s=0.3, derive_s=0.1, swapped=2, rebuilt=1)])
    assert (w["words"], w["write_s"], w["swapped"], w["rebuilt"], len(w["ranks"])) == (3, 0.3, 4, 1, 2)
    with pytest.raises(RuntimeError, match=r"different versions: \[3, 4\]"):
        ranks.merge_write([dict(version=3), dict(version=4)])


def test_cpu_binding_gives_each_rank_an_equal_share():
    assert ranks.cpu_thread_binding(2, [0, 1]) == "0|1"
    assert ranks.cpu_thread_binding(2, [7, 4, 5, 6, 8]) == "4,5|6,7"
    assert ranks.cpu_shares(3, range(7)) == ["0,1", "2,3", "4,5"]
    with pytest.raises(ValueError, match="at least 4 cores"):
        ranks.cpu_thread_binding(4, [0, 1])


def test_cpu_lists_parse_or_say_what_is_wrong():
    assert ranks.parse_cpu_list("0,2-4, 7") == [0, 2, 3, 4, 7]
    assert ranks.cpu_thread_binding(2, ranks.parse_cpu_list("4-7")) == "4,5|6,7"
    with pytest.raises(ValueError, match="not a CPU id list: 'a-b'"):
        ranks.parse_cpu_list("a-b")
