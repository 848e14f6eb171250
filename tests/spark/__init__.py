"""Tests: spark."""
