"""Tests: soak."""
