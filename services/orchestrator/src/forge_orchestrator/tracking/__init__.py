"""Experiment tracking in MLflow: the tracker and the tag contract every run follows
(``tracker``), the consumer that records the platform's training jobs as runs from their events
(``consumer``) and ``forge runs`` (``cli``)."""
