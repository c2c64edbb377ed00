"""Ways of choosing the next tokens on top of a plain step: sampling (temperature, top-k/p, min-p,
penalties, seeds), speculative decoding (n-gram and draft-model proposers, verification), beam search.

May import: `pagedchat.engine.core` and `pagedchat.engine.kv`. Never the engine API above it."""
