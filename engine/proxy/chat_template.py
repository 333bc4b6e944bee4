"""A model folder's chat template, rendered in the proxy: what self-compaction of ``/v1/chat/completions`` needs
(``syncd.engine.proxy.compaction`` builds every segment of a compacted chat in token space, from this text).

:meth:`ChatTemplate.from_folder` reads the template the way ``transformers`` does: ``chat_template.jinja`` when the
folder has one, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates, of
which the one named ``default``); ``bos_token`` and ``eos_token`` come from ``tokenizer_config.json``. None when
the folder has no template (compaction of chat is then off). :meth:`ChatTemplate.render` renders a chat body's
``messages`` with ``add_generation_prompt=True`` (and its ``chat_template_kwargs``) in a sandboxed Jinja
environment configured as ``transformers.apply_chat_template``'s (``trim_blocks``, ``lstrip_blocks``, loop
controls, ``tojson``, ``raise_exception``, ``strftime_now``).

The text can differ from the frontend's own rendering only where the two Jinja engines differ; the proxy sends
the ids of this text upstream and records exactly them, so the records stay prefix-consistent either way.

Errors: a template that does not compile raises ValueError (naming the file) at start-up; :meth:`render` returns
None for a body it cannot render (malformed messages, a template that raises): the proxy passes such a request on
uncompacted and the frontend answers it. Thread-safety: a rendered template is immutable; safe to share.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["ChatTemplate"]


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


class ChatTemplate:
    """A compiled chat template with the special tokens it may name (see the module docstring)."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None,
                 where: str = "chat template"):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"{where}: the chat template does not compile: {exc}") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    @classmethod
    def from_folder(cls, folder) -> "ChatTemplate | None":
        """The folder's template (see the module docstring), or None when it has none."""
        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{config_path}: not a tokenizer configuration ({exc})") from None
        config = config if isinstance(config, dict) else {}
        jinja_path = folder / "chat_template.jinja"
        source, where = config.get("chat_template"), str(config_path)
        if jinja_path.is_file():
            source, where = jinja_path.read_text(), str(jinja_path)
        elif isinstance(source, list):
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str) or not source:
            return None
        return cls(source, bos_token=_token(config.get("bos_token")), eos_token=_token(config.get("eos_token")),
                   where=where)

    def render(self, body: dict) -> str | None:
        """The prompt text of chat ``body`` (its ``messages``, ``add_generation_prompt=True``), or None when it
        cannot be rendered."""
        from jinja2 import TemplateError

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return None
        extra = body.get("chat_template_kwargs")
        extra = extra if isinstance(extra, dict) else {}
        kw = {"bos_token": self.bos_token, "eos_token": self.eos_token, "add_generation_prompt": True, **extra}
        if body.get("tools"):
            kw["tools"] = body["tools"]
        try:
            return self.template.render(messages=messages, **kw)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            log.info("chat body not rendered by the chat template (passed on uncompacted): %s: %s",
                     type(exc).__name__, exc)
            return None


def _token(v) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or an added-token object with ``content``."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None
