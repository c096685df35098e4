"""Chunked video decode: the Wan VAE decoder engine and the frame plans it steps through."""
