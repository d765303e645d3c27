"""Core: the user-facing error type, run settings (`RunConfig`), flags and TOML, logging.

No torch and no network here; every other layer may import it."""
