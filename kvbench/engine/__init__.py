"""Layer 6, the engine: the replay loop (replay), its settings (config), what a run writes
(records), and the check of the paged engine against transformers (selfcheck)."""
