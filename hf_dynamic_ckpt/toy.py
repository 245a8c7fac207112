"""Tiny models, real text and datasets built in code: demos, `--tiny` recipes, tests, benchmarks.

Nothing here downloads anything. Models are built from a config with a fixed seed; the
text is the English of the Python standard library's docstrings (on every machine); the
tokenizer is a small byte-level BPE trained on it in about a second. Every builder is
deterministic given its arguments and leaves the global RNG streams untouched.

Importing this module is cheap: transformers, peft, datasets and tokenizers are imported
inside the functions that need them.

Example:
    ```python
    >>> from hf_dynamic_ckpt import toy
    >>> texts = toy.text_corpus(max_chars=50_000)
    >>> tok = toy.train_tokenizer(texts, vocab_size=512)
    >>> ds = toy.lm_dataset(tok, texts, seq_len=32, num_examples=64)
    >>> model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=len(tok)), r=4)
    ```
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import logging
import pkgutil
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    import datasets
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2ForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
DEFAULT_LORA_TARGETS: tuple[str, ...] = ("q_proj", "v_proj")

# Top-level standard-library names never imported for the corpus: GUI toolkits, modules that
# print or open a browser on import, the test suite, and installers.
_SKIP_TOP = frozenset(
    {
        "antigravity", "this", "test", "idlelib", "tkinter", "turtle", "turtledemo", "ensurepip",
        "lib2to3", "pydoc_data", "venv", "msilib", "winreg", "winsound", "_winapi", "nt",
        "msvcrt", "xxsubtype", "xxlimited", "xxlimited_35", "sre_compile", "sre_constants",
        "sre_parse", "asynchat", "asyncore", "smtpd", "imp", "distutils", "readline", "rlcompleter",
        "curses", "webbrowser",
    }
)
_MIN_PARAGRAPH_CHARS = 40

_corpus_lock = threading.Lock()
_corpus: list[str] = []
_corpus_chars = 0
_corpus_iter: Iterator[str] | None = None


def _module_names() -> list[str]:
    """Standard-library modules and their submodules, in a fixed (sorted) order."""
    names: list[str] = []
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in _SKIP_TOP:
            continue
        names.append(top)
        spec = importlib.util.find_spec(top) if _safe_has_spec(top) else None
        if spec is not None and spec.submodule_search_locations:
            subs = sorted(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations))
            names.extend(f"{top}.{s}" for s in subs if not s.startswith("_") and "test" not in s)
    return names


def _safe_has_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _import_quietly(name: str) -> Any | None:
    buf = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # a module failing to import in any way is simply not used
        return None


def _docstrings(module: Any) -> Iterator[str]:
    """The module's docstring, then those of its own public classes, functions and methods."""
    doc = inspect.getdoc(module)
    if doc:
        yield doc
    name = module.__name__
    try:
        members = sorted(vars(module).items())
    except TypeError:
        return
    for attr, obj in members:
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            yield doc
        if inspect.isclass(obj):
            for meth_name, meth in sorted(vars(obj).items()):
                if meth_name.startswith("_") or not inspect.isfunction(meth):
                    continue
                doc = inspect.getdoc(meth)
                if doc:
                    yield doc


def _paragraphs() -> Iterator[str]:
    seen: set[str] = set()
    for name in _module_names():
        module = _import_quietly(name)
        if module is None:
            continue
        for doc in _docstrings(module):
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if len(para) >= _MIN_PARAGRAPH_CHARS and para not in seen:
                    seen.add(para)
                    yield para


