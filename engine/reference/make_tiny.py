"""Write a tiny random-init model and a tiny tokenizer to a local folder (nothing is downloaded).

    python -m syncd.engine.reference.make_tiny --out DIR [--moe] [--arch qwen2|llama|qwen3_moe|mixtral] [--seed N]
                                         [--nvfp4]

The folder holds ``config.json``, ``model.safetensors`` (bf16), ``generation_config.json``,
``tokenizer.json`` (byte-level BPE without merges: every byte is a token, so any text round-trips) and
``tokenizer_config.json`` (``tokenizer_class: PreTrainedTokenizerFast``, a ChatML ``chat_template``
inline), which is what ``transformers.AutoTokenizer``/``AutoModelForCausalLM`` and NVIDIA Dynamo's frontend
need. Dense: Qwen2 (default, q/k/v biases) or Llama; MoE (``--moe``): Qwen3-MoE (default) or Mixtral.
``--nvfp4`` (dense only) stores the decoder's linear weights as NVFP4 triples (``<name>.qdata``,
``.scales``, ``.per_tensor_scale``; ``docs/nvfp4.md``), quantized from the bf16 weights, which
``ReferenceEngine.from_pretrained`` serves.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: 256 byte tokens, 3 specials, padded to a multiple of 64
VOCAB_SIZE = 320
EOS = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHS = ("qwen2", "llama", "qwen3_moe", "mixtral")


def tokenizer_json() -> str:
    """A byte-level BPE tokenizer with no merges (one token per byte) plus the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str()


def special_ids() -> dict[str, int]:
    return {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}


def model_config(arch: str = "qwen2", *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 128, vocab: int = VOCAB_SIZE, experts: int = 8, top_k: int = 2,
                 max_positions: int = 2048):
    """A transformers config of the given architecture and size (tiny by default)."""
    import transformers as tf

    ids = special_ids()
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=max_positions, tie_word_embeddings=False,
                  bos_token_id=ids["<|endoftext|>"], eos_token_id=ids[EOS], pad_token_id=ids["<|endoftext|>"])
    if arch == "qwen2":
        return tf.Qwen2Config(intermediate_size=intermediate, **common)
    if arch == "llama":
        return tf.LlamaConfig(intermediate_size=intermediate, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=intermediate, moe_intermediate_size=intermediate // 2,
                                 num_experts=experts, num_experts_per_tok=top_k, head_dim=hidden // heads,
                                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **common)
    if arch == "mixtral":
        return tf.MixtralConfig(intermediate_size=intermediate, num_local_experts=experts,
                                num_experts_per_tok=top_k, **common)
    raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")


def random_model(config, seed: int = 0):
    """A random-init causal LM for ``config`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from syncd.lazy import quiet_optional_imports

    quiet_optional_imports()
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def write_tokenizer(out: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json())
    ids = special_ids()
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in ids.items()}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "eos_token": EOS,
           "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None, "model_max_length": 2048,
           "clean_up_tokenization_spaces": False, "added_tokens_decoder": added}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": "<|endoftext|>"}))


DENSE = ("qwen2", "llama")


def write_model(out: Path, *, arch: str = "qwen2", seed: int = 0, nvfp4: bool = False, **size) -> Path:
    """Write a tiny random-init model of ``arch`` (bf16 safetensors), its config and the tokenizer to ``out``.
    ``nvfp4``: the linear weights of the decoder layers as NVFP4 triples instead (what
    ``syncd.ops.nvfp4.quantize_state_dict`` picks; dense architectures only, else ValueError)."""
    import torch
    from safetensors.torch import save_file

    if nvfp4 and arch not in DENSE:
        raise ValueError(f"NVFP4 tiny models are dense ({', '.join(DENSE)}), not {arch}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(arch, **size)
    model = random_model(config, seed)
    config.architectures = [type(model).__name__]  # Dynamo's frontend refuses a config without it
    config.save_pretrained(out)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if nvfp4:
        from syncd.ops.nvfp4 import quantize_state_dict

        state = quantize_state_dict(state, dtype=torch.bfloat16)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = special_ids()
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids[EOS], "pad_token_id": ids["<|endoftext|>"]}))
    write_tokenizer(out)
    log.info("wrote a tiny %s model (%d parameters%s) to %s", arch, sum(p.numel() for p in model.parameters()),
             ", NVFP4" if nvfp4 else "", out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m syncd.engine.reference.make_tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to write (created)")
    p.add_argument("--moe", action="store_true", help="a mixture-of-experts model (default arch qwen3_moe)")
    p.add_argument("--arch", choices=ARCHS, help="architecture (default qwen2, or qwen3_moe with --moe)")
    p.add_argument("--seed", type=int, default=int(os.environ.get("SYNCD_SEED", "0")))
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--nvfp4", action="store_true", help="store the linear weights as NVFP4 (dense models only)")
    p.add_argument("--log-level", default=os.environ.get("SYNCD_LOG_LEVEL", "WARNING"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper())
    arch = a.arch or ("qwen3_moe" if a.moe else "qwen2")
    if a.moe and arch not in ("qwen3_moe", "mixtral"):
        p.error(f"--moe needs a MoE architecture, not {arch}")
    try:
        write_model(Path(a.out), arch=arch, seed=a.seed, hidden=a.hidden, layers=a.layers,
                    intermediate=2 * a.hidden, nvfp4=a.nvfp4)
    except (OSError, ValueError) as exc:
        print(f"make_tiny: {exc}", file=sys.stderr)
        return 1
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
