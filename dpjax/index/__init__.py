"""Phrase index: dumping token vectors of a corpus, faiss indexes over them."""
