"""Speech synthesis: Piper voices (VITS on onnxruntime), its split graph and bfloat16 decoder, and the
cutting of reply text into speakable chunks."""
