"""Checking the HTTP URLs an operator gives on a command line, at start-up, with a message that names the flag.

A URL without a scheme (``127.0.0.1:8000``) is the common mistake: an HTTP client then fails every request
later, far from the flag that caused it. :func:`check_http_url` refuses it, and every other value that cannot
be an HTTP base URL, before anything starts. Part of the syncd core: any CLI can use it (imports nothing of
syncd).
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["check_http_url"]


def check_http_url(value, flag: str, *, example: str = "http://127.0.0.1:8000") -> str:
    """``value`` if it is an ``http://`` or ``https://`` URL with a host (a valid port and a path are
    allowed; no query, fragment or white space), else ``ValueError`` naming ``flag`` (how the value was
    given: ``"--upstream"``, or ``"--upstream (SYNCD_PROXY_UPSTREAM)"``), the value and what is wrong, with
    ``example`` as a URL that would do. Returns ``value`` unchanged."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{flag} must be an http:// or https:// URL, e.g. {example}; got {value!r}")

    def bad(why: str) -> ValueError:
        return ValueError(f"{flag} {value!r} {why}: it must be an http:// or https:// URL, e.g. {example}")

    if value != value.strip() or any(c.isspace() or ord(c) < 32 for c in value):
        raise bad("holds white space or control characters")
    u = urlsplit(value)
    scheme = u.scheme.lower()
    if scheme not in ("http", "https"):
        if "://" not in value:
            raise bad(f"has no scheme (did you mean http://{value}?)")
        raise bad(f"has the scheme {u.scheme!r}" if u.scheme else "has no scheme")
    if not u.hostname:
        raise bad("names no host")
    try:
        port = u.port  # parsing it is the check: a port that is not a number, or past 65535, raises
    except ValueError:
        raise bad("has an invalid port") from None
    if port == 0 or u.netloc.endswith(":"):
        raise bad("has an invalid port")
    if u.query or u.fragment or value.endswith(("?", "#")):
        raise bad("has a query or fragment")
    return value
