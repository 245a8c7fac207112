"""The learned model's training corpus (`examples/corpus.py`, `tests/data/traces/corpus.jsonl.gz`): small, split by
run with held-out shapes and timings, replayed as the frames the checkpointer builds, labelled as the model card says.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.corpus import CorpusRun, load_corpus
from hf_dynamic_ckpt.policy.learned import Granularity

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "data" / "traces" / "corpus.jsonl.gz"


@pytest.fixture(scope="module")
def corpus() -> list[CorpusRun]:
    return load_corpus(CORPUS)


def test_corpus_is_small_split_by_run_and_holds_out_shapes_and_timings(corpus: list[CorpusRun]) -> None:
    assert CORPUS.stat().st_size < 5 * 2**20
    splits: dict[str, list[CorpusRun]] = {}
    for run in corpus:
        splits.setdefault(run.split, []).append(run)
    assert {k: len(v) for k, v in splits.items()} == {"train": 128, "validation": 32, "test": 56}
    kinds = {"calm", "loss_x", "bad_batch", "lora_explosion", "lr_surge", "nan_grad", "memory_ramp"}
    assert all({r.kind for r in runs} == kinds for runs in splits.values())
    seen = {(r.header["hidden_size"], r.header["num_layers"]) for r in splits["train"] + splits["validation"]}
    assert all((r.header["hidden_size"], r.header["num_layers"]) not in seen for r in splits["test"])
    latest = max(o for r in splits["train"] + splits["validation"] for o, _ in r.onsets() if r.kind != "memory_ramp")
    assert any(o > latest for r in splits["test"] for o, _ in r.onsets())
    assert {r.header["arch"] for r in corpus} == {"qwen2", "llama"}
    assert {r.header["lora"] for r in corpus} == {True, False}
    assert {r.header["max_grad_norm"] for r in corpus} == {1.0, 0.5, None}
    assert len({r.header["batch_size"] for r in corpus}) == 3 and len({r.header["seed"] for r in corpus}) == len(corpus)


def test_corpus_frames_are_what_replay_frames_gives(corpus: list[CorpusRun]) -> None:
    from examples.traces import RecordedTrace, replay_frames

    for run in (next(r for r in corpus if r.kind == "lora_explosion"), next(r for r in corpus if r.kind == "nan_grad")):
        mine = run.frames()
        theirs = replay_frames(RecordedTrace(name=run.name, header=run.header, rows=run.rows, onsets=[]))
        for a, b in zip(mine, theirs, strict=True):
            assert a.step_time_s is not None
            assert (a.host_mem_frac is not None) == (a.step % 5 == 0)
            a.step_time_s = a.host_mem_frac = None
            assert repr(a) == repr(b)  # NaN-safe field-by-field equality


def test_corpus_labels(corpus: list[CorpusRun]) -> None:
    spike = next(r for r in corpus if r.kind == "loss_x")
    a = spike.anomalies[0]
    score, gran = spike.labels()
    o, end = a["onset"], a["onset"] + a["steps"] + 10
    assert score[o - 1] == 1.0 and gran[o - 1] == Granularity.EVERYTHING
    assert all(s is None for s in score[o:end - 1]) and all(s == 0.0 for s in score[: o - 1])
    assert sum(s == 1.0 for s in score) == 1
    ramp = next(r for r in corpus if r.kind == "memory_ramp" and r.anomalies[0]["cross"] is not None)
    x = ramp.anomalies[0]["cross"]
    score, gran = ramp.labels()
    assert [t for t, s in enumerate(score, 1) if s == 1.0] == list(range(x - 5, x))
    assert all(g == Granularity.KEY_LAYERS_RNG for g in gran[x - 6 : x - 1])
    assert all(s is None for s in score[x - 1 :])
    assert ramp.mem_frac[x - 1] >= 0.92 > ramp.mem_frac[x - 2]
    assert all(s == 0.0 for s in next(r for r in corpus if r.kind == "calm").labels()[0])
