"""The service: the order of operations, single-flight, fleet, breaker, invalidation."""
