"""Synchronisation strategies: how workers' models are kept in agreement."""
