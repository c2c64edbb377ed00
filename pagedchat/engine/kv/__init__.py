"""The KV pool and what lies under it: the block pool (refcounts, prefix-cache hashes, copy-on-write, LRU of
free blocks), the host-RAM and disk tiers below it, and the fingerprint that names a model's blocks on disk.

Knows block ids, token ids and bytes; never sequences, requests or models. Imports nothing else of the
engine."""
