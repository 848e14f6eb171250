"""Tests: containers."""
