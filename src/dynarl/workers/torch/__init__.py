"""Reference backends on torch + transformers: a rollout engine, an inference worker
and a trainer that run the whole pipeline on CPU (and unchanged on a GPU)."""
