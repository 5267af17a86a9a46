"""Keys: canonical request, field readers, key, fingerprint, digests, record codec."""
