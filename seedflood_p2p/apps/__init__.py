"""Applications: the `seedflood` command line, the local demo, the status screen, the launcher.

The daemons (`peer/`, `bootstrap/`) sit above this layer: the command line names
their subcommands by module and imports them only when one is run."""
