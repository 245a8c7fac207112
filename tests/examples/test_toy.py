"""toy.py: deterministic tiny models, real text, tokenizer and datasets (no downloads)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from examples import toy
from hf_dynamic_ckpt.errors import ConfigError


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return toy.text_corpus(max_chars=120_000)


@pytest.fixture(scope="module")
def tokenizer(texts):
    return toy.train_tokenizer(texts, vocab_size=384)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_FINGERPRINT = """
import hashlib, json, torch
torch.set_num_threads(1)
from examples import toy
texts = toy.text_corpus(max_chars=120_000)
tok = toy.train_tokenizer(texts, vocab_size=384)
ds = toy.lm_dataset(tok, texts, seq_len=16, num_examples=50)
print(json.dumps({
    "texts": hashlib.sha256("\\n".join(texts).encode()).hexdigest(),
    "vocab": hashlib.sha256(json.dumps(sorted(tok.get_vocab().items())).encode()).hexdigest(),
    "ids": hashlib.sha256(json.dumps(ds.to_dict()["input_ids"]).encode()).hexdigest(),
}))
"""


def test_corpus_is_english_text_and_prefix_stable(texts):
    assert sum(map(len, texts)) >= 120_000
    assert all(len(t) >= 40 and "\n" not in t for t in texts)
    assert len(set(texts)) == len(texts)
    # A smaller request returns a prefix of the larger one (one fixed order, cached).
    small = toy.text_corpus(max_chars=10_000)
    assert small == texts[: len(small)]
    words = " ".join(texts[:200]).split()
    assert sum(w.lower() in {"the", "a", "of", "to", "is"} for w in words) > len(words) // 20


def test_corpus_rejects_nonpositive_size():
    with pytest.raises(ConfigError, match=r"max_chars=0 is invalid"):
        toy.text_corpus(max_chars=0)


def test_corpus_tokenizer_and_dataset_identical_in_a_fresh_process(texts, tokenizer):
    ds = toy.lm_dataset(tokenizer, texts, seq_len=16, num_examples=50)
    here = {
        "texts": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
        "vocab": hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest(),
        "ids": hashlib.sha256(json.dumps(ds.to_dict()["input_ids"]).encode()).hexdigest(),
    }
    out = subprocess.run([sys.executable, "-c", _FINGERPRINT], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_tokenizer_round_trips_text(tokenizer, texts):
    assert len(tokenizer) == 384
    assert tokenizer.eos_token == toy.EOS_TOKEN and tokenizer.pad_token == toy.PAD_TOKEN
    sample = texts[3]
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == sample
    assert len(ids) < len(sample.encode())  # merges were learned: fewer tokens than bytes


def test_tokenizer_rejects_tiny_vocab(texts):
    with pytest.raises(ConfigError, match=r"vocab_size=100 is invalid"):
        toy.train_tokenizer(texts, vocab_size=100)


def test_lm_dataset_blocks(tokenizer, texts):
    ds = toy.lm_dataset(tokenizer, texts, seq_len=16, num_examples=20)
    assert ds.column_names == ["input_ids", "attention_mask", "labels"]
    assert len(ds) == 20
    assert all(len(r) == 16 for r in ds.to_dict()["input_ids"])
    assert ds.to_dict()["labels"] == ds.to_dict()["input_ids"]
    assert all(all(m == 1 for m in r) for r in ds.to_dict()["attention_mask"])
    # Consecutive blocks continue the same token stream.
    stream = []
    for enc in tokenizer(texts[:10], add_special_tokens=False)["input_ids"]:
        stream.extend([*enc, tokenizer.eos_token_id])
    assert [*ds.to_dict()["input_ids"][0], *ds.to_dict()["input_ids"][1]] == stream[:32]


def test_lm_dataset_too_many_examples(tokenizer, texts):
    with pytest.raises(ConfigError, match=r"num_examples=100000 is too many"):
        toy.lm_dataset(tokenizer, texts[:5], seq_len=16, num_examples=100_000)


def test_random_token_dataset_deterministic():
    a = toy.random_token_dataset(num_examples=8, seq_len=6, vocab_size=50, seed=3)
    b = toy.random_token_dataset(num_examples=8, seq_len=6, vocab_size=50, seed=3)
    c = toy.random_token_dataset(num_examples=8, seq_len=6, vocab_size=50, seed=4)
    assert a.to_dict()["input_ids"] == b.to_dict()["input_ids"] != c.to_dict()["input_ids"]
    assert max(max(r) for r in a.to_dict()["input_ids"]) < 50


@pytest.mark.parametrize("builder", [toy.tiny_qwen2, toy.tiny_llama])
def test_models_deterministic_and_leave_global_rng_alone(builder):
    before = torch.get_rng_state()
    a = _params(builder(seed=1, vocab_size=300))
    assert torch.equal(torch.get_rng_state(), before)
    b = _params(builder(seed=1, vocab_size=300))
    c = _params(builder(seed=2, vocab_size=300))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert 50_000 < sum(v.numel() for v in a.values()) < 1_000_000


def test_lora_deterministic_adapter_only_trainable():
    a = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=300), r=4, seed=5)
    b = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=300), r=4, seed=5)
    trainable = [n for n, p in a.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sum(".q_proj." in n for n in trainable) == sum(".v_proj." in n for n in trainable) == 4


def test_loss_falls_on_text(tokenizer, texts):
    ds = toy.lm_dataset(tokenizer, texts, seq_len=32, num_examples=64).with_format("torch")
    model = toy.tiny_qwen2(seed=0, vocab_size=len(tokenizer))
    eval_ids = ds[:16]["input_ids"]

    def eval_loss() -> float:
        with torch.no_grad():
            return model(input_ids=eval_ids, labels=eval_ids).loss.item()

    start = eval_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(8):
        batch = ds[i * 8 : (i + 1) * 8]["input_ids"]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert start > 5.0  # about ln(384) = 5.95 at initialisation
    assert eval_loss() < start - 0.5
