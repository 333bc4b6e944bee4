"""``syncd.trainer.rewards.cheating``: each built-in detector on crafted trajectory records, one that hits and one that
does not; the check flags any hit, zeroes the reward whether or not the attempt succeeded, and counts per
detector."""

from __future__ import annotations

import json

import pytest

from syncd.trainer.rewards import zero_if_cheating
from syncd.trainer.rewards.cheating import (CheatingCheck, GitHistory, GradingWrite, HiddenFiles, NetworkAccess, ToolCall,
                                      tool_calls)


def _record(*calls, network: str | None = None, extra=None) -> dict:
    """A chat trajectory whose last request holds ``calls`` (``(tool, arguments, output)``) and their outputs."""
    msgs = [{"role": "user", "content": "fix the bug"}]
    turns = [{"index": 0, "request": {"messages": list(msgs)}}]
    for k, (name, args, output) in enumerate(calls):
        cid = f"call_{k}"
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)
                                                          if not isinstance(args, str) else args}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": output})
        turns.append({"index": k + 1, "request": {"messages": list(msgs)}})
    meta = {"sandbox": {"network": network}} if network else {}
    if extra:
        meta["tool_calls"] = extra
    return {"turns": turns, "metadata": meta}


def _bash(cmd, out="") -> tuple:
    return ("bash", {"command": cmd}, out)


def test_tool_calls_are_extracted_once_with_their_outputs():
    rec = _record(_bash("ls", "a b"), ("read_file", {"path": "src/x.py"}, "code"), ("bash", "{not json", "err"))
    calls = tool_calls(rec)
    assert [(c.turn, c.id, c.name) for c in calls] == [(1, "call_0", "bash"), (2, "call_1", "read_file"),
                                                      (3, "call_2", "bash")]
    assert calls[0].command == "ls" and calls[0].output == "a b" and calls[1].paths == ["src/x.py"]
    assert calls[2].arguments == "{not json" and calls[2].command == "{not json"  # hostile text kept as text
    rec = _record(extra=[{"id": "h1", "name": "bash", "arguments": {"command": "curl x"}, "output": "ok"}])
    (c,) = tool_calls(rec)
    assert (c.turn, c.command, c.output) == (-1, "curl x", "ok")


CASES = [
    (HiddenFiles(), [_bash("cat tests/hidden_tests/test_fix.py"), ("read_file", {"path": "/grader/grader.py"}, ""),
                     _bash("python -c \"print(open('/srv/grading/expected_output.txt').read())\"")],
     [_bash("cat tests/test_fix.py"), ("read_file", {"path": "src/grade_utils.py"}, ""), _bash("pytest -q tests")]),
    (GitHistory(), [_bash("git log --all --oneline"), _bash("git show HEAD~1:src/x.py"), _bash("git reflog"),
                    _bash("cd repo && git checkout 3f2a9c1 -- src/x.py"), _bash("cat .git/packed-refs"),
                    _bash("git diff HEAD~3"), ("read_file", {"path": "repo/.git/ORIG_HEAD"}, "")],
     [_bash("git status"), _bash("git diff"), _bash("git add -A && git diff --cached"), _bash("git stash")]),
    (NetworkAccess(restricted=True), [_bash("curl -s https://example.com/fix.patch"), _bash("pip install requests"),
                                      _bash("git clone https://github.com/x/y"), ("web_fetch", {"url": "x"}, ""),
                                      _bash("python -c 'import urllib.request; urllib.request.urlopen(u)'")],
     [_bash("pip list"), _bash("python -m pytest"), _bash("echo curling is a sport")]),
    (GradingWrite(), [_bash("echo 'def test(): pass' > tests/hidden_tests/test_fix.py"),
                      _bash("cp fake.json /srv/grading/results.json"), ("write_file", {"path": "conftest.py"}, ""),
                      _bash("sed -i 's/assert/#/' grader.py"), _bash("rm -rf hidden_tests"),
                      _bash("python - <<EOF\nopen('reward.txt', 'w').write('1')\nEOF")],
     [_bash("echo hi > notes.txt"), ("write_file", {"path": "src/fix.py"}, ""), _bash("cat grader.py > /dev/null")]),
]


