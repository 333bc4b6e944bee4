"""The agent harness, trainer side: sandboxes per trajectory (``sandbox``, its ``jail``)."""

from syncd.trainer.agent.sandbox import (Limits, Sandbox, SandboxError, SandboxUnavailable, ToolResult, copy_tree,
                                         isolation)

__all__ = ["Limits", "Sandbox", "SandboxError", "SandboxUnavailable", "ToolResult", "copy_tree", "isolation"]
