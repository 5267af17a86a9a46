"""The HTTP edge: app and routes, the per-route wrapper, handlers, admin and operator endpoints,
auth, rendering of OpenAI JSON and SSE, and the one adapter over aiohttp internals."""
