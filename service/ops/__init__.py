"""Operators' tools: the SQLite dead-letter store and the controls over it."""
