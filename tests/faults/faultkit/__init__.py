"""The fault harness: a fault-injecting TCP proxy (``proxy``), host faults — pause, full disk,
clock skew, network namespaces (``host``), YAML scenarios (``scenario``) and the history checker
(``history``)."""
