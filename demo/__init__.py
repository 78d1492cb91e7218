"""`llama-jax-demo`: the whole pipeline on a small local model (build, convert, fine-tune, export, serve)."""
