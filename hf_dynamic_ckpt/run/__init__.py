"""A training run's orchestration: probes -> policy -> saves, and the resume, behind one `RunOrchestrator`.

`orchestrator.RunOrchestrator` is the one object both integrations drive. It owns the run's
collaborators and applies what they return: `sensing` (the probes' reduced signal frame),
`saver` (a decision becomes a committed checkpoint), `savelog` (the run's record of its
saves), `resume` and `restore` (a resume is read, verified and planned into a value the
orchestrator applies), `steplog` (one row per step for the plot) and `fsdp` (sharded state).
"""
