"""The agent harness, trainer side (``docs/agent-harness.md``): sandboxes per trajectory (``sandbox``, run through
``jail``), the task family of tiny repositories with an injected bug (``repos``), verifiers on the grader's copy
(``grader``), verifier QA with quarantine (``qa``), the tool-execution loop (``episode``) and the tasks'
environments (``envs``), and a format warm-up for tiny models (``warmup``). It imports ``syncd.trainer.rewards``,
never ``syncd.trainer.rl`` (whose ``agent_tasks`` put these in the loop)."""

from syncd.trainer.agent.sandbox import (Limits, Sandbox, SandboxError, SandboxUnavailable, ToolResult, copy_tree,
                                         isolation)

__all__ = ["Limits", "Sandbox", "SandboxError", "SandboxUnavailable", "ToolResult", "copy_tree", "isolation"]
