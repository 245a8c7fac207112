"""Real English text, a BPE tokenizer and datasets for `toy` (the standard library's docstrings).

Split from `toy` (models there); use it through `examples.toy`.
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

from hf_dynamic_ckpt.errors import ConfigError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"

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
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_examples, seq_len), generator=gen).tolist()
    try:
        import datasets
    except ImportError:  # the same rows as a list (Trainer takes one): the GPU machine has no `datasets`
        return [{"input_ids": r, "attention_mask": [1] * seq_len, "labels": list(r)} for r in ids]  # type: ignore
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "attention_mask": [[1] * seq_len for _ in ids], "labels": [list(r) for r in ids]}
    )


