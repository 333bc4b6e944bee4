"""``syncd.engine_token``: the node's engine-control token file on a real disk -- created once (0600, atomic), read
back, and refused with a message naming the file when it is loose, malformed, or another user's, whoever reads
it (root included: a 0600 file another user owns holds a token that user knows)."""

from __future__ import annotations

import os

import pytest

from syncd import engine_token
from syncd.engine_token import load_or_create, read_token


def test_created_once_mode_0600_and_read_back(tmp_path):
    p = tmp_path / "cfg" / "engine-token"
    tok = load_or_create(p)
    assert len(tok) == 64 and (p.stat().st_mode & 0o777) == 0o600
    assert load_or_create(p) == tok == read_token(p)  # the second process reads the first one's


def test_loose_malformed_and_missing_files_are_refused_naming_the_file(tmp_path):
    p = tmp_path / "engine-token"
    with pytest.raises(ValueError, match=f"no engine token at {p}.*SYNCD_ENGINE_TOKEN_FILE"):
        read_token(p)
    p.write_text("ab" * 32 + "\n")
    p.chmod(0o640)
    with pytest.raises(ValueError, match=r"readable or writable by others \(mode 640\).*chmod 600"):
        read_token(p)
    p.chmod(0o600)
    assert read_token(p) == "ab" * 32
    p.write_text("not a token\n")
    with pytest.raises(ValueError, match="does not hold one"):
        read_token(p)


def test_a_0600_file_of_another_user_is_refused_even_when_the_reader_is_root(tmp_path, monkeypatch):
    """The docstring's promise for every reader: an engine running as root used to accept it."""
    p = tmp_path / "engine-token"
    p.write_text("cd" * 32 + "\n")
    p.chmod(0o600)
    other = os.stat(p).st_uid + 4242  # not the file's owner
    if os.geteuid() == 0:
        os.chown(p, other, -1)  # a real file of another user, read by a real root
    else:  # an unprivileged reader cannot give a file away: it reads its own file as a root that is not its owner
        monkeypatch.setattr(engine_token.os, "geteuid", lambda: 0)
        other = os.stat(p).st_uid
    with pytest.raises(ValueError, match=f"belongs to uid {other}, not to this user"):
        read_token(p)
