"""Training data, from files to the rows a step reads: where rows come from (`sources`), their layouts
(`layouts`), tokenization into an on-disk store (`workers` schedules the batches, `encoding` encodes them,
`chat_shapes` finds a chat's trained turns, `store` is the store), the cache of stores (`cache`), packing
(`packing`), the batch order (`order`), preference pairs (which train: `pair_filter`; their steps' rows:
`pairs`), and what a run loads (`prepare`). `reference` is the per-row
tokenizer the batched path equals and falls back to; `rows` the types they share.

May import: `finetune.config`, `jaxmodel` (errors and on-disk helpers only), numpy, datasets, tokenizers;
never JAX, so tokenizer worker processes start light (tests/test_architecture.py checks it).
"""
