"""The dense transformer stack: TP/SP linear layers, embeddings and loss, norms, RoPE, attention, CP, MLP."""
