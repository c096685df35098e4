"""Speech recognition: the recogniser contract (contract.py), the registry that picks a backend by name,
and the backends (Whisper on CTranslate2 and on torch, PocketSphinx)."""
