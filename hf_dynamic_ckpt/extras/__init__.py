"""What the core never imports: the timeline plot and the optional learned double-check.

    from hf_dynamic_ckpt.extras.plot import plot_timeline

`learned` and `features` are the optional learned double-check (`learned_model`) and its input features.
The demo, the toy models and the recorded traces live outside the package, in the repository's `examples/`.

The core (every module outside `extras/`) does not import this package except at two sites,
each inside the one function that needs it and named in `tests/unit/test_import_rules.py`: the
`hf-dynamic-ckpt plot` command (`extras.plot`) and `RulePolicy` when `learned_model` is set
(`extras.learned.check_factory`, seen by the policy only as a `policy.rules.DoubleCheck`).
"""
