"""A real (tiny) model trained with real optimizer steps, shared by the store, trainer and bench tests.

``trajectory(n)`` returns the bf16 state dicts a trainer would publish after each of ``n`` AdamW steps on a
random-init Qwen2 (about 107k parameters), computed once per process and cached.
"""

from __future__ import annotations

import functools

import torch


def tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def train_steps(model, n: int, *, lr: float = 1e-5, seed: int = 0, callback=None) -> None:
    """``n`` real AdamW steps of next-token loss on random tokens; ``callback(step, model)`` after each."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # Denormal floats (tiny gradients and Adam moments) run ~50x slower on CPU. Flushing them is a
    # per-thread CPU flag, so the steps run on this thread alone (the model is tiny anyway).
    flush = torch.set_flush_denormal(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(n):
            x = torch.randint(0, model.config.vocab_size, (4, 32), generator=gen).to(model.device)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if callback is not None:
                callback(step, model)
    finally:
        torch.set_num_threads(threads)
        if flush:
            torch.set_flush_denormal(False)


def bf16(state: dict) -> dict:
    return {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach().clone())
            for k, v in state.items()}


MAX_STATES = 32


@functools.lru_cache(maxsize=2)
def _trajectory(seed: int) -> tuple:
    model = tiny_qwen2(seed)
    out = [bf16(model.state_dict())]
    train_steps(model, MAX_STATES - 1, seed=seed, callback=lambda _s, m: out.append(bf16(m.state_dict())))
    return tuple(out)


def trajectory(n: int, seed: int = 0) -> tuple:
    """The serving-dtype (bf16) weights at the initial point and after each of ``n - 1`` AdamW steps
    (``n`` <= 32; computed once per process)."""
    if not 1 <= n <= MAX_STATES:
        raise ValueError(f"at most {MAX_STATES} states")
    return _trajectory(seed)[:n]


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers of the same width (so NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view(_SAME_WIDTH_INT[t.element_size()]) if t.dtype != torch.bool else t


def assert_same(got: dict, want: dict) -> None:
    """Bit-exact equality of two state dicts, names and order included."""
    assert list(got) == list(want), "tensor names or order differ"
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(bits(got[k].cpu()), bits(want[k].cpu())), f"tensor {k} differs"
