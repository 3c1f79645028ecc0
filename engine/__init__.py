"""The model-agnostic engine core: wire types, configuration, the control plane
and mailboxes, the scheduler, the engine loop, and the async ``EngineClient``.
Pure Python: imports neither ``server`` nor ``workers`` nor torch."""
