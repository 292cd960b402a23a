"""pe-serve: a transformer inference service whose positional encoding is chosen per request."""
