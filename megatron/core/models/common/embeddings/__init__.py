"""Token, position and rotary embeddings."""
