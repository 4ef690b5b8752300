"""The fault harness: host faults — pause, full disk,
clock skew, network namespaces (``host``), YAML scenarios (``scenario``) and the history checker
(``history``). The fault-injecting TCP proxy is
:mod:`forge_kit.testing.fault_proxy`."""
