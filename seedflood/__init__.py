"""The `seedflood` command (`cli.py`): the top of the daemon layer, beside `peer/` and
`bootstrap/`, so it imports their subcommands as plainly as the library's."""
