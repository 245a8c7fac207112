"""Tools on top of the library that the core never imports: the demo, toy models and text, the timeline plot.

    from hf_dynamic_ckpt.extras import toy              # tiny models from config, real text, a BPE tokenizer
    python -m hf_dynamic_ckpt.extras.demo --output_dir demo_out   # what `make demo` runs
    from hf_dynamic_ckpt.extras.plot import plot_timeline

The core (every module outside `extras/`) does not import this package; the one exception,
the `hf-dynamic-ckpt plot` command, imports `extras.plot` inside the command, and
`tests/unit/test_import_rules.py` names it.
"""