def text_corpus(max_chars: int = 400_000) -> list[str]:
    """Real English text: paragraphs of the Python standard library's docstrings.

    Modules are visited in sorted order and paragraphs de-duplicated, so the result is the
    same on every call (and on every machine with the same Python version). Paragraphs are
    cached in memory; a call only imports the modules it still needs.

    Args:
        max_chars (`int`, *optional*, defaults to `400_000`): stop once the paragraphs
            returned hold at least this many characters (fewer if the library runs out).

    Returns:
        `list[str]`: paragraphs, whitespace-normalised, each at least 40 characters.

    Raises:
        `ConfigError`: `max_chars` is not positive.
    """
    global _corpus_chars, _corpus_iter
    if max_chars <= 0:
        raise ConfigError(f"max_chars={max_chars!r} is invalid: expected a positive number of characters.")
    with _corpus_lock:
        if _corpus_iter is None and not _corpus:
            _corpus_iter = _paragraphs()
        while _corpus_chars < max_chars and _corpus_iter is not None:
            para = next(_corpus_iter, None)
            if para is None:
                _corpus_iter = None
                break
            _corpus.append(para)
            _corpus_chars += len(para)
        out: list[str] = []
        total = 0
        for para in _corpus:
            if total >= max_chars:
                break
            out.append(para)
            total += len(para)
    return out


def train_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE on `texts` and wrap it for transformers.

    Args:
        texts (`Sequence[str]`): training text, e.g. `text_corpus()`.
        vocab_size (`int`, *optional*, defaults to `512`): size including the 256 byte symbols
            and the two special tokens (`<|endoftext|>` = eos, `<pad>` = pad).

    Returns:
        `transformers.PreTrainedTokenizerFast`: deterministic for the same texts and size.

    Raises:
        `ConfigError`: `vocab_size` cannot hold the byte alphabet, or `texts` is empty.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise ConfigError(f"vocab_size={vocab_size!r} is invalid: expected >= 260 (256 bytes + specials + merges).")
    if not texts:
        raise ConfigError("texts is empty: pass training text, e.g. toy.text_corpus().")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def lm_dataset(
    tokenizer: Any,
    texts: Sequence[str],
    seq_len: int = 32,
    num_examples: int | None = None,
) -> datasets.Dataset:
    """Causal-LM examples: the texts tokenised, joined by eos, cut into `seq_len` blocks.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): e.g. from `train_tokenizer`.
        texts (`Sequence[str]`): the text, in order.
        seq_len (`int`, *optional*, defaults to `32`): tokens per example.
        num_examples (`int`, *optional*): keep the first this many blocks (all when `None`).

    Returns:
        `datasets.Dataset` with `input_ids`, `attention_mask` (all ones) and `labels`
        (= `input_ids`; the model shifts them).

    Raises:
        `ConfigError`: `seq_len` is below 2, or the text holds fewer than `num_examples` blocks.
    """
    import datasets

    if seq_len < 2:
        raise ConfigError(f"seq_len={seq_len!r} is invalid: expected an integer >= 2.")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
        if num_examples is not None and len(ids) >= seq_len * num_examples:
            break
    n = len(ids) // seq_len
    if num_examples is not None:
        if n < num_examples:
            raise ConfigError(
                f"num_examples={num_examples!r} is too many: the text gives only {n} blocks of "
                f"{seq_len} tokens; pass more text (text_corpus(max_chars=...)) or fewer examples."
            )
        n = num_examples
    blocks = [ids[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    return datasets.Dataset.from_dict(
        {"input_ids": blocks, "attention_mask": [[1] * seq_len for _ in blocks], "labels": [list(b) for b in blocks]}
    )


def random_token_dataset(
    num_examples: int = 64, seq_len: int = 16, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0
) -> datasets.Dataset:
    """Uniform random token ids (flat loss; fast, for tests that need no real signal).

    Args:
        num_examples (`int`, *optional*, defaults to `64`): rows.
        seq_len (`int`, *optional*, defaults to `16`): tokens per row.
        vocab_size (`int`, *optional*, defaults to `512`): ids are in `[0, vocab_size)`.
        seed (`int`, *optional*, defaults to `0`): the ids depend only on this and the sizes.

    Returns:
        `datasets.Dataset` with `input_ids`, `attention_mask` and `labels`.
    """
    import datasets
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_examples, seq_len), generator=gen).tolist()
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "attention_mask": [[1] * seq_len for _ in ids], "labels": [list(r) for r in ids]}
    )


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
