"""Audio conditioning that every door may use: streaming resampling and G.711 (resample.py, pure numpy),
and noise suppression of the input (denoise.py)."""
