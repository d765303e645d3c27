"""Core: the user-facing error type, run settings (`RunConfig`), logging.

No torch and no network here; every other layer may import it."""
