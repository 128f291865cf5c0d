"""Vocabulary shared by every layer: ids, errors, the clock."""
