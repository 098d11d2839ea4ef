"""How a quantize run executes: in memory, streamed block by block, model-free, distributed, and
the choice between them."""
