"""Test, benchmark and training tooling (not used by the server at run time):
small random-weight checkpoints in the real Hugging Face layout, the HF-layout
writer, and the byte-level tokenizer builder of the demo model."""
