"""Tiny models, real text and datasets built in code: demos, `--tiny` recipes, tests, benchmarks.

Nothing here downloads anything. Models are built from a config with a fixed seed; the
text is the English of the Python standard library's docstrings (on every machine); the
tokenizer is a small byte-level BPE trained on it in about a second. Every builder is
deterministic given its arguments and leaves the global RNG streams untouched.

Importing this module is cheap: transformers, peft, datasets and tokenizers are imported
inside the functions that need them.

Example:
    ```python
    >>> from examples import toy
    >>> texts = toy.text_corpus(max_chars=50_000)
    >>> tok = toy.train_tokenizer(texts, vocab_size=512)
    >>> ds = toy.lm_dataset(tok, texts, seq_len=32, num_examples=64)
    >>> model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=len(tok)), r=4)
    ```
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from examples.toy_text import (
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    PAD_TOKEN,
    lm_dataset,
    random_token_dataset,
    text_corpus,
    train_tokenizer,
)

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

__all__ = ["DEFAULT_LORA_TARGETS", "DEFAULT_VOCAB_SIZE", "EOS_TOKEN", "PAD_TOKEN", "lm_dataset", "lora",
           "random_token_dataset", "text_corpus", "tiny_llama", "tiny_qwen2", "train_tokenizer"]

logger = logging.getLogger(__name__)

DEFAULT_LORA_TARGETS: tuple[str, ...] = ("q_proj", "v_proj")


def _seeded(seed: int) -> contextlib.AbstractContextManager[Any]:
    import torch

    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    torch.manual_seed(seed)
    return stack


def _tiny_causal_lm(
    arch: str, seed: int, hidden_size: int, num_layers: int, vocab_size: int, dropout: float, tie: bool,
    kw: dict[str, Any],
) -> Any:
    """Build `tiny_qwen2` (`arch="qwen2"`) or `tiny_llama` (`arch="llama"`): one config recipe for both."""
    import transformers

    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    heads = kw.pop("num_attention_heads", 4)
    args = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": kw.pop("intermediate_size", 2 * hidden_size),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kw.pop("num_key_value_heads", max(1, heads // 2)),
        "max_position_embeddings": kw.pop("max_position_embeddings", 256),
        "attention_dropout": dropout,
        "tie_word_embeddings": tie,
    }
    args.update(kw)
    config = config_cls(**args)
    with _seeded(seed):
        model = model_cls(config)
    model.train()
    return model


def tiny_qwen2(
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    dropout: float = 0.0,
    tie_word_embeddings: bool = False,
    **kw: Any,
) -> Qwen2ForCausalLM:
    """A small `Qwen2ForCausalLM` built from config (about 150k parameters by default).

    Args:
        seed (`int`, *optional*, defaults to `0`): initial weights depend only on this and the
            config; the global RNG is left as it was.
        hidden_size (`int`, *optional*, defaults to `64`): width (4 heads, 2 key/value heads).
        num_layers (`int`, *optional*, defaults to `2`): decoder layers.
        vocab_size (`int`, *optional*, defaults to `512`): match the tokenizer (`len(tok)`).
        dropout (`float`, *optional*, defaults to `0.0`): attention dropout.
        tie_word_embeddings (`bool`, *optional*, defaults to `False`): share input/output embeddings.
        **kw: any other `Qwen2Config` field (e.g. `intermediate_size`, `num_attention_heads`).

    Returns:
        `transformers.Qwen2ForCausalLM` in training mode.
    """
    return _tiny_causal_lm("qwen2", seed, hidden_size, num_layers, vocab_size, dropout, tie_word_embeddings, kw)


def tiny_llama(
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    dropout: float = 0.0,
    tie_word_embeddings: bool = False,
    **kw: Any,
) -> LlamaForCausalLM:
    """A small `LlamaForCausalLM` built from config; arguments as in `tiny_qwen2`.

    Returns:
        `transformers.LlamaForCausalLM` in training mode.
    """
    return _tiny_causal_lm("llama", seed, hidden_size, num_layers, vocab_size, dropout, tie_word_embeddings, kw)


def lora(
    model: torch.nn.Module,
    r: int = 4,
    target_modules: Sequence[str] = DEFAULT_LORA_TARGETS,
    *,
    alpha: int | None = None,
    dropout: float = 0.0,
    seed: int = 0,
) -> PeftModel:
    """Wrap `model` with a LoRA adapter (`peft.get_peft_model`), deterministically.

    Args:
        model (`torch.nn.Module`): a causal LM, e.g. `tiny_qwen2()`.
        r (`int`, *optional*, defaults to `4`): LoRA rank.
        target_modules (`Sequence[str]`, *optional*, defaults to `("q_proj", "v_proj")`).
        alpha (`int`, *optional*): LoRA alpha; `2 * r` when `None`.
        dropout (`float`, *optional*, defaults to `0.0`): LoRA dropout (uses the global RNG in training).
        seed (`int`, *optional*, defaults to `0`): the adapter's initial `lora_A` weights.

    Returns:
        `peft.PeftModel` whose only trainable parameters are the adapter's.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
    )
    with _seeded(seed):
        peft_model = get_peft_model(model, config)
    return peft_model
