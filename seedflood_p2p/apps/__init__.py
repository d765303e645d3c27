"""Applications: the local commands, the demo and its launcher, the status screen, export.

The `seedflood` command line that runs them sits above this layer (`seedflood/cli.py`,
beside the daemons `peer/` and `bootstrap/`): nothing here imports it or the daemons."""
