"""Tests: notebook."""
