"""The harness: local networks of real daemons, for the tests and the benchmarks alike.

Not part of the product (no package installs it) and not tests themselves: the scenarios
and misbehaving participants that tests/ asserts on and bench/ measures, kept here so that
neither imports the other. pytest puts the repository root on sys.path
(pyproject's `pythonpath`); bench scripts insert it themselves.

- cluster: the run the multi-process tests share, and starting its processes
- open_run: flags and log waits of open-ended runs that stop once a property is shown
- scenario: running a cluster to a common final round
- hostile: a hostile participant on its own p2pd daemon (tests/test_hostile.py)
- join_any_peer: the join-through-any-peer scenario (tests/test_join_any_peer.py)
- partition: a network partition between namespaced hosts (tests/test_partition.py), and
  the namespaced hosts tests/test_netns.py and tests/test_nat.py run on
- hooked_peer: a peer daemon that misbehaves on purpose (a program: `start_hooked_peer`)
- fuzz_properties: the properties and input generators of tests/test_fuzz.py
"""
