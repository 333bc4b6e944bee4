"""A short supervised warm-up of a tiny model folder on synthetic demonstrations, and a compact chat template.

What the agent benchmark and the end-to-end tests do before serving a tiny model: a random-init model writes
random bytes, whose text does not round-trip through detokenising and the chat template (so no turn's prompt
would extend the turn before), and never the format a harness reads. :func:`warm_up` teaches a format -- next-token
loss on demonstration texts, AdamW, float32 -- and writes the weights back (bf16 ``model.safetensors``, the names
the engines load); :func:`use_template` replaces the folder's chat template, e.g. with :data:`COMPACT_TEMPLATE`
(``u:...\\na:...\\nt:...\\na:``: the role's first letter, a colon, the content, a newline; the tiny models learn on it
far faster than on ChatML, whose tags put 13 tokens between a tool's output and the answer). Demonstrations
that say nothing about the answer teach the format only; say which were used wherever figures are reported.

Torch and transformers are imported on call. Not thread-safe (it rewrites the folder).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["COMPACT_TEMPLATE", "use_template", "warm_up", "lookup_format_demos"]

COMPACT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] + ':' + (m['content'] or '') + '\n' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ 'a:' }}{% endif %}")


def use_template(model_dir, template: str = COMPACT_TEMPLATE) -> None:
    """Set the chat template of the model folder's ``tokenizer_config.json``."""
    p = Path(model_dir, "tokenizer_config.json")
    cfg = json.loads(p.read_text())
    cfg["chat_template"] = template
    p.write_text(json.dumps(cfg, indent=2))


def lookup_format_demos(n: int, *, alphabet: str = "abcd", length: int = 4, seed: int = 0) -> list[str]:
    """Demonstrations of the ``lookup`` task's format under :data:`COMPACT_TEMPLATE` that teach nothing about its
    answer: a query of letters, the tool's letter, and an answer of letters drawn independently of it."""
    rng = random.Random(seed)
    word = (lambda: "".join(rng.choice(alphabet) for _ in range(length)))
    return [f"u:q\na:{word()}\nt:{rng.choice(alphabet)}\na:{word()}" for _ in range(n)]


def warm_up(model_dir, texts: list[str], *, steps: int = 40, batch: int = 16, lr: float = 3e-3,
            seed: int = 0) -> float:
    """``steps`` AdamW steps of next-token loss on ``texts`` (tokenized by the folder's ``tokenizer.json``, ``batch``
    per step, cut to the shortest of the batch), the weights written back to ``model_dir``; returns the last loss."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from syncd.lazy import quiet_optional_imports

    quiet_optional_imports()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    loss = float("nan")
    tok = Tokenizer.from_file(str(Path(model_dir, "tokenizer.json")))
    model.train()
    for _ in range(steps):
        rows = [tok.encode(t, add_special_tokens=False).ids for t in rng.choices(texts, k=batch)]
        width = min(len(r) for r in rows)
        x = torch.tensor([r[:width] for r in rows])
        out = model(input_ids=x[:, :-1], labels=x[:, 1:].contiguous()).loss
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.detach())
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(Path(model_dir, "model.safetensors")), metadata={"format": "pt"})
    return loss
