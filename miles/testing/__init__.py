"""The recipe test harness, a pytest plugin (see docs/testing.md)."""
