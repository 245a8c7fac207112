"""What this repository runs beside the library and that the library never imports: the crash-and-resume demo
(`python -m examples.demo`, what `make demo` runs), tiny models built from config with real text and a BPE tokenizer
(`examples.toy`, `examples.toy_text`), and the recorded signal traces and corpus the policy's tests, the benchmarks
and the learned double-check's training read (`examples.traces`, `examples.corpus`). Import them from the
repository's root (`from examples import toy`)."""
