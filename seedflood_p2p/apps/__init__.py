"""Applications: the `seedflood` command line, the local demo, the launcher of local nodes."""
