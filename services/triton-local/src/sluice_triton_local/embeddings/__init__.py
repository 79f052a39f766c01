"""Sentence embeddings served by triton-local: all-MiniLM-L6-v2 in pure numpy."""

from sluice_triton_local.embeddings.minilm import EMBEDDING_DIM, MiniLMEncoder, minilm_model_dir

__all__ = ["EMBEDDING_DIM", "MiniLMEncoder", "minilm_model_dir"]
