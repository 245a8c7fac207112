"""A training run's orchestration: probes -> policy -> saves, and the resume, behind one `RunOrchestrator`.

`orchestrator.RunOrchestrator` is the one object both integrations drive; it owns the save path (a decision becomes a
committed checkpoint) and applies what its collaborators return: `sensing` (the probes' reduced signal frame, the
preemption flag), `saver` (the memory tier, a killed run's slots), `resume` (a resume is read, verified and planned
into a value the orchestrator applies) and `record` (the run's record of its saves, one row per step, the timeline
figure).
"""
