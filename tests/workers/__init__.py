"""Tests: workers."""
