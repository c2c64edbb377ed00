"""The step machinery: what a request is (config, sampling params, sequences, logprob and grammar requests),
how a step is scheduled (scheduler, sliding-window block tables) and run (runner, the model-free seams), and
how its tokens become text (output processor, detokenizer).

May import: `pagedchat.engine.kv` (the pool), `pagedchat.model`, `pagedchat.kernels`, `pagedchat.native`.
Never `pagedchat.engine.decoding` or the engine API above it."""
