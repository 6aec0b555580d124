"""Destinations: the capture sink, ClickHouse (chDB embedded or a server)."""
