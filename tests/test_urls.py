"""``syncd.urls.check_http_url``: the start-up check of a URL flag. A good URL comes back unchanged; every bad one
is refused with a message that names the flag, the value and what is wrong."""

from __future__ import annotations

import pytest

from syncd.urls import check_http_url


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://frontend.example.com", "http://localhost:9000/",
                                 "http://[::1]:8000", "HTTP://host:1/prefix/v", "http://user@host:65535"])
def test_a_good_url_comes_back_unchanged(url):
    assert check_http_url(url, "--upstream") == url


@pytest.mark.parametrize("url, why", [
    ("127.0.0.1:8000", "has no scheme (did you mean http://127.0.0.1:8000?)"),
    ("localhost:8000", "has no scheme (did you mean http://localhost:8000?)"),
    ("frontend", "has no scheme"),
    ("ftp://host:21", "has the scheme 'ftp'"),
    ("://host", "has no scheme"),
    ("http://", "names no host"),
    ("http://:8000", "names no host"),
    ("http://host:abc", "has an invalid port"),
    ("http://host:70000", "has an invalid port"),
    ("http://host:0", "has an invalid port"),
    ("http://host:", "has an invalid port"),
    ("http://host:8000?x=1", "has a query or fragment"),
    ("http://host:8000#top", "has a query or fragment"),
    (" http://host:8000", "white space"),
    ("http://ho st:8000", "white space"),
])
def test_a_bad_url_is_named_with_the_flag_and_the_reason(url, why):
    with pytest.raises(ValueError) as info:
        check_http_url(url, "--upstream (SYNCD_PROXY_UPSTREAM)")
    msg = str(info.value)
    assert msg.startswith(f"--upstream (SYNCD_PROXY_UPSTREAM) {url!r} ") and why in msg, msg
    assert "e.g. http://127.0.0.1:8000" in msg


@pytest.mark.parametrize("value", [None, "", 8000])
def test_a_missing_or_non_text_value_is_named(value):
    with pytest.raises(ValueError, match=r"^--proxy must be an http:// or https:// URL, e\.g\. http://h:1; got"):
        check_http_url(value, "--proxy", example="http://h:1")

