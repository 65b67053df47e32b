"""Real models and task data, all offline: the SmolLM2 checkpoint a package ships, and workloads."""
