"""The frontend's address flags are defined once (syncd.engine.dynamo.settings.add_frontend_arguments) for
``syncd.engine.dynamo.frontend`` and ``syncd serve``: both read SYNCD_DYNAMO_HTTP_HOST/_PORT, and a bad integer in a
variable is refused naming it (``--help`` still works)."""

from __future__ import annotations

import pytest

from syncd.engine.dynamo import frontend, serve


@pytest.mark.parametrize("parser, base", [(frontend.parser, []), (serve.parser, ["--model", "m"])])
def test_both_read_the_frontend_variables(monkeypatch, parser, base):
    monkeypatch.setenv("SYNCD_DYNAMO_HTTP_HOST", "0.0.0.0")
    monkeypatch.setenv("SYNCD_DYNAMO_HTTP_PORT", "8123")
    monkeypatch.setenv("DYN_MIGRATION_LIMIT", "5")
    args = parser().parse_args(base)
    assert (args.http_host, args.http_port, args.migration_limit) == ("0.0.0.0", 8123, 5)
    assert parser().parse_args([*base, "--http-port", "9"]).http_port == 9  # the flag wins


@pytest.mark.parametrize("parser, base, var", [(frontend.parser, [], "SYNCD_DYNAMO_HTTP_PORT"),
                                               (serve.parser, ["--model", "m"], "SYNCD_DYNAMO_HTTP_PORT"),
                                               (serve.parser, ["--model", "m"], "SYNCD_DYNAMO_WORKERS")])
def test_a_bad_integer_variable_is_named_and_help_still_works(monkeypatch, capsys, parser, base, var):
    monkeypatch.setenv(var, "abc")
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(base)
    assert exc.value.code == 2 and f"'abc' is not an integer (the flag, or {var})" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--help"])
    assert exc.value.code == 0 and "--http-port" in capsys.readouterr().out
