"""The HTTP edge: app, per-route wrapper, handlers, admin API, auth, rendering."""
