"""Helpers the tests share, and bench/ reuses (`from helpers.cluster import RUN` with tests/
on sys.path, as tests/conftest.py and the bench scripts put it): not tests themselves.

- cluster: the run the multi-process tests share, and starting its processes
- hostile: a hostile participant on its own p2pd daemon (tests/test_hostile.py)
- join_any_peer: the join-through-any-peer scenario (tests/test_join_any_peer.py)
- partition: a network partition between namespaced hosts (tests/test_partition.py), and
  the namespaced hosts tests/test_netns.py and tests/test_nat.py run on
- hooked_peer: a peer daemon that misbehaves on purpose (a program: `start_hooked_peer`)
- fuzz_properties: the properties and input generators of tests/test_fuzz.py
"""