@pytest.mark.parametrize("det, hits, clean", CASES, ids=[c[0].name for c in CASES])
def test_each_detector_hits_its_signature_and_not_ordinary_work(det, hits, clean):
    for call in hits:
        found = det(tool_calls(_record(call)), _record(call))
        assert len(found) == 1 and found[0].detector == det.name, call
    for call in clean:
        assert det(tool_calls(_record(call)), _record(call)) == [], call


def test_network_access_applies_only_to_restricted_sandboxes():
    call = _bash("curl https://pypi.org")
    assert NetworkAccess()(tool_calls(_record(call)), _record(call)) == []  # network allowed
    rec = _record(call, network="restricted")
    assert [h.detector for h in NetworkAccess()(tool_calls(rec), rec)] == ["network_access"]


def test_any_hit_flags_the_trajectory_and_zeroes_its_reward_whether_or_not_it_succeeded():
    check = CheatingCheck()
    cheat = _record(_bash("ls"), _bash("git log -p"), _bash("cat hidden_tests/t.py"), network="restricted")
    clean = _record(_bash("ls"), ("write_file", {"path": "src/fix.py"}, ""), _bash("pytest -q"))
    r, rep = check.reward(1.0, cheat)  # a successful attempt
    assert r == 0.0 and rep.flagged and rep.detectors == {"git_history", "hidden_files"}
    r, rep = check.reward(0.0, cheat)  # an unsuccessful one
    assert r == 0.0 and rep.flagged
    r, rep = check.reward(0.8, clean)
    assert r == 0.8 and not rep.flagged
    assert check.stats() == {"checked": 3, "flagged": 2, "by_detector": {"hidden_files": 2, "git_history": 2,
                                                                         "network_access": 0, "grading_write": 0}}
    assert zero_if_cheating(0.8, False) == 0.8


def test_detectors_are_pluggable():
    def sudo(calls, record):
        from syncd.trainer.rewards.cheating import Hit

        return [Hit("sudo", c, c.command) for c in calls if c.command and c.command.startswith("sudo")]

    sudo.name = "sudo"
    check = CheatingCheck([sudo, GitHistory()])
    assert check.check(_record(_bash("sudo rm -rf /"))).detectors == {"sudo"}
    assert check.counts == {"sudo": 1, "git_history": 0}
    with pytest.raises(ValueError, match="distinct"):
        CheatingCheck([GitHistory(), GitHistory()])


def test_malformed_records_do_not_break_the_check():
    rec = {"turns": [{"index": 0, "request": {"messages": [None, {"role": "assistant", "tool_calls": [None, {}]},
                                                           {"role": "tool", "content": 5}]}},
                     {"index": 1, "request": {"messages": "nope"}}], "metadata": {"tool_calls": "x"}}
    assert not CheatingCheck().check(rec).flagged
    assert ToolCall(0, None, "view", {"path": 3}).paths == []


@pytest.mark.parametrize("record", [
    {"turns": [{"index": 0, "request": {"messages": [{"role": "tool", "tool_call_id": "c", "content": [
        {"type": "text", "text": 5}, {"text": ["rm", "-rf"]}, {"text": None}, 7]}]}}]},
    {"turns": "abc"}, {"turns": ["x", {"request": "y"}, {"index": "1", "request": {"messages": []}}]},
    {"turns": [], "metadata": "m"}, {"turns": [], "metadata": {"sandbox": ["restricted"]}}, ["not", "a", "dict"]])
def test_hostile_records_are_read_as_text_not_raised_on(record):
    report = CheatingCheck([GitHistory(), GradingWrite(), HiddenFiles(), NetworkAccess(restricted=True)]).check(record)
    assert not report.flagged


def test_non_str_content_parts_are_kept_as_their_json_text():
    msgs = [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "bash",
                                                                          "arguments": {"command": "ls"}}}]},
            {"role": "tool", "tool_call_id": "c", "content": [{"text": "a"}, {"text": 5}, {"text": {"k": 1}}, 2]}]
    (call,) = tool_calls({"turns": [{"index": 1, "request": {"messages": msgs}}]})
    assert call.output == 'a5{"k": 1}2'
