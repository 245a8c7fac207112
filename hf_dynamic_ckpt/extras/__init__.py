"""What the core imports only inside the one function that needs it: the timeline plot (`extras.plot`, for
`hf-dynamic-ckpt plot`) and the optional learned double-check (`extras.learned`, for `RulePolicy` when
`learned_model` is set). The demo, the toy models and the recorded traces are in the repository's `examples/`."""
