"""GPTQ: the column sweep, the in-order (sequential) Hessians, the asymmetric variant and the
replayed partial forwards."""
