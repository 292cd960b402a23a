"""Python client for pe-serve."""
