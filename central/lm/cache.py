"""The project's on-disk artefact cache (moved to :mod:`fedsim.cache`; re-exported for the centralised track)."""

from fedsim.cache import atomic_write_bytes, cache_dir, cached_state, key_of

__all__ = ["atomic_write_bytes", "cache_dir", "cached_state", "key_of"]
