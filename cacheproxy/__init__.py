"""cacheproxy: an exact-match cache reverse proxy in front of an MLX runner."""

__version__ = "0.1.0"
