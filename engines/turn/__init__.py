"""End-of-turn scorers for semantic_vad: the text scorer's prompt and the acoustic (Smart Turn) model."""
