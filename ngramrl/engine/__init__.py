"""Engine adapters: ngramrl inside vLLM (a speculative proposer and the plugin that binds it)."""
