"""Test support shared by the suites: fixtures for the real dev cluster and the real broker."""
