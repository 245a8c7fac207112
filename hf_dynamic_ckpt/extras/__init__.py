"""What the core never imports: the demo, toy models and text, the timeline plot, the learned double-check.

    from hf_dynamic_ckpt.extras import toy              # tiny models from config, real text, a BPE tokenizer
    python -m hf_dynamic_ckpt.extras.demo --output_dir demo_out   # what `make demo` runs
    from hf_dynamic_ckpt.extras.plot import plot_timeline

`learned`, `features` and `corpus` are the optional learned double-check (`learned_model`), its
input features and its training corpus; `traces` loads and replays recorded signal traces
(`scripts/record_traces.py`) for the policy's tests, benchmarks and the model's training.

The core (every module outside `extras/`) does not import this package except at two sites,
each inside the one function that needs it and named in `tests/unit/test_import_rules.py`: the
`hf-dynamic-ckpt plot` command (`extras.plot`) and `RulePolicy` when `learned_model` is set
(`extras.learned.check_factory`, seen by the policy only as a `policy.rules.DoubleCheck`).
"""
