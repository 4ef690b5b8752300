"""The buckets of the inference gateway's latency histograms (time to first token, inter-token
latency): the gateway records with them and the guarded-canary analysis
(:mod:`forge_experiments.canary`) reads them back, so both take them from here."""

#: 1.15x apart from 2 ms to about 60 s, fine enough to tell a canary's p95 from production's.
LATENCY_BUCKETS = tuple(round(0.002 * 1.15**i, 6) for i in range(75))
